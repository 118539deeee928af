"""Marking regions for ``invoke_subgraph``: a per-region subclass of each instance's class.

Marking swaps each region instance's class for a per-region subclass whose ``forward``
is wrapped by ``torch.compiler.nested_compile_region`` (FSDP2's ``fully_shard`` swaps
classes the same way); other instances of the user's class are untouched. The class swap
keeps ``self`` a real argument of the region, so Dynamo lifts each instance's own
parameters: binding a marked function per instance runs the first block's weights for
every block on torch 2.15 (docs/internals.md). The region class also clones outputs that
alias an input and applies activation checkpointing when asked.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from aotdist import _compat
from aotdist.compile.fixes import apply_fixes, restore_fixes
from aotdist.compile.per_process import made_class
from aotdist.compile.state import STATE_ATTR, RegionState
from aotdist.errors import ConfigError, OrderingError
from aotdist.regions import RegionPlan, find_regions

__all__ = ["is_compiled", "mark_regions", "unmark_regions"]


def copy_function(fn: Callable, *, new_code: bool = False) -> types.FunctionType:
    """A fresh function object with ``fn``'s code, so marking never writes attributes on it.

    With ``new_code`` the code object is a copy too: Dynamo caches compiled frames per
    code object, so a region compiled as a frame of its own gets a cache of its own.
    """
    fn = getattr(fn, "__func__", fn)
    if not isinstance(fn, types.FunctionType):
        raise ConfigError(f"cannot mark {fn!r}: a region's forward must be a plain Python "
                          "function; exclude this module class with exclude=[...]")
    code = fn.__code__.replace() if new_code else fn.__code__
    new = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__,
                             fn.__closure__)
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
        inputs = [a for a in _compat.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)]

        def dealias(t):
            if isinstance(t, torch.Tensor) and (any(t is a for a in inputs)
                                                or t._base is not None):
                return t.clone()
            return t

        return _compat.tree_map(dealias, out)

    return forward


def _dealiased_inputs(fn: Callable) -> Callable:
    """Wraps a region call so that no two tensor inputs share storage (invoke_subgraph
    forbids it): a later input that is, or views the same base as, an earlier one is
    cloned before the call, outside the region (GPT-J's ``sin, cos``, two halves of one
    tensor). Not ``functools.wraps``: that would copy the region marker of ``fn``'s
    ``__dict__`` and make this wrapper the region."""

    def forward(self, *args, **kwargs):
        seen: list[torch.Tensor] = []

        def dealias(t):
            if not isinstance(t, torch.Tensor):
                return t
            root = t if t._base is None else t._base
            if any(root is s for s in seen):
                return t.clone()
            seen.append(root)
            return t

        args, kwargs = _compat.tree_map(dealias, (args, kwargs))
        return fn(self, *args, **kwargs)

    return forward


def _checkpointed(fn: Callable) -> Callable:
    """Wraps a forward in non-reentrant activation checkpointing.

    Outside the region: the checkpoint saves only the region's inputs, and under compile
    the recompute is part of the compiled backward (the region's subgraph is still reused).
    """
    @functools.wraps(fn)
    def forward(self, *args, **kwargs):
        return _checkpoint(fn, self, *args, use_reentrant=False, **kwargs)

    return forward


def _contiguous_stream(fn: Callable) -> Callable:
    """Wraps a region forward so that, while compiling, each non-contiguous output with the
    shape of the region's first tensor input, where that input is contiguous, is made
    contiguous.

    A block's output usually feeds the next instance as its input (the residual stream).
    Where the block computes it in another layout (torchvision's ViT: a transposed
    ``(batch, seq, dim)`` out of its attention), the first call site's input is contiguous
    and every later one's is not, and torch compiles the region twice (its subgraph in
    a whole-model graph, its frame under FSDP2's hooks alike). The copy costs a
    kernel in the forward and one in the backward (ViT: 1-3% of a step, against a second
    compile of the block); values are unchanged, only the output's strides.
    """

    @functools.wraps(fn)
    def forward(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        stream = next((t for t in _compat.tree_leaves((args, kwargs))
                       if isinstance(t, torch.Tensor)), None)
        if (stream is None or not stream.is_contiguous()
                or not torch.compiler.is_compiling()):
            return out

        def fix(t):
            if (isinstance(t, torch.Tensor) and t.shape == stream.shape
                    and not t.is_contiguous()):
                return t.contiguous()
            return t

        return _compat.tree_map(fix, out)

    return forward


def _detach_no_grad_outputs(fn: Callable) -> Callable:
    """Wraps a region forward so that an output that needs no gradient is ``detach()``-ed.

    Dynamo evaluates the condition at trace time, so the subgraph carries an explicit
    ``detach`` exactly where the traced output had ``requires_grad=False`` (a mask, a
    pass-through of a tensor that needs no gradient). Semantically a no-op; it keeps
    AOTAutograd's view of the output consistent with Dynamo's on torch releases whose
    ``InvokeSubgraphAutogradOp`` marks every output as requiring grad (torch 2.11; fixed
    by pytorch/pytorch#181208, which calls ``mark_non_differentiable``; 2.15 has it).
    There, the next call site gets that output as an input requiring grad, the reused
    subgraph's joint graph then wants a tangent the forward metadata did not plan for, and
    AOTAutograd fails with ``outs_to_grad length (2) != tangents length (1)``.
    """

    @functools.wraps(fn)
    def forward(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        if not torch.is_grad_enabled():
            return out

        def detach(t):
            if (isinstance(t, torch.Tensor) and not t.requires_grad
                    and (t.is_floating_point() or t.is_complex())):
                return t.detach()
            return t

        return _compat.tree_map(detach, out)

    return forward


def _dispatch(self, *args, **kwargs):
    return self._aotdist_impl(*args, **kwargs)


def _region_class(base: type, region: str, *, count: int = 2, clone_aliases: bool = False,
                  checkpoint: bool = False, nested: bool = True) -> type:
    fwd = copy_function(base.forward)
    if clone_aliases:
        fwd = _clone_aliasing_outputs(fwd)
    if nested:
        # One code object per region: torch keys subgraph reuse (and its entry cap) by code.
        fwd = _compat.unique_code_function(
            _detach_no_grad_outputs(_contiguous_stream(fwd)), region)
        marked = torch.compiler.nested_compile_region(
            fwd, **_compat.region_options(max(8, 2 * count)))
        if clone_aliases:
            marked = _dealiased_inputs(marked)
    else:
        marked = fwd
    # For frames mode: the same forward without invoke_subgraph, with a code object of its own;
    # its residual stream made contiguous too, or each frame compiles twice (ViT).
    plain = _compat.unique_code_function(_contiguous_stream(base.forward), f"{region}_frame")
    if checkpoint:
        marked, plain = _checkpointed(marked), _checkpointed(plain)
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
        apply_region_class(model, state, region.name)
    model.__dict__[STATE_ATTR] = state
    return state


def apply_region_class(model: nn.Module, state: RegionState, name: str, *,
                        clone_aliases: bool = False, nested: bool = True):
    region = state.plan.by_name(name)
    cls = _region_class(region.module_type, name, count=region.count,
                        clone_aliases=clone_aliases, checkpoint=state.checkpoint, nested=nested)
    state.classes[name] = cls
    for fqn in region.fqns:
        model.get_submodule(fqn).__class__ = cls
        if nested:
            apply_fixes(model.get_submodule(fqn))  # made traceable as one subgraph
        state.marked[fqn] = name


def unmark_region(model: nn.Module, state: RegionState, name: str, *,
                   neutralize: bool = False) -> None:
    """Returns the region's instances to their own class.

    An instance whose class was wrapped again after marking (``fully_shard`` does that)
    keeps its class; with ``neutralize`` the region class's forward becomes the plain
    forward of the user's class (eager, no checkpointing), otherwise it is an error.
    """
    region = state.plan.by_name(name)
    for fqn in region.fqns:
        mod = model.get_submodule(fqn)
        if not any(fqn.startswith(outer + ".") and region_name not in state.demoted
                   for outer, region_name in state.marked.items()):
            restore_fixes(mod)  # inside a live region's instance, the fixes are that region's
        base = getattr(type(mod), "_aotdist_base", None)
        if base is None:
            continue
        if type(mod).__bases__ != (base,) and neutralize:
            region_cls = next(c for c in type(mod).__mro__ if "_aotdist_region" in vars(c))
            region_cls._aotdist_impl = copy_function(base.forward)
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
        unmark_region(model, state, region.name, neutralize=neutralize)
