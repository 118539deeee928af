"""One training step of a model three ways (eager, whole-model ``torch.compile``, aotdist)
and what came of it: :func:`check_family`, :func:`check_fsdp`, :class:`CheckResult`.

The step is forward, loss and backward on one batch; aotdist must match eager (loss and
every gradient), account for every region instance (compiled, demoted or run eager with a
warning) and crash only where whole-model ``torch.compile`` crashes too.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from aotdist.check.families import FAMILIES, Family, hf_family, torchvision_family
from aotdist.compile.verify import compare_grads, tolerance
from aotdist.errors import first_line

__all__ = ["FAILING", "CheckResult", "check_family", "check_fsdp", "resolve"]

# Statuses that fail ``aotdist check`` (non-zero exit) and the zoo's test.
FAILING = ("crash", "parity", "eager!")


@dataclass
class CheckResult:
    """What one check saw. ``status``: ``reused`` (every region one subgraph for all its
    instances), ``partly reused`` (some region demoted, inlined or compiled more than once,
    each named in ``notes``), ``demoted`` (no region kept as a subgraph; the model compiled
    whole), ``no regions`` (nothing repeats), ``torch.compile fails too`` (aotdist fails,
    and whole-model ``torch.compile`` fails or trains with gradients off eager's), or a
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
    loss_eager: float | None = None
    loss_aotdist: float | None = None
    max_grad_diff: float | None = None
    whole_model_grad_diff: float | None = None  # the same measure for whole-model compile
    error: str = ""
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status not in FAILING

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    def line(self) -> str:
        """One progress line: name, status, regions and the loss difference."""
        regions = ", ".join(f"{n} x{r['instances']}" for n, r in self.regions.items()) or "-"
        diff = ("" if self.loss_eager is None or self.loss_aotdist is None
                else f" | loss diff {abs(self.loss_aotdist - self.loss_eager):.1e}, grad diff "
                f"{self.max_grad_diff:.1e}")
        if self.whole_model_grad_diff is not None:
            diff += f" (whole-model compile {self.whole_model_grad_diff:.1e})"
        mode = ", graph mode" if self.fsdp_mode == "graph" else ""
        where = f" (FSDP x{self.fsdp}{mode})" if self.fsdp else ""
        text = f"{self.name}{where}: {self.status} | {regions}{diff} | {self.seconds:.0f} s"
        return text + (f" | {self.error.splitlines()[0][:160]}" if self.error else "")


def resolve(spec: str) -> Family:
    """A family from a spec: a name in :data:`FAMILIES`, ``hf:TYPE`` (a ``transformers``
    model type, causal LM unless listed), ``torchvision:NAME``, or ``module:factory`` (a
    zero-argument function returning ``(model, inputs)``, ``inputs`` a dict of keyword
    arguments or a tuple of positional ones)."""
    kind, _, rest = spec.partition(":")
    known = {f.name: f for f in FAMILIES}
    if not rest:
        if spec in known:
            return known[spec]
        raise ValueError(f"unknown model {spec!r}: give a family ({', '.join(known)}), "
                         "hf:TYPE, torchvision:NAME or module:factory")
    listed = known.get(rest)
    if kind == "hf":
        return listed if listed is not None and listed.source == "transformers" else \
            hf_family(rest, "transformers model")
    if kind == "torchvision":
        return listed if listed is not None and listed.source == "torchvision" else \
            torchvision_family(rest, "torchvision model")

    def build(seed: int):
        torch.manual_seed(seed)
        made = getattr(importlib.import_module(kind), rest)()
        if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module)):
            raise TypeError(f"{spec} must return (model, inputs): inputs a dict of keyword "
                            f"arguments or a tuple of positional ones; got {type(made).__name__}")
        model, inputs = made
        return model, inputs if isinstance(inputs, dict) else {"*": tuple(inputs)}

    return Family(spec, "user model", build, "user")


def _call(model: nn.Module, inputs: dict[str, Any]):
    if set(inputs) == {"*"}:
        return model(*inputs["*"])
    return model(**inputs)


