"""Region failure recovery: the compiled call that fixes or demotes a failing region.

A region that Dynamo cannot capture as a reusable subgraph fails *at trace time*, before
anything ran. :class:`RegionGuardedCall` catches that failure, finds the region from the
error (the recording backend's ``RegionCaptureError``, else Dynamo's user stack and error
text), and either fixes it (clones aliasing outputs) or demotes it to inline compilation,
with a ``RegionCompileWarning`` each time. torch's error text is read through
:mod:`aotdist._compat.messages`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from aotdist import _compat
from aotdist._compat.messages import (
    error_cause,
    is_aliasing_error,
    names_invoke_subgraph,
    stores_into_an_argument,
)
from aotdist.compile.collector import older_objects_frozen
from aotdist.compile.isolate import Trials
from aotdist.compile.marking import apply_region_class, unmark_region
from aotdist.compile.state import HOST_SCALARS, STATE_ATTR, CompiledCall, RegionState
from aotdist.compile.subgraph_reuse import report_reuse
from aotdist.compile.verify import first_step_check
from aotdist.errors import OrderingError, RegionCaptureError, RegionCompileWarning
from aotdist.errors import exception_chain as _chain
from aotdist.fixes import COMPILE, dynamo_patches
from aotdist.fsdp import fsdp_modules
from aotdist.log import get_logger, rank_zero_info, rank_zero_warn

_log = get_logger(__name__)


def is_training(module: nn.Module) -> bool:
    """A training call: grad enabled, ``module`` in train mode (a validation step is not)."""
    return torch.is_grad_enabled() and module.training


@dataclass(frozen=True)
class CallModes:
    """The modes an eval call ran in: grad, inference mode, each module's training flag."""

    grad: bool
    inference: bool
    training: tuple[bool, ...]  # each of the module's modules' flag, in order

    @classmethod
    def of(cls, module: nn.Module) -> CallModes:
        return cls(
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            tuple(m.training for m in module.modules()),
        )

    @contextlib.contextmanager
    def applied(self, module: nn.Module) -> Iterator[None]:
        """Inside, ``module``'s modules, grad mode and inference mode as at the call."""
        modules = list(module.modules())
        before = [m.training for m in modules]
        for m, flag in zip(modules, self.training, strict=True):
            m.training = flag
        try:
            with torch.inference_mode(self.inference), torch.set_grad_enabled(self.grad):
                yield
        finally:
            for m, flag in zip(modules, before, strict=True):
                m.training = flag


def compiled_graphs(state: RegionState, frame: str | None = None) -> int:
    """Graphs the model (or region ``frame``'s frame) compiled so far, none loaded."""
    return sum(
        1
        for r in state.backend.records
        if not r.precompiled and (frame is None or r.standalone == frame)
    )


