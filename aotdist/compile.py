"""Marking regions for ``invoke_subgraph`` and compiling a model in place.

Marking swaps each region instance's class for a per-region subclass whose ``forward``
is wrapped by ``torch.compiler.nested_compile_region``. This is the documented
class-level decorator form, applied to the marked instances only: other instances of
the user's class (in other models, or unmarked in this one) are untouched. FSDP2's
``fully_shard`` uses the same class-swap technique.

Why not bind a marked function to the instance (``block.forward = ...``)? With torch
2.15, Dynamo's subgraph reuse then feeds the *first* traced block's parameters to every
later block: a silent wrong result. The class swap keeps ``self`` a real argument of the
region, whose parameters Dynamo lifts per call site. ``tests/unit/test_compile.py``
guards this with blocks whose weights differ.

The model is compiled in place (``nn.Module._compiled_call_impl``, as
``nn.Module.compile`` does), so ``state_dict()`` keys, ``named_parameters()`` and hooks
are unchanged: no ``_orig_mod.`` prefix, no ``OptimizedModule`` wrapper.

Two compile modes, chosen from the model:

- ``graph`` (no FSDP2 in the model): the root's ``_call_impl`` is compiled, so the whole
  model is one graph and each region is an ``invoke_subgraph`` call in it.
- ``frames`` (the model holds FSDP2 units): FSDP2's hooks are ``torch._dynamo.disable``-d
  and would break a whole-model graph at every unit, so each region's forward is
  compiled as a graph of its own, one compiled function per region shared by all its
  instances (one trace, one compile), running inside FSDP's eager hooks. The code
  between regions (embeddings, head) stays eager.
"""

from __future__ import annotations

import copyreg
import functools
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from aotdist.errors import (
    ConfigError,
    OrderingError,
    RegionCaptureError,
    RegionCompileWarning,
)
from aotdist.metrics import RecordingBackend
from aotdist.metrics import exception_chain as _chain
from aotdist.regions import RegionPlan, find_regions

__all__ = [
    "check_not_compiled",
    "compile_callable",
    "compile_regions",
    "is_compiled",
    "mark_regions",
    "restore",
    "unmark_regions",
]

STATE_ATTR = "_aotdist_state"


@dataclass
class RegionState:
    """What aotdist did to a model; stored on the root module under ``_aotdist_state``."""

    plan: RegionPlan
    marked: dict[str, str] = field(default_factory=dict)  # instance fqn -> region name
    fixes: dict[str, str] = field(default_factory=dict)  # region name -> fix applied
    demoted: dict[str, str] = field(default_factory=dict)  # region name -> reason
    backend: RecordingBackend | None = None
    compiled: bool = False
    checkpoint: bool = False  # activation checkpointing around each region instance
    mode: str = "graph"  # "graph": root compiled, regions invoke_subgraph; "frames": see above
    classes: dict[str, type] = field(default_factory=dict)  # region name -> its class
    frame_calls: dict[str, set[int]] = field(default_factory=dict)  # region -> id(instance)
    fsdp_checked: bool = False


def _copy_function(fn: Callable, *, new_code: bool = False) -> types.FunctionType:
    """A fresh function object with ``fn``'s code, so marking never writes attributes on it.

    With ``new_code`` the code object is a copy too: Dynamo caches compiled frames per
    code object, so a region compiled as a frame of its own gets a cache of its own.
    """
    fn = getattr(fn, "__func__", fn)
    if not isinstance(fn, types.FunctionType):
        raise ConfigError(
            f"cannot mark {fn!r}: a region's forward must be a plain Python function; "
            "exclude this module class with exclude=[...]"
        )
    code = fn.__code__.replace() if new_code else fn.__code__
    new = types.FunctionType(
        code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__module__ = fn.__module__
    new.__doc__ = fn.__doc__
    return new


def _clone_aliasing_outputs(fn: Callable) -> Callable:
    """Wraps a forward so that no output aliases an input (invoke_subgraph forbids it)."""

    @functools.wraps(fn)
    def forward(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)]

        def dealias(t):
            if isinstance(t, torch.Tensor) and (
                any(t is a for a in inputs) or t._base is not None
            ):
                return t.clone()
            return t

        return torch.utils._pytree.tree_map(dealias, out)

    return forward