def _step(family: Family, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    loss = family.loss_of(_call(model, inputs))
    loss.backward()
    return loss.detach()


def _grad_diff(model: nn.Module, reference: nn.Module, *,
               rtol: float) -> tuple[float, bool, list[str]]:
    """:func:`aotdist.compile.verify.compare_grads` of the two models' gradients: the
    largest scaled difference, whether all are within ``rtol``, the zero-for-``None``
    gradients."""
    worst, bad, zeros = compare_grads(
        {n: p.grad for n, p in model.named_parameters()},
        {n: p.grad for n, p in reference.named_parameters()}, rtol=rtol)
    return worst, bad is None, zeros


def _classify(result: CheckResult, m, caught: list[str]) -> None:
    """Fills ``status``, ``regions`` and ``notes`` from the aotdist step's metrics."""
    for name, st in m.regions.items():
        result.regions[name] = {"instances": st.instances, "call_sites": st.call_sites,
                                "subgraphs": st.subgraphs, "inlined": st.inlined}
    for source in (m.reuse, m.demoted, m.eager):
        for name, why in source.items():
            result.notes.setdefault(name, why.splitlines()[0][:300])
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


def _region_warnings(caught) -> list[str]:
    import aotdist

    return [str(w.message).splitlines()[0][:300] for w in caught
            if issubclass(w.category, aotdist.RegionCompileWarning)]


def _judge(result: CheckResult, m, loss: torch.Tensor, model: nn.Module, reference: nn.Module,
           backend: str, *, frames: bool = False, whole_zeros: list[str] | None = None,
           ran: dict[str, int] | None = None) -> None:
    """Status from the metrics, then ``eager!`` (``frames``: a kept region with fewer
    compiled call sites than instances that ran, ``ran`` counting them per region where
    known) or ``parity`` (loss or a gradient off eager). ``whole_zeros``: the
    zero-for-``None`` gradients of whole-model compile, if it ran."""
    result.loss_aotdist = loss.item()
    result.max_grad_diff, grads_ok, zeros = _grad_diff(model, reference,
                                                       rtol=tolerance(backend))
    _classify(result, m, result.warnings)
    if zeros:
        result.notes["gradients"] = (
            f"{len(zeros)} parameter(s) ({', '.join(zeros[:3])}"
            f"{', ...' if len(zeros) > 3 else ''}) get zero gradients where eager leaves "
            "them None: they feed only an output the loss does not use, and a compiled "
            "backward gives such parameters zeros")
        if whole_zeros is not None:
            differ = [n for n in zeros if n not in whole_zeros]
            result.notes["gradients"] += (
                f"; whole-model compile leaves {len(differ)} of them None ({differ[0]}...)"
                if differ else " (whole-model compile too)")
    for name, st in m.regions.items() if frames else ():
        called = st.instances if ran is None else ran.get(name, st.instances)
        if called == 0:  # a part of the model this batch does not use (a vision tower)
            result.notes.setdefault(name, "not run by this batch: not checked")
        elif name not in m.demoted and name not in m.eager and st.call_sites < called:
            result.notes.setdefault(name, f"{st.call_sites} of the {called} instances that "
                                    "ran ran compiled")
            result.status = "eager!"
    loss_ok = abs(result.loss_aotdist - result.loss_eager) <= tolerance(backend) * max(
        1.0, abs(result.loss_eager))
    if not (loss_ok and grads_ok) and result.status != "eager!":
        result.status = "parity"


def _compile_whole(model: nn.Module, backend: str) -> nn.Module:
    """Whole-model ``torch.compile``: what aotdist is measured against."""
    return torch.compile(model, backend=backend)


def check_family(family: Family | str, *, backend: str = "aot_eager", seed: int = 0,
                 whole_model: bool = True) -> CheckResult:
    """One training step of ``family`` eager, with aotdist and (``whole_model``) with
    whole-model ``torch.compile``, on one batch and the same weights."""
    import aotdist

    family = resolve(family) if isinstance(family, str) else family
    start = time.perf_counter()
    result = CheckResult(family.name, family.kind, family.source)
    try:
        model, inputs = family.build(seed)
        reference, whole = copy.deepcopy(model), copy.deepcopy(model)
        result.loss_eager = _step(family, reference, inputs).item()
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
            with aotdist.metrics.track(model) as m:
                loss = _step(family, model, inputs)
        except Exception as exc:  # noqa: BLE001 - classified below against torch.compile
            crashed = exc
            result.error = first_line(exc, 400)
    result.warnings = _region_warnings(caught)
    whole_zeros = None
    if whole_model:
        try:
            _step(family, _compile_whole(whole, backend), inputs)
            result.whole_model_grad_diff, whole_ok, whole_zeros = _grad_diff(
                whole, reference, rtol=tolerance(backend))
            # torch's own miscompile: whole-model compile runs, but not as eager does
            result.whole_model = "trains" if whole_ok else (
                f"wrong gradients (grad diff {result.whole_model_grad_diff:.1e})")
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            result.whole_model = f"fails: {first_line(exc, 400)}"
    if crashed is not None:
        result.status = ("crash" if result.whole_model in ("trains", "")
                         else "torch.compile fails too")
        if result.status == "crash":
            result.error = "".join(traceback.format_exception(crashed))[-3000:]
    else:
        _judge(result, m, loss, model, reference, backend, whole_zeros=whole_zeros)
        if result.status == "parity" and result.whole_model.startswith("wrong"):
            result.notes.setdefault("gradients", (
                "whole-model torch.compile's gradients are off eager's too: the compiler's "
                "bug, not the regions'; try backend aot_eager or another torch version"))
    result.seconds = time.perf_counter() - start
    return result


def _fsdp_rank(rank: int, world_size: int, spec: str, backend: str, seed: int,
               mode: str = "hooks") -> dict:
    """One rank of :func:`check_fsdp`: every rank trains on the whole batch, so the
    averaged sharded gradients equal the single-process eager ones."""
    import aotdist

    family = resolve(spec)
    start = time.perf_counter()
    result = CheckResult(family.name, family.kind, family.source, fsdp=world_size,
                         fsdp_mode=mode)
    model, inputs = family.build(seed)
    reference = copy.deepcopy(model)
    result.loss_eager = _step(family, reference, inputs).item()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            aotdist.parallelize(model, config={"fsdp": {"enabled": True, "mode": mode},
                                               "compile": {"backend": backend}})
            with aotdist.metrics.track(model) as m, _instances_run(model) as ran:
                loss = _step(family, model, inputs)
        except Exception as exc:  # noqa: BLE001 - reported
            result.status = "crash"
            result.error = "".join(traceback.format_exception(exc))[-3000:]
    result.warnings = _region_warnings(caught)
    if result.status != "crash":
        # Hooks mode compiles per-region frames: every instance of a kept region is a
        # compiled frame call. Graph mode compiles the model as one graph of region calls.
        _judge(result, m, loss, model, reference, backend, frames=mode == "hooks", ran=ran)
    result.seconds = time.perf_counter() - start
    return result.to_dict()


@contextlib.contextmanager
def _instances_run(model: nn.Module):
    """Within: counts, per region, the instances of ``model`` whose forward ran."""
    from aotdist.compile.state import STATE_ATTR

    plan = vars(model)[STATE_ATTR].plan
    ran: dict[str, set[str]] = {r.name: set() for r in plan}
    counts: dict[str, int] = {}
    handles = [
        model.get_submodule(fqn).register_forward_pre_hook(
            lambda mod, args, r=region.name, f=fqn: ran[r].add(f))
        for region in plan for fqn in region.fqns]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()
        counts.update({name: len(fqns) for name, fqns in ran.items()})


def check_fsdp(family: Family | str, world_size: int, *, backend: str = "aot_eager",
               seed: int = 0, timeout: float = 600.0, mode: str = "hooks") -> CheckResult:
    """One training step under FSDP2 (``aotdist.parallelize``, ``fsdp.mode`` ``mode``:
    ``"hooks"`` or ``"graph"``) on ``world_size`` gloo ranks against single-process
    eager; the worst rank's result.

    Raises:
        ValueError: ``mode`` is neither ``"hooks"`` nor ``"graph"``.
    """
    from aotdist.launch import run_distributed

    if mode not in ("hooks", "graph"):
        raise ValueError(f"check_fsdp(mode={mode!r}): FSDP modes are 'hooks' (FSDP2's "
                         "units) and 'graph' (collectives in the compiled graph)")
    spec = family if isinstance(family, str) else family.name
    outs = run_distributed(_fsdp_rank, world_size, spec, backend, seed, mode,
                           timeout=timeout)
    fields = set(CheckResult.__dataclass_fields__)
    results = [CheckResult(**{k: v for k, v in o.items() if k in fields}) for o in outs]
    return next((r for r in results if not r.ok), results[0])
