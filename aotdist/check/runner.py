"""A model trained three ways (eager, whole-model ``torch.compile``, aotdist) and what came
of it: :func:`check_family`, :class:`CheckResult`.

:func:`check_family` trains :data:`STEPS` SGD steps on one batch from the same weights and
the same random seed per step; after each step aotdist must match eager (loss, every
gradient, every buffer: a BatchNorm's running statistics), account for every region
instance (compiled, demoted or run eager with a warning) and crash only where whole-model
``torch.compile`` crashes too. Dropout and stochastic depth are off for the comparison
(random masks are not comparable); a model built with stochastic depth on is compiled once
more as built, and its reuse judged there, since that is how it trains. :func:`aotdist.check.fsdp.check_fsdp`
does the same under FSDP on several ranks.
"""

from __future__ import annotations

import contextlib
import copy
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from aotdist.check.families import (
    Family,
    stochastic_depth,
    without_randomness,
)
from aotdist.check.peers import declares_repeated_blocks, train_repeated_blocks
from aotdist.check.rounding import as_float64, describe, only_rounding, rounding_errors
from aotdist.check.specs import resolve
from aotdist.check.steps import Diff, Run, train
from aotdist.compile.verify import tolerance
from aotdist.errors import first_line

STEPS = 3  # SGD steps each way: a wrong buffer update shows in the next step's loss

# Statuses that fail ``aotdist check`` (non-zero exit) and the zoo's test.
FAILING = ("crash", "parity", "eager!")