def _checkpointed(fn: Callable) -> Callable:
    """Wraps a forward in non-reentrant activation checkpointing.

    Outside the region: the checkpoint saves only the region's inputs, and under compile
    the recompute is part of the compiled backward (the region's subgraph is still reused).
    """
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(fn)
    def forward(self, *args, **kwargs):
        return checkpoint(fn, self, *args, use_reentrant=False, **kwargs)

    return forward


def _reduce_as_base(self, protocol):
    """Pickle and deepcopy a marked instance as an instance of the user's own class."""
    return (copyreg._reconstructor, (type(self)._aotdist_base, object, None), vars(self).copy())


def _region_class(base: type, region: str, *, clone_aliases: bool = False,
                  checkpoint: bool = False, nested: bool = True) -> type:
    fwd = _copy_function(base.forward)
    if clone_aliases:
        fwd = _clone_aliasing_outputs(fwd)
    marked = torch.compiler.nested_compile_region(fwd) if nested else fwd
    # For frames mode: the same forward without invoke_subgraph, with a code object of its own.
    plain = _copy_function(base.forward, new_code=True)
    if checkpoint:
        marked, plain = _checkpointed(marked), _checkpointed(plain)
    namespace = {
        "forward": marked,
        "_aotdist_plain_forward": plain,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__reduce_ex__": _reduce_as_base,
        "_aotdist_base": base,
        "_aotdist_region": region,
    }
    return type(base.__name__, (base,), namespace)


def is_compiled(model: nn.Module) -> bool:
    """Whether aotdist has marked or compiled ``model``."""
    return STATE_ATTR in vars(model)


def _check_plan(model: nn.Module, plan: RegionPlan) -> None:
    problems = []
    for region in plan:
        for fqn in region.fqns:
            try:
                mod = model.get_submodule(fqn)
            except AttributeError:
                problems.append(f"{region.name}: no submodule {fqn!r}")
                continue
            base = getattr(type(mod), "_aotdist_base", type(mod))
            if base is not region.module_type:
                problems.append(
                    f"{region.name}: {fqn!r} is a {base.__name__}, the plan expects "
                    f"{region.module_type.__name__}"
                )
    if problems:
        raise ConfigError(
            "the region plan does not fit this model (was it made for another model?): "
            + "; ".join(problems) + ". Fix: build the plan with aotdist.find_regions(model)."
        )


def mark_regions(model: nn.Module, plan: RegionPlan | None = None, *,
                 checkpoint: bool = False) -> RegionState:
    """Marks every region instance of ``model`` for ``invoke_subgraph``; no compile.

    Eager execution is unchanged by marking (``nested_compile_region`` is a no-op outside
    ``torch.compile``). Used by :func:`compile_regions` and ``aotdist.parallelize``.

    Args:
        model: The model; its region instances change class, nothing else changes.
        plan: The regions; ``find_regions(model)`` when ``None``.
        checkpoint: Wrap each region instance's forward in activation checkpointing.

    Raises:
        OrderingError: ``model`` is already marked, or was marked and then sharded.
        ConfigError: ``plan`` does not fit ``model``.
    """
    if is_compiled(model):
        raise OrderingError(
            "this model already has aotdist regions; applying twice would compound them. "
            "Call aotdist.restore(model) first to start over."
        )
    plan = find_regions(model) if plan is None else plan
    _check_plan(model, plan)
    stale = [f for r in plan for f in r.fqns
             if getattr(type(model.get_submodule(f)), "_aotdist_region", None) is not None]
    if stale:
        raise OrderingError(
            f"{stale[:3]} were marked by aotdist and then wrapped again (fully_shard?); "
            "their class cannot be swapped without losing that wrapper. Fix: rebuild the "
            "model and apply aotdist.parallelize once."
        )
    state = RegionState(plan=plan, checkpoint=checkpoint)
    for region in plan:
        _apply_region_class(model, state, region.name)
    model.__dict__[STATE_ATTR] = state
    return state