class RegionGuardedCall(_compat.CallWrapper):
    """The compiled ``_call_impl``, with region failures fixed or demoted, never hidden.

    A region that cannot be a reusable subgraph fails while the model is traced or
    compiled, before any of it ran. The responsible regions are found from the error
    (the recording backend names them; else Dynamo's user stack), or, when the error does
    not say, by bisection over the live regions with dry-run compiles that stop before
    anything runs (:mod:`aotdist.compile.isolate`). Each is fixed (aliasing outputs
    cloned) or demoted to inline compilation, with a ``RegionCompileWarning``. Only an
    error that remains with every region demoted propagates, with a note saying so.
    Installed over the eager call (``inner`` is ``None``); ``aotdist.restore`` removes it.
    """

    __reduce_ex__ = _compat.unsaved_in_guards  # run state, not in a saved graph's guards

    def __init__(
        self, model: nn.Module, state: RegionState, compiled: Callable, *, backend: Any = None
    ):
        self._model_ref = model
        self._state = state
        self._compiled = compiled
        self._backend = backend  # the recording backend, when not state.backend
        self._recorded = 0  # graphs recorded when the log last said how many
        self._compile_s = 0.0  # compile time the log reported

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # an outer torch.compile traces this call
            _refuse_outer_compile(self._model_ref)
        state = self._state
        if not state.log.fsdp_checked:
            _check_no_fsdp_added(self._model_ref)
            state.log.fsdp_checked = True
        if state.settings.verify and not state.log.verified and is_training(self._model_ref):
            state.log.verified = True  # compile.verify, once
            first_step_check(
                self._model_ref,
                state,
                lambda: self(*args, **kwargs),
                lambda: state.hooks.call_fn(*state.hooks.call_bound, *args, **kwargs),
                fresh=lambda n: torch.compile(
                    _compat.unique_code_function(state.hooks.call_fn, f"verify_{n}"),
                    backend=self._backend or state.backend,
                    dynamic=state.settings.dynamic,
                )(*state.hooks.call_bound, *args, **kwargs),
            )
        if state.settings.dynamic_inputs:
            mark_dynamic_inputs(args, kwargs)
        first = not state.log.reuse_checked
        saved = state.hooks.cache.precompiled if state.hooks.cache is not None else None
        if saved is not None:  # a graph saved by aotdist.cache: no Dynamo trace
            hit, out = saved.run((*state.hooks.call_bound, *args), kwargs, state.backend)
            if hit:
                if first:
                    state.log.reuse_checked = True
                    report_reuse(self._model_ref, state)
                return out
        started = time.perf_counter()  # a compile is logged with its time (first or again)
        if first:  # the wait a user sees: say what compiles, then how long it took
            rank_zero_info(
                _log,
                "compiling %s: %s, backend %s (the first call compiles; the ones after reuse it)",
                type(self._model_ref).__name__,
                _regions_text(state),
                state.settings.backend_name or "a callable",
            )
        called = (
            state.hooks.calling(CompiledCall(self._model_ref, args, kwargs))
            if state.hooks.watchers
            else ()
        )  # aotdist.cache keeps calls to save
        for _ in range(2 * len(state.plan) + 2):
            try:
                with older_objects_frozen() if first else contextlib.nullcontext():
                    out = self._run(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - re-raised unless it is a region failure
                if not self.handle(exc, lambda: self._run(*args, **kwargs)):
                    raise
                continue
            if first:
                state.log.reuse_checked = True
                report_reuse(self._model_ref, state)
            if state.log.scalars:
                announce_fixed(state)
            if first or len(state.backend.records) != self._recorded:
                self._log_compiled(started, first)
            for done in called:
                done()
            return out
        return self._run(*args, **kwargs)

    def _log_compiled(self, started: float, first: bool) -> None:
        """Logs a compile: the first, and each later one (a recompile for new shapes, eval
        mode, a failed guard) with the compile time so far, so the log's total is true."""
        state = self._state
        graphs, before = compiled_graphs(state), self._recorded
        self._recorded = len(state.backend.records)
        spent = time.perf_counter() - started
        self._compile_s += spent
        name = type(self._model_ref).__name__
        if first:
            rank_zero_info(_log, "compiled %s in %.1f s (%d graph(s))", name, spent, graphs)
        elif graphs > 0:
            rank_zero_info(
                _log,
                "compiled %s again in %.1f s: %d more graph(s) (new input shapes, eval mode "
                "or a failed guard; TORCH_LOGS=recompiles says which); %d graph(s), %.1f s "
                "compiling in all",
                name,
                spent,
                self._recorded - before,
                graphs,
                self._compile_s,
            )

    def _run(self, *args, **kwargs):
        # until reuse is reported: torch's own reasons for not reusing a region's subgraph
        why = (
            _compat.reuse_refusals(self._state.log.refusals)
            if not self._state.log.reuse_checked
            else contextlib.nullcontext()
        )
        with dynamo_patches(COMPILE), why, captured_scalars(self._state):
            return self._compiled(*args, **kwargs)  # dedup: reuse, not a crash (2.11)

    def handle(self, exc: Exception, run: Callable[[], Any]) -> bool:
        """Fixes or demotes the regions behind ``exc``, a failure of the compiled call;
        ``run`` repeats that call (for dry-run trials). Returns whether to try again."""
        state = self._state
        live = [r.name for r in state.plan if r.name not in state.applied.demoted]
        captured = next((e for e in _chain(exc) if isinstance(e, RegionCaptureError)), None)
        text = _exception_text(exc)
        if captured is not None:  # the backend rejected named regions
            names = [n for n in captured.regions if n in live]
            reason, aliasing = captured.reason, False
        elif names_invoke_subgraph(text) and (named := _regions_in_stack(exc, state, live)):
            names = named  # Dynamo could not capture a region its user stack names
            reason, aliasing = error_cause(text), is_aliasing_error(text)
        elif live and isinstance(exc, _compat.dynamo_error_types()):
            return self._bisect(exc, run, live, error_cause(text))
        else:
            return False
        if not names:
            return False
        if reads_a_host_scalar(reason) and not captures_scalars(state):
            for name in names:  # traced as symbolic scalars on the next try, not demoted
                _capture_scalars(state, name, reason)
            return True
        for name in names:
            if aliasing and state.applied.fixes.get(name) != "clone_aliasing_outputs":
                _fix(self._model_ref, state, name, reason)
            else:
                _demote(self._model_ref, state, name, reason)
        return True

    def _bisect(self, exc: Exception, run: Callable[[], Any], live: list[str], reason: str) -> bool:
        """The error does not say which regions: dry-run trials find them."""
        state = self._state
        trial = Trials(self._model_ref, state, run, self._backend or state.backend)
        names = trial.isolate(live)
        if not names:
            _note(
                exc,
                "aotdist: the model fails the same way with every region demoted, "
                "i.e. as a whole-model torch.compile; this is torch.compile's own error "
                "(above), not a region problem.",
            )
            return False
        for name in names:  # a fix that keeps the region reusable, where a trial passes
            if trial.fixed_by_cloning(name):
                _fix(self._model_ref, state, name, reason, apply=False)
            else:
                _demote(self._model_ref, state, name, reason)
        return True


def replay_outcomes(
    model: nn.Module, state: RegionState, fixes: dict[str, str], demoted: dict[str, str]
) -> None:
    """Fixes and demotes regions as the run that saved a whole-model graph did (that graph
    was traced with them so), with the same warnings (:mod:`aotdist.cache.precompile`)."""
    names = {r.name for r in state.plan}
    for name in fixes:
        if name in names and name not in state.applied.fixes:
            _fix(model, state, name, "as in the run that saved the compiled graph")
    for name, reason in demoted.items():
        if name in names and name not in state.applied.demoted:
            _demote(model, state, name, reason)


def mark_dynamic_inputs(args: tuple, kwargs: dict) -> None:
    """Every dimension of every input tensor marked dynamic (a hint: a dimension the
    program needs static is specialized without error); for ``dynamic=True``."""
    for leaf in _compat.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and not isinstance(leaf, nn.Parameter):
            _compat.maybe_mark_dynamic(leaf)


def _fix(
    model: nn.Module, state: RegionState, name: str, reason: str, *, apply: bool = True
) -> None:
    if apply:
        unmark_region(model, state, name)
        apply_region_class(model, state, name, clone_aliases=True)
    state.applied.fixes[name] = "clone_aliasing_outputs"
    rank_zero_warn(
        f"aotdist region {name!r}: an output aliases an input, or inputs share storage "
        f"({reason}). Fixed by cloning the aliasing outputs inside the region and the "
        "aliasing inputs before it; it still compiles once as a reusable subgraph.",
        RegionCompileWarning,
        stacklevel=5,
    )


def reads_a_host_scalar(reason: str) -> bool:
    """Whether a region failed because it reads a tensor's value on the host (``.item()``,
    ``.tolist()``: an MoE's token counts, the split sizes of its all-to-all)."""
    return "_local_scalar_dense" in reason


def captures_scalars(state: RegionState) -> bool:
    """Whether this model's compile traces host scalars as symbolic values."""
    return HOST_SCALARS in state.applied.fixes.values()


def captured_scalars(state: RegionState) -> contextlib.AbstractContextManager:
    """Within: Dynamo's ``capture_scalar_outputs`` for this model's compiled call only,
    once a region needed it (every call, so the compiled code and its guards see one
    setting)."""
    if not captures_scalars(state):
        return contextlib.nullcontext()
    return _compat.dynamo_config_patch(capture_scalar_outputs=True)


def trace_host_scalars(model: nn.Module, names: list[str], why: str) -> None:
    """The regions ``names`` of compiled ``model`` trace their host scalars as symbolic
    values from the first call (``metrics.fixes``: ``capture_scalar_outputs``): asked for
    where they cannot be seen failing, such as an expert-parallel block in its own frame
    under FSDP2's hooks, where Dynamo breaks the graph at each ``.tolist()`` and compiles
    again for each new split instead."""
    state = vars(model).get(STATE_ATTR)
    if state is None or not names:
        return
    for name in names:
        state.applied.fixes[name] = HOST_SCALARS
    _log.info("aotdist: %s trace their host scalars as symbolic values (%s)", names, why)


def _capture_scalars(state: RegionState, name: str, reason: str) -> None:
    state.applied.fixes[name] = HOST_SCALARS
    state.log.scalars[name] = reason  # announced once the call compiles (announce_fixed)


def announce_fixed(state: RegionState) -> None:
    """Once their call ran: warns of the regions whose host scalars are traced, or, where
    that made no subgraph of the region (Dynamo fell back to eager around a branch on
    such a value), names the region as run eagerly, with the cause and the fix."""
    records = getattr(state.backend, "records", None) or []
    for name, reason in list(state.log.scalars.items()):
        del state.log.scalars[name]
        if state.applied.fixes.get(name) != HOST_SCALARS:
            continue  # demoted after all: its own warning says why
        if not any(name in rec.subgraphs for rec in records):
            del state.applied.fixes[name]
            state.log.eager[name] = (
                f"traced with its host values as symbolic scalars ({reason.splitlines()[0]}), "
                "it branches on one, and Dynamo ran the frame around it eagerly"
            )
            rank_zero_warn(
                f"aotdist region {name!r} reads a tensor's value on the host and branches on "
                "it: traced with those values as symbolic scalars, Dynamo ran the frame "
                "around it eagerly (nothing of it is compiled). Fix: exclude the region "
                "(regions.exclude) so it compiles inline, or keep the branch on tensors "
                "(torch.where, torch.cond).",
                RegionCompileWarning,
                stacklevel=4,
            )
            continue
        rank_zero_warn(
            f"aotdist region {name!r} reads a tensor's value on the host "
            f"({reason.splitlines()[0][:120]}): an .item() or .tolist(), such as a "
            "mixture-of-experts layer's token counts for its all-to-all. Fixed by tracing "
            "those values as symbolic scalars (Dynamo's capture_scalar_outputs, for this "
            "model's compiled call only, as torchtitan sets it for MoE); the region still "
            "compiles once as a reusable subgraph.",
            RegionCompileWarning,
            stacklevel=4,
        )


def _demote(model: nn.Module, state: RegionState, name: str, reason: str) -> None:
    unmark_region(model, state, name)
    if state.applied.checkpoint:  # inline, but still checkpointed
        apply_region_class(model, state, name, nested=False)
    if state.applied.fixes.get(name) == HOST_SCALARS:  # captured, and still not one subgraph
        del state.applied.fixes[name]
        reason = f"{reason} (with its host values traced as symbolic scalars too)"
    state.applied.demoted[name] = reason
    hint = (
        " The region writes a tensor into an object passed to it (a KV cache?), and "
        "torch cannot return that tensor from a reused subgraph (it is a view of one the "
        "subgraph returns or takes, as transformers' sliding-window cache layers keep); "
        "no handling inside the region keeps the model's result, so for training pass "
        "use_cache=False (model(..., use_cache=False) or model.config.use_cache = False), "
        "which keeps the region reused."
        if stores_into_an_argument(reason)
        else ""
    )
    rank_zero_warn(
        f"aotdist region {name!r} cannot be a reusable subgraph: {reason}. It is compiled "
        "inline in the surrounding graph instead (no reuse; Dynamo handles its graph breaks "
        f"as usual); exclude it or fix the cause to regain reuse.{hint}",
        RegionCompileWarning,
        stacklevel=5,
    )


def outer_compile_error(name: str) -> OrderingError:
    """The error for a whole-model compile of a model aotdist compiled already."""
    return OrderingError(
        f"torch.compile is tracing a {name} that aotdist.compile_regions compiled already: "
        "the outer compile traces into aotdist's own call (graph breaks, recompiles) and "
        "compiles nothing aotdist has not. Fix: drop the outer torch.compile "
        "(torch.compile(model), model.compile(), a trainer's torch_compile option); to "
        "have the glue between the regions lowered too, set compile.outer: inductor "
        "(compile_regions(model, outer='inductor'))."
    )


@torch.compiler.disable  # runs (and raises) for real, not as a traced graph break
def _refuse_outer_compile(model: nn.Module) -> None:
    raise outer_compile_error(type(model).__name__)


class RefusedModuleCompile:
    """Stands in for ``model.compile`` on a model aotdist compiled: ``nn.Module.compile``
    would replace aotdist's compiled call with a whole-model compile, silently.

    Raises:
        OrderingError: When called, naming the fix.
    """

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise outer_compile_error(self.name)


def _regions_text(state: RegionState) -> str:
    regions = [f"{r.name} x{r.count}" for r in state.plan if r.name not in state.applied.demoted]
    return (
        f"{len(regions)} region(s) ({', '.join(regions[:4])}{', ...' if len(regions) > 4 else ''})"
    )


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(text)


def _check_no_fsdp_added(model: nn.Module) -> None:
    sharded = fsdp_modules(model)
    if sharded:
        raise OrderingError(
            f"fully_shard was applied to {sharded[:4]} after aotdist.compile_regions. FSDP2's "
            "hooks cannot run inside the compiled whole-model graph, so compiling would "
            "silently stop at them. Fix: call aotdist.restore(model) before sharding and "
            "compile_regions after, or let aotdist.parallelize(model, config=config) do both in order."
        )


def _exception_text(exc: BaseException) -> str:
    return "\n".join(f"{type(e).__name__}: {e}" for e in _chain(exc))


def _regions_in_stack(exc: BaseException, state: RegionState, live: list[str]) -> list[str]:
    """Regions whose forward code appears in the Dynamo user stack of ``exc``."""
    frames = []
    e: BaseException | None = exc
    while e is not None:
        frames.extend(getattr(e, "real_stack", None) or [])
        e = e.__cause__
    found = []
    for name in live:
        code = state.plan.by_name(name).module_type.forward.__code__
        last = max((ln for _, _, ln in code.co_lines() if ln is not None), default=0)
        for fr in frames:
            if (
                fr.filename == code.co_filename
                and fr.name == code.co_name
                and fr.lineno is not None
                and code.co_firstlineno <= fr.lineno <= last
            ):
                found.append(name)
                break
    return found