@dataclass
class CheckResult:
    """What one check saw. ``status``: ``reused`` (every region one subgraph for all its
    instances), ``partly reused`` (some region demoted, inlined or compiled more than once,
    each named in ``notes``), ``demoted`` (no region kept as a subgraph; the model compiled
    whole), ``no regions`` (nothing repeats), ``torch.compile fails too`` (aotdist fails,
    and whole-model ``torch.compile`` fails, or trains with gradients off eager's by at
    least half as much as aotdist's), or a
    failure: ``crash`` (aotdist fails where whole-model ``torch.compile`` trains as eager
    does), ``not built`` (the tiny config does not build or train eagerly: nothing to
    check), ``parity`` (loss or a gradient differs from eager), ``eager!`` (a region
    instance ran uncompiled without a warning)."""

    name: str
    kind: str = ""
    source: str = ""
    status: str = ""
    fsdp: int = 0  # ranks; 0 without FSDP
    fsdp_mode: str = ""  # "hooks" or "graph" with FSDP
    regions: dict[str, dict[str, int]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # region -> demotion/reuse/eager cause
    whole_model: str = ""  # "trains", "wrong gradients (...)" or "fails: <error>"
    repeated_blocks: str = ""  # the same for diffusers' compile_repeated_blocks, where run
    loss_eager: float | None = None
    loss_aotdist: float | None = None
    max_grad_diff: float | None = None
    whole_model_grad_diff: float | None = None  # the same measure for whole-model compile
    steps: int = 1  # optimizer steps compared
    max_loss_diff: float | None = None  # over the steps, against eager
    max_buffer_diff: float | None = None  # the gradients' measure, for buffers
    stochastic_depth: str = ""  # the status with stochastic depth on, where the model has it
    error: str = ""
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status not in FAILING

    @property
    def loss_diff(self) -> float | None:
        """The largest loss difference from eager over the steps compared."""
        if self.max_loss_diff is not None:
            return self.max_loss_diff
        if self.loss_eager is None or self.loss_aotdist is None:
            return None
        return abs(self.loss_aotdist - self.loss_eager)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    def line(self) -> str:
        """One progress line: name, status, regions and the loss difference."""
        regions = ", ".join(f"{n} x{r['instances']}" for n, r in self.regions.items()) or "-"
        diff = (
            ""
            if self.loss_diff is None
            else f" | loss diff {self.loss_diff:.1e}, grad diff {self.max_grad_diff:.1e}"
        )
        if self.whole_model_grad_diff is not None:
            diff += f" (whole-model compile {self.whole_model_grad_diff:.1e})"
        if self.max_buffer_diff is not None:
            diff += f", buffer diff {self.max_buffer_diff:.1e}"
        if self.steps > 1 and diff:
            diff += f" over {self.steps} steps"
        if self.stochastic_depth:
            diff += f" | stochastic depth on: {self.stochastic_depth}"
        if self.repeated_blocks:
            diff += f" | compile_repeated_blocks: {self.repeated_blocks[:80]}"
        mode = ", graph mode" if self.fsdp_mode == "graph" else ""
        where = f" (FSDP x{self.fsdp}{mode})" if self.fsdp else ""
        text = f"{self.name}{where}: {self.status} | {regions}{diff} | {self.seconds:.0f} s"
        return text + (f" | {self.error.splitlines()[0][:160]}" if self.error else "")


def _classify(result: CheckResult, m, caught: list[str]) -> None:
    """Fills ``status``, ``regions`` and ``notes`` from the aotdist step's metrics."""
    for name, st in m.regions.items():
        result.regions[name] = {
            "instances": st.instances,
            "call_sites": st.call_sites,
            "subgraphs": st.subgraphs,
            "inlined": st.inlined,
            **({"unseen": list(st.unseen)} if st.unseen else {}),
        }
    for source in (m.reuse, m.demoted, m.eager):
        for name, why in source.items():
            result.notes.setdefault(name, why.splitlines()[0][:300])
    for name, st in m.regions.items():
        if st.unseen:
            unseen = (
                f"{len(st.unseen)} instance(s) in no compiled graph ({', '.join(st.unseen[:3])}"
                f"{', ...' if len(st.unseen) > 3 else ''}): not called by this batch's "
                "forward, or run eager after a graph break"
            )
            note = result.notes.get(name)
            result.notes[name] = f"{note}; {unseen}" if note else unseen
    silent = [n for n in m.eager if not any(f"'{n}'" in w for w in caught)]
    if silent:
        result.status = "eager!"
        return
    if not m.regions:
        result.status = "no regions"
        return
    kept = [n for n in m.regions if n not in m.demoted and n not in m.eager]
    if not kept:
        result.status = "demoted"
    elif len(kept) < len(m.regions) or any(n in m.reuse for n in kept):
        result.status = "partly reused"
    else:
        result.status = "reused"


def _train_tracked(family: Family, model: nn.Module, inputs, *, steps: int, **kwargs):
    """:func:`train` under ``metrics.track``: the first step's metrics (how the regions
    compiled: later steps' graphs are not counted as call sites), the run's ``Diff``, and a
    note naming the graphs a later step compiled (a recompile), or ``""``."""
    import aotdist

    with contextlib.ExitStack() as later:
        m = later.enter_context(aotdist.metrics.track(model))
        after = []
        diff = train(
            family,
            model,
            inputs,
            steps=steps,
            after_first=lambda: (
                later.close(),
                after.append(later.enter_context(aotdist.metrics.track(model))),
            ),
            **kwargs,
        )
    if not (after and after[0].graphs):
        return m, diff, ""
    why = "; ".join(_guard(r) for r in after[0].recompiles)[:300] or "a new frame"
    return m, diff, f"steps 2-{steps} compiled {after[0].graphs} more graph(s) ({why})"


def _region_warnings(caught) -> list[str]:
    """Each region warning whole: the cause and the fix (``check --json`` keeps them)."""
    import aotdist

    return [
        str(w.message).strip()
        for w in caught
        if issubclass(w.category, aotdist.RegionCompileWarning)
    ]


def _verdict(
    result: CheckResult,
    m,
    diff: Diff,
    *,
    frames: bool = False,
    whole_zeros: list[str] | None = None,
    ran: dict[str, int] | None = None,
) -> None:
    """Status from the metrics, then ``eager!`` (``frames``: a kept region with fewer
    compiled call sites than instances that ran, ``ran`` counting them per region where
    known) or ``parity`` (``diff``: a loss, gradient or buffer off eager). ``whole_zeros``:
    the zero-for-``None`` gradients of whole-model compile, if it ran."""
    result.max_grad_diff, zeros = diff.grad, diff.zeros
    result.max_buffer_diff = diff.buffer
    if result.steps > 1:
        result.max_loss_diff = diff.loss
    _classify(result, m, result.warnings)
    if zeros:
        result.notes["gradients"] = (
            f"{len(zeros)} parameter(s) ({', '.join(zeros[:3])}"
            f"{', ...' if len(zeros) > 3 else ''}) get zero gradients where eager leaves "
            "them None: they feed only an output the loss does not use, and a compiled "
            "backward gives such parameters zeros"
        )
        if whole_zeros is not None:
            differ = [n for n in zeros if n not in whole_zeros]
            result.notes["gradients"] += (
                f"; whole-model compile leaves {len(differ)} of them None ({differ[0]}...)"
                if differ
                else " (whole-model compile too)"
            )
    for name, st in m.regions.items() if frames else ():
        called = st.instances if ran is None else ran.get(name, st.instances)
        if called == 0:  # a part of the model this batch does not use (a vision tower)
            result.notes.setdefault(name, "not run by this batch: not checked")
        elif name not in m.demoted and name not in m.eager and st.call_sites < called:
            result.notes.setdefault(
                name, f"{st.call_sites} of the {called} instances that ran ran compiled"
            )
            result.status = "eager!"
    if not diff.ok and result.status != "eager!":
        result.status = "parity"
        if diff.step is not None and result.steps > 1:
            result.notes.setdefault("parity", diff.describe())


def _guard(reason: str) -> str:
    """One of torch's recompile reasons, short: each failed guard with the source line it
    came from (``self.attention_type == 'block_sparse' (modeling_big_bird.py:1580)``),
    without the source text torch pads beside it."""
    out = []
    for line in str(reason).splitlines():
        guard, _, comment = line.partition("  # ")
        guard = guard.strip().split(": ", 1)[-1] if guard.strip()[:1].isdigit() else guard.strip()
        where = comment.rsplit("  # ", 1)[-1].split(" in ")[0].rsplit("/", 1)[-1]
        out.append(f"{guard} ({where})" if where and ":" in where else guard)
    return "; ".join(o for o in out if o)


def _float64_copy(model: nn.Module, inputs: dict[str, Any]):
    """:func:`~aotdist.check.rounding.as_float64`, or ``None`` where the model cannot be
    copied to float64 (the float64 judgement is skipped then)."""
    try:
        return as_float64(model, inputs)
    except (RuntimeError, TypeError):
        return None


def _compile_whole(model: nn.Module, backend: str) -> nn.Module:
    """Whole-model ``torch.compile``: what aotdist is measured against."""
    return torch.compile(model, backend=backend)


def check_family(
    family: Family | str,
    *,
    backend: str = "aot_eager",
    seed: int = 0,
    whole_model: bool = True,
    steps: int = STEPS,
    repeated_blocks: bool = True,
) -> CheckResult:
    """``steps`` SGD steps of ``family`` eager, with aotdist, (``whole_model``) with
    whole-model ``torch.compile`` and (``repeated_blocks``, where a diffusers model declares
    blocks) with diffusers' ``compile_repeated_blocks``, on one batch from the same weights,
    each step from the same random seed; losses, gradients and buffers compared after every
    step."""
    import aotdist

    family = resolve(family) if isinstance(family, str) else family
    start = time.perf_counter()
    result = CheckResult(family.name, family.kind, family.source, steps=steps)
    rtol = tolerance(backend)
    try:
        model, inputs = family.build(seed)
        # as built (stochastic depth on): how the user trains it, so reuse is judged there
        as_built = copy.deepcopy(model) if stochastic_depth(model) else None
        without_randomness(model)
        reference, whole = copy.deepcopy(model), copy.deepcopy(model)
        peer = copy.deepcopy(model) if repeated_blocks and declares_repeated_blocks(model) else None
        exact = _float64_copy(model, inputs)  # eager in float64, where gradients differ
        eager = Run()
        train(family, reference, inputs, steps=steps, seed=seed, record=eager)
        result.loss_eager = eager.losses[0]
    except Exception as exc:  # noqa: BLE001 - the tiny build itself fails: not aotdist's
        if family.source == "user":
            raise
        result.status, result.error = "not built", first_line(exc, 400)
        result.seconds = time.perf_counter() - start
        return result

    crashed: BaseException | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            aotdist.compile_regions(model, backend=backend)
            m, diff, later = _train_tracked(
                family,
                model,
                inputs,
                steps=steps,
                seed=seed,
                against=eager,
                rtol=rtol,
                record=(ran := Run()),
            )
            if later:
                result.notes.setdefault("later steps", later)
        except Exception as exc:  # noqa: BLE001 - classified below against torch.compile
            crashed = exc
            result.error = first_line(exc, 400)
    result.warnings = _region_warnings(caught)
    del model
    whole_zeros, whole_diff, whole_ran = None, None, Run()
    if whole_model:
        try:
            whole_diff = train(
                family,
                whole,
                inputs,
                steps=steps,
                seed=seed,
                against=eager,
                record=whole_ran,
                rtol=rtol,
                call=_compile_whole(whole, backend),
            )
            result.whole_model_grad_diff, whole_zeros = whole_diff.grad, whole_diff.zeros
            # torch's own miscompile: whole-model compile runs, but not as eager does
            result.whole_model = whole_diff.verdict()
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            result.whole_model = f"fails: {first_line(exc, 400)}"
    del whole
    if peer is not None:  # diffusers' own regional compile, judged as whole-model compile is
        result.repeated_blocks = train_repeated_blocks(
            family, peer, inputs, backend=backend, steps=steps, seed=seed, against=eager, rtol=rtol
        )
        del peer
    if crashed is not None:
        result.status = (
            "crash" if result.whole_model in ("trains", "") else "torch.compile fails too"
        )
        if result.status == "crash":
            result.error = "".join(traceback.format_exception(crashed))[-3000:]
    else:
        result.loss_aotdist = diff.first_loss
        _verdict(result, m, diff, whole_zeros=whole_zeros)
        if (
            result.status == "parity"
            and diff.loss_ok
            and diff.buffer_bad is None
            and exact is not None
        ):

            def exact_grads() -> list[dict]:
                train(family, *exact, steps=steps, seed=seed, record=(run := Run()))
                return run.grads

            errors = rounding_errors(
                exact_grads,
                {
                    "eager": eager.grads,
                    "aotdist": ran.grads,
                    "whole-model compile": whole_ran.grads,
                },
            )
            if only_rounding(errors, "aotdist", rtol):  # the regions' verdict stands
                diff.grad_bad = diff.step = None
                result.notes.pop("parity", None)
                _verdict(result, m, diff, whole_zeros=whole_zeros)
                result.notes["gradients"] = describe(errors, "aotdist", diff.grad)
            if (
                whole_diff is not None
                and whole_diff.loss_ok
                and whole_diff.buffer_bad is None
                and whole_ran.grads
                and only_rounding(errors, "whole-model compile", rtol)
            ):
                result.whole_model = "trains"
        if result.status == "parity" and result.whole_model.startswith("wrong"):
            result.notes.setdefault(
                "gradients",
                (
                    f"whole-model torch.compile's gradients are off eager's too (by "
                    f"{result.whole_model_grad_diff:.1e}, aotdist's by {diff.grad:.1e}): the "
                    "compiler's, not the regions'; try another backend or torch version"
                ),
            )
            if (
                diff.loss_ok
                and diff.buffer_bad is None
                and diff.grad <= 2 * result.whole_model_grad_diff
            ):
                # no further off eager than whole-model compile: torch's, as the status says
                result.status = "torch.compile fails too"
        if as_built is not None and result.ok:
            _judge_as_built(result, family, as_built, inputs, backend, seed)
    result.seconds = time.perf_counter() - start
    return result


def _judge_as_built(
    result: CheckResult,
    family: Family,
    model: nn.Module,
    inputs: dict[str, Any],
    backend: str,
    seed: int,
) -> None:
    """Reuse with the model's stochastic depth on (one step, not compared: masks are
    random): ``result.stochastic_depth`` is that status; where it is worse than with
    stochastic depth off, it is the status, its notes prefixed."""
    import aotdist

    probe = CheckResult(result.name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            aotdist.compile_regions(model, backend=backend)
            with aotdist.metrics.track(model) as m:
                train(family, model, inputs, steps=1, seed=seed)
        except Exception as exc:  # noqa: BLE001 - an aotdist crash with the user's setting
            result.stochastic_depth = "crash"
            result.status = "crash"
            result.error = (
                "with stochastic depth on: " + "".join(traceback.format_exception(exc))[-3000:]
            )
            return
    probe.warnings = _region_warnings(caught)
    _classify(probe, m, probe.warnings)
    result.stochastic_depth = probe.status
    rank = ("reused", "partly reused", "demoted", "eager!")
    if (
        probe.status in rank
        and result.status in rank
        and (rank.index(probe.status) > rank.index(result.status))
    ):
        result.status = probe.status
        for name, why in probe.notes.items():
            result.notes.setdefault(name, f"stochastic depth on: {why}")