def _apply_region_class(model: nn.Module, state: RegionState, name: str, *,
                        clone_aliases: bool = False, nested: bool = True):
    region = state.plan.by_name(name)
    cls = _region_class(region.module_type, name, clone_aliases=clone_aliases,
                        checkpoint=state.checkpoint, nested=nested)
    state.classes[name] = cls
    for fqn in region.fqns:
        model.get_submodule(fqn).__class__ = cls
        state.marked[fqn] = name


def _unmark_region(model: nn.Module, state: RegionState, name: str, *,
                   neutralize: bool = False) -> None:
    """Returns the region's instances to their own class.

    An instance whose class was wrapped again after marking (``fully_shard`` does that)
    keeps its class; with ``neutralize`` the region class's forward becomes the plain
    forward of the user's class (eager, no checkpointing), otherwise it is an error.
    """
    region = state.plan.by_name(name)
    for fqn in region.fqns:
        mod = model.get_submodule(fqn)
        base = getattr(type(mod), "_aotdist_base", None)
        if base is None:
            continue
        if type(mod).__bases__ != (base,) and neutralize:
            region_cls = next(c for c in type(mod).__mro__ if "_aotdist_region" in vars(c))
            region_cls.forward = _copy_function(base.forward)
            state.marked.pop(fqn, None)
            continue
        if type(mod).__bases__ != (base,):
            raise OrderingError(
                f"cannot unmark {fqn!r}: its class {type(mod).__name__} was wrapped again after "
                "aotdist marked it (by fully_shard?). Restore before applying other wrappers."
            )
        mod.__class__ = base
        state.marked.pop(fqn, None)


def unmark_regions(model: nn.Module, *, neutralize: bool = False) -> None:
    """Returns every marked instance to its own class. A no-op on an unmarked model."""
    state = vars(model).get(STATE_ATTR)
    if state is None:
        return
    for region in state.plan:
        _unmark_region(model, state, region.name, neutralize=neutralize)


def _make_backend(backend: str | Callable, mode: str | None, options: dict | None,
                  dynamic: bool | None) -> Callable:
    if backend == "inductor":
        options = dict(options or {})
        if options.get("allow_buffer_reuse"):
            warnings.warn(
                "allow_buffer_reuse=True: with torch 2.15, Inductor's buffer reuse can "
                "overwrite an activation a reused region saved for backward (wrong "
                "gradients, see README 'Known limits'). aotdist turns it off by default.",
                RegionCompileWarning, stacklevel=3,
            )
        # Scoped to this model's compiles: the wrapper applies options as config patches.
        options.setdefault("allow_buffer_reuse", False)
        return torch._TorchCompileInductorWrapper(mode, options, dynamic)
    if callable(backend) and not isinstance(backend, str):
        if mode is not None or options:
            raise ConfigError(
                "mode and options apply to named backends only; got a callable backend "
                f"{backend!r} with mode={mode!r}, options={options!r}. Fix: configure the "
                "callable yourself, or pass backend='inductor'."
            )
        return backend
    if not isinstance(backend, str):
        raise ConfigError(f"backend must be a name or a callable; got {backend!r}")
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ConfigError(
            f"unknown compile backend {backend!r}; available: "
            f"{sorted(torch._dynamo.list_backends(exclude_tags=()))}"
        )
    return torch._TorchCompileWrapper(backend, mode, options, dynamic)


def check_not_compiled(model: nn.Module) -> None:
    """Refuses a model that ``torch.compile`` already wrapped or compiled, in whole or part.

    Raises:
        OrderingError: ``model`` is an ``OptimizedModule``, was ``.compile()``-d, or holds
            compiled submodules.
    """
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise OrderingError(
            "got a torch.compile wrapper (OptimizedModule); aotdist compiles in place, inside "
            "FSDP's hooks, and keeps your module's keys (no `_orig_mod.`). Fix: pass the "
            "original module (`compiled._orig_mod`), not the result of torch.compile(model)."
        )
    if getattr(model, "_compiled_call_impl", None) is not None:
        raise OrderingError(
            "model.compile() was already called on this module; aotdist would compound it. "
            "Fix: pass the uncompiled module; aotdist compiles it."
        )
    wrapped = [n for n, m in model.named_modules()
               if isinstance(m, torch._dynamo.eval_frame.OptimizedModule)
               or getattr(m, "_compiled_call_impl", None) is not None]
    if wrapped:
        raise OrderingError(
            f"submodules {wrapped[:4]} are already compiled (torch.compile / .compile(), e.g. "
            "by accelerate.utils.compile_regions); aotdist would compile them twice. Fix: "
            "apply aotdist to the uncompiled model."
        )


