"""Marking regions for ``invoke_subgraph``: a per-region subclass of each instance's class.

Marking swaps each region instance's class for a per-region subclass whose ``forward``
is wrapped by ``torch.compiler.nested_compile_region`` (FSDP2's ``fully_shard`` swaps
classes the same way); other instances of the user's class are untouched. The class swap
keeps ``self`` a real argument of the region, so Dynamo lifts each instance's own
parameters: binding a marked function per instance runs the first block's weights for
every block on torch 2.15 (docs/internals.md). The region class's forward carries the
forward fixes (:data:`aotdist.fixes.FIXES`), activation
checkpointing among them.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn

from aotdist import _compat
from aotdist.compile.state import STATE_ATTR, Applied, RegionState
from aotdist.errors import ConfigError, OrderingError
from aotdist.fixes import INSIDE, OUTSIDE, apply_fixes, restore_fixes, wrap_forward
from aotdist.per_process import made_class
from aotdist.regions import RegionPlan, find_regions


def copy_function(fn: Callable, *, new_code: bool = False) -> types.FunctionType:
    """A fresh function object with ``fn``'s code, so marking never writes attributes on it.

    With ``new_code`` the code object is a copy too: Dynamo caches compiled frames per
    code object, so a region compiled as a frame of its own gets a cache of its own.
    """
    fn = getattr(fn, "__func__", fn)
    if not isinstance(fn, types.FunctionType):
        raise ConfigError(
            f"cannot mark {fn!r}: a region's forward must be a plain Python "
            "function; exclude this module class with exclude=[...]"
        )
    code = fn.__code__.replace() if new_code else fn.__code__
    new = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__module__ = fn.__module__
    new.__doc__ = fn.__doc__
    return new


def _dispatch(self, *args, **kwargs):
    return self._aotdist_impl(*args, **kwargs)


def _region_class(
    base: type,
    region: str,
    *,
    count: int = 2,
    clone_aliases: bool = False,
    checkpoint: bool = False,
    nested: bool = True,
) -> type:
    """The region class of ``base``: its forward with :data:`aotdist.fixes.FIXES`' forward wrappers applied, inside
    ``nested_compile_region`` (``nested``) and as frames mode's plain forward."""
    on = {"clone_aliases": clone_aliases, "checkpoint": checkpoint}
    fwd = wrap_forward(copy_function(base.forward), INSIDE, on, nested=nested)
    if nested:
        # One code object per region: torch keys subgraph reuse (and its entry cap) by code.
        marked = torch.compiler.nested_compile_region(
            _compat.unique_code_function(fwd, region), **_compat.region_options(max(8, 2 * count))
        )
    else:
        marked = fwd
    marked = wrap_forward(marked, OUTSIDE, on, nested=nested)
    # For frames mode: the same forward without invoke_subgraph, with a code object of its own.
    plain = _compat.unique_code_function(
        wrap_forward(base.forward, INSIDE, on, frames=True), f"{region}_frame"
    )
    plain = wrap_forward(plain, OUTSIDE, on, frames=True)
    namespace = {
        # forward only dispatches to _aotdist_impl, read at call time: classes made later from
        # this one (fully_shard's FSDP<cls>, a library's __init_subclass__ wrapper) may
        # snapshot forward, and still reach what frames mode or a demotion installs.
        "forward": _compat.unique_code_function(_dispatch, region),
        "_aotdist_impl": marked,
        "_aotdist_plain_forward": plain,
        "_aotdist_base": base,
        "_aotdist_region": region,
    }
    return made_class(base, namespace, pickles_as_base=True)


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
            + "; ".join(problems)
            + ". Fix: build the plan with aotdist.find_regions(model)."
        )


def mark_regions(
    model: nn.Module, plan: RegionPlan | None = None, *, checkpoint: bool = False
) -> RegionState:
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
    stale = [
        f
        for r in plan
        for f in r.fqns
        if getattr(type(model.get_submodule(f)), "_aotdist_region", None) is not None
    ]
    if stale:
        raise OrderingError(
            f"{stale[:3]} were marked by aotdist and then wrapped again (fully_shard?); "
            "their class cannot be swapped without losing that wrapper. Fix: rebuild the "
            "model and apply aotdist.parallelize once."
        )
    state = RegionState(plan=plan, applied=Applied(checkpoint=checkpoint))
    for region in plan:
        apply_region_class(model, state, region.name)
    model.__dict__[STATE_ATTR] = state
    return state


def apply_region_class(
    model: nn.Module,
    state: RegionState,
    name: str,
    *,
    clone_aliases: bool = False,
    nested: bool = True,
):
    region = state.plan.by_name(name)
    cls = _region_class(
        region.module_type,
        name,
        count=region.count,
        clone_aliases=clone_aliases,
        checkpoint=state.applied.checkpoint,
        nested=nested,
    )
    state.applied.classes[name] = cls
    for fqn in region.fqns:
        model.get_submodule(fqn).__class__ = cls
        if nested:
            apply_fixes(model.get_submodule(fqn))  # made traceable as one subgraph
        state.applied.marked[fqn] = name


def unmark_region(
    model: nn.Module, state: RegionState, name: str, *, neutralize: bool = False
) -> None:
    """Returns the region's instances to their own class.

    An instance whose class was wrapped again after marking (``fully_shard`` does that)
    keeps its class; with ``neutralize`` the region class's forward becomes the plain
    forward of the user's class (eager, no checkpointing), otherwise it is an error.
    """
    region = state.plan.by_name(name)
    for fqn in region.fqns:
        mod = model.get_submodule(fqn)
        if not any(
            fqn.startswith(outer + ".") and region_name not in state.applied.demoted
            for outer, region_name in state.applied.marked.items()
        ):
            restore_fixes(mod)  # inside a live region's instance, the fixes are that region's
        base = getattr(type(mod), "_aotdist_base", None)
        if base is None:
            continue
        if type(mod).__bases__ != (base,) and neutralize:
            region_cls = next(c for c in type(mod).__mro__ if "_aotdist_region" in vars(c))
            region_cls._aotdist_impl = copy_function(base.forward)
            state.applied.marked.pop(fqn, None)
            continue
        if type(mod).__bases__ != (base,):
            raise OrderingError(
                f"cannot unmark {fqn!r}: its class {type(mod).__name__} was wrapped again after "
                "aotdist marked it (by fully_shard?). Restore before applying other wrappers."
            )
        mod.__class__ = base
        state.applied.marked.pop(fqn, None)


def unmark_regions(model: nn.Module, *, neutralize: bool = False) -> None:
    """Returns every marked instance to its own class. A no-op on an unmarked model."""
    state = vars(model).get(STATE_ATTR)
    if state is None:
        return
    for region in state.plan:
        unmark_region(model, state, region.name, neutralize=neutralize)
