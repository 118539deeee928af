"""Region failure recovery: the compiled call that fixes or demotes a failing region.

A region that Dynamo cannot capture as a reusable subgraph fails *at trace time*, before
anything ran. :class:`RegionGuardedCall` catches that failure, finds the region from the
error (the recording backend's ``RegionCaptureError``, else Dynamo's user stack and error
text), and either fixes it (clones aliasing outputs) or demotes it to inline compilation,
with a ``RegionCompileWarning`` each time. Parsing torch's error text lives here only.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from aotdist import _compat
from aotdist.compile.marking import apply_region_class, unmark_region
from aotdist.compile.state import RegionState
from aotdist.errors import OrderingError, RegionCaptureError, RegionCompileWarning
from aotdist.errors import exception_chain as _chain
from aotdist.fsdp import fsdp_modules
from aotdist.log import rank_zero_warn

__all__ = ["RegionGuardedCall"]


class RegionGuardedCall:
    """The compiled ``_call_impl``, with region failures fixed or demoted, never hidden.

    A region that Dynamo cannot capture as a reusable subgraph fails *at trace time*,
    before anything ran, with ``UncapturedHigherOrderOpError``. The failing region is
    identified from the error's user stack; an aliasing output is fixed by cloning, any
    other failure (graph break, data-dependent branch) demotes the region to inline
    compilation inside the surrounding graph. Each gets a ``RegionCompileWarning``.
    """

    def __init__(self, model: nn.Module, state: RegionState, compiled: Callable):
        self._model_ref = model
        self._state = state
        self._compiled = compiled

    def __call__(self, *args, **kwargs):
        if not self._state.fsdp_checked:
            _check_no_fsdp_added(self._model_ref)
            self._state.fsdp_checked = True
        for _ in range(2 * len(self._state.plan) + 1):
            try:
                with _compat.tolerant_subgraph_dedup(), _compat.cached_subgraph_schemas():
                    return self._compiled(*args, **kwargs)  # dedup: reuse, not a crash (2.11)
            except Exception as exc:  # noqa: BLE001 - re-raised unless it is a region failure
                if not self._handle(exc):
                    raise
        with _compat.tolerant_subgraph_dedup(), _compat.cached_subgraph_schemas():
            return self._compiled(*args, **kwargs)

    def _handle(self, exc: Exception) -> bool:
        state = self._state
        live = [r.name for r in state.plan if r.name not in state.demoted]
        captured = next((e for e in _chain(exc) if isinstance(e, RegionCaptureError)), None)
        if captured is not None:  # the backend rejected named regions
            names = [n for n in captured.regions if n in live]
            reason, aliasing = captured.reason, False
        else:  # Dynamo could not capture a region (graph break, aliasing...)
            text = _exception_text(exc)
            if "invoke_subgraph" not in text:
                return False
            names = _regions_in_stack(exc, state, live) or live
            reason, aliasing = _first_line_of_cause(text), "aliasing" in text.lower()
        if not names:
            return False
        for name in names:
            if aliasing and state.fixes.get(name) != "clone_aliasing_outputs":
                unmark_region(self._model_ref, state, name)
                apply_region_class(self._model_ref, state, name, clone_aliases=True)
                state.fixes[name] = "clone_aliasing_outputs"
                rank_zero_warn(
                    f"aotdist region {name!r}: an output aliases an input ({reason}). "
                    "Fixed by cloning the aliasing outputs inside the region; it still "
                    "compiles once as a reusable subgraph.",
                    RegionCompileWarning, stacklevel=4,
                )
            else:
                unmark_region(self._model_ref, state, name)
                if state.checkpoint:  # inline, but still checkpointed
                    apply_region_class(self._model_ref, state, name, nested=False)
                state.demoted[name] = reason
                rank_zero_warn(
                    f"aotdist region {name!r} cannot be a reusable subgraph: {reason}. "
                    "It is compiled inline in the surrounding graph instead (Dynamo handles "
                    "its graph breaks as usual); exclude it or fix the cause to regain reuse.",
                    RegionCompileWarning, stacklevel=4,
                )
        return True


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


def _first_line_of_cause(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        if ln.endswith("Got graph break/error:") and i + 1 < len(lines):
            expl = next((x for x in lines[i + 1:] if x.startswith("Explanation:")), "")
            return (lines[i + 1] + (f" - {expl[len('Explanation: '):]}" if expl else ""))[:300]
    return lines[0][:300] if lines else "unknown reason"


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
            if (fr.filename == code.co_filename and fr.name == code.co_name
                    and fr.lineno is not None and code.co_firstlineno <= fr.lineno <= last):
                found.append(name)
                break
    return found