class _RegionGuardedCall:
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
                return self._compiled(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - re-raised unless it is a region failure
                if not self._handle(exc):
                    raise
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
                _unmark_region(self._model_ref, state, name)
                _apply_region_class(self._model_ref, state, name, clone_aliases=True)
                state.fixes[name] = "clone_aliasing_outputs"
                warnings.warn(
                    f"aotdist region {name!r}: an output aliases an input ({reason}). "
                    "Fixed by cloning the aliasing outputs inside the region; it still "
                    "compiles once as a reusable subgraph.",
                    RegionCompileWarning, stacklevel=4,
                )
            else:
                _unmark_region(self._model_ref, state, name)
                if state.checkpoint:  # inline, but still checkpointed
                    _apply_region_class(self._model_ref, state, name, nested=False)
                state.demoted[name] = reason
                warnings.warn(
                    f"aotdist region {name!r} cannot be a reusable subgraph: {reason}. "
                    "It is compiled inline in the surrounding graph instead (Dynamo handles "
                    "its graph breaks as usual); exclude it or fix the cause to regain reuse.",
                    RegionCompileWarning, stacklevel=4,
                )
        return True


def _check_no_fsdp_added(model: nn.Module) -> None:
    from aotdist.fsdp import fsdp_modules

    sharded = fsdp_modules(model)
    if sharded:
        raise OrderingError(
            f"fully_shard was applied to {sharded[:4]} after aotdist.compile_regions. FSDP2's "
            "hooks cannot run inside the compiled whole-model graph, so compiling would "
            "silently stop at them. Fix: call aotdist.restore(model) before sharding and "
            "compile_regions after, or let aotdist.parallelize(model, config) do both in order."
        )


def _compile_frames(model: nn.Module, state: RegionState, dynamic: bool | None) -> None:
    """Frames mode: one compiled forward per region, shared by its instances."""
    for region in state.plan:
        cls = state.classes[region.name]
        compiled = torch.compile(cls._aotdist_plain_forward, backend=state.backend,
                                 dynamic=dynamic)
        calls = state.frame_calls.setdefault(region.name, set())

        def forward(self, *args, _compiled=compiled, _calls=calls, **kwargs):
            _calls.add(id(self))
            return _compiled(self, *args, **kwargs)

        cls.forward = forward


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


def compile_regions(
    model: nn.Module,
    plan: RegionPlan | None = None,
    backend: str | Callable = "inductor",
    mode: str | None = None,
    dynamic: bool | None = None,
    options: dict[str, Any] | None = None,
) -> nn.Module:
    """Marks ``model``'s regions for ``invoke_subgraph`` and compiles it in place.

    The whole model stays one graph where it allows; each distinct region is traced and
    compiled once and every instance calls that subgraph with its own parameters.

    Args:
        model: The module to compile; modified in place and returned.
        plan: Regions to use; ``aotdist.find_regions(model)`` when ``None``.
        backend: A ``torch.compile`` backend name or callable.
        mode: ``torch.compile`` mode (named backends only).
        dynamic: ``torch.compile``'s ``dynamic``.
        options: Backend options (named backends only).

    Returns:
        ``model`` itself.

    Raises:
        OrderingError: ``model`` is a ``torch.compile`` wrapper, was compiled already, or
            aotdist was applied to it already.
        ConfigError: a bad backend, mode/options with a callable backend, or a plan that
            does not fit ``model``.
    """
    state = _prepare(model, plan, backend, mode, dynamic, options)
    from aotdist.fsdp import fsdp_modules

    if fsdp_modules(model):  # FSDP2's hooks would break the whole graph: see module doc
        state.mode = "frames"
        _compile_frames(model, state, dynamic)
    else:
        compiled = torch.compile(model._call_impl, backend=state.backend, dynamic=dynamic)
        model._compiled_call_impl = _RegionGuardedCall(model, state, compiled)
    state.compiled = True
    return model


def compile_callable(model: nn.Module, fn: Callable, *, plan: RegionPlan | None = None,
                     backend: str | Callable = "inductor", mode: str | None = None,
                     dynamic: bool | None = None, options: dict[str, Any] | None = None
                     ) -> Callable:
    """Like :func:`compile_regions`, but compiles ``fn``, a callable that runs ``model``.

    For integrations that own the call path: Accelerate's hooks wrap ``model.forward``
    with ``torch.compiler.disable``-d pre/post hooks, which would break a compiled
    ``_call_impl``; compiling the forward they wrap keeps them outside the graph.
    ``model._compiled_call_impl`` is not touched; :func:`restore` unmarks ``model``.

    Returns:
        The compiled ``fn``, with region failures fixed or demoted as in
        :func:`compile_regions`.

    Raises:
        OrderingError: As :func:`compile_regions`; also when ``model`` holds FSDP2 units
            (use :func:`compile_regions`, which compiles inside them).
        ConfigError: As :func:`compile_regions`.
    """
    from aotdist.fsdp import fsdp_modules

    if fsdp_modules(model):
        raise OrderingError(
            "compile_callable compiles a whole call path, which FSDP2's hooks would break; "
            "use aotdist.compile_regions(model), which compiles inside the FSDP units."
        )
    state = _prepare(model, plan, backend, mode, dynamic, options)
    compiled = torch.compile(fn, backend=state.backend, dynamic=dynamic)
    state.compiled = True
    return _RegionGuardedCall(model, state, compiled)


def _prepare(model: nn.Module, plan: RegionPlan | None, backend: str | Callable,
             mode: str | None, dynamic: bool | None, options: dict[str, Any] | None
             ) -> RegionState:
    """Checks, marks (unless marked) and attaches the recording backend; no compile yet."""
    state = vars(model).get(STATE_ATTR)
    if state is not None and state.compiled:
        raise OrderingError(
            "aotdist already compiled this model; applying twice would compound it. "
            "Fix: call aotdist.restore(model) first, or use the model as it is."
        )
    check_not_compiled(model)
    inner = _make_backend(backend, mode, options, dynamic)
    if state is None:  # parallelize marks before fully_shard, then compiles here
        state = mark_regions(model, plan)
    elif plan is not None and plan is not state.plan:
        raise OrderingError(
            "this model was marked with another region plan; call aotdist.restore(model) "
            "and compile again with the plan you want."
        )
    if len(state.plan) == 0:
        warnings.warn(
            f"aotdist found no repeated regions in {type(model).__name__}; the whole model is "
            "compiled as usual (no subgraph reuse). Pass include=[...] or min_repeats=1 to "
            "choose regions.",
            RegionCompileWarning, stacklevel=3,
        )
    state.backend = RecordingBackend(inner, model=model, plan=state.plan)
    return state


def restore(model: nn.Module) -> nn.Module:
    """Undoes :func:`compile_regions` / marking: ``model`` runs plain eager again.

    After ``aotdist.parallelize`` that only marked and compiled (no Float8, no FSDP), the
    model is as before it, and ``parallelize`` may be applied again; Float8 conversion and
    sharding cannot be undone, so such a model stays recorded as parallelized.
    A no-op on a model aotdist never touched. Returns ``model``.
    """
    info = vars(model).get("_aotdist_parallelized")  # parallelize.INFO_ATTR (import cycle)
    if info is not None and not info.float8_fqns and not info.sharded_fqns:
        del model.__dict__["_aotdist_parallelized"]
    state = vars(model).get(STATE_ATTR)
    if state is None:
        return model
    # Instances sharded after marking keep FSDP's class; their forward becomes plain eager.
    unmark_regions(model, neutralize=True)
    if isinstance(model._compiled_call_impl, _RegionGuardedCall):
        model._compiled_call_impl = None
    elif isinstance(getattr(model._compiled_call_impl, "inner", None), _RegionGuardedCall):
        model._compiled_call_impl.uncompile(model)  # graph-mode FSDP: its call stays, eager
    del model.__dict__[STATE_ATTR]
    return model
