"""Forward fixes: wrappers of a region's forward that keep what it computes and make it a
reusable ``invoke_subgraph`` (or a frame that compiles once), applied by
:func:`aotdist.compile.marking` in the order of :data:`aotdist.fixes.FIXES`.

Each runs either inside the region (``INSIDE``: traced into its subgraph) or around its
call (``OUTSIDE``), on the subgraph's forward, on a region compiled inline
(``nested=False``: a demoted or isolated one) and on frames mode's plain forward as its
entry says, and where named only with its option on. A new forward fix is one function
here and one entry in :data:`aotdist.fixes.FIXES`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from aotdist import _compat
from aotdist._compat.modules import view_base

INSIDE, OUTSIDE = "inside", "outside"


def clone_aliasing_outputs(fn: Callable) -> Callable:
    """Wraps a forward so that no output aliases an input (invoke_subgraph forbids it)."""

    @functools.wraps(fn)
    def forward(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        inputs = [a for a in _compat.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]

        def dealias(t):
            if isinstance(t, torch.Tensor) and (
                any(t is a for a in inputs) or view_base(t) is not None
            ):
                return t.clone()
            return t

        return _compat.tree_map(dealias, out)

    return forward


def dealiased_inputs(fn: Callable) -> Callable:
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
            base = view_base(t)
            root = t if base is None else base
            if any(root is s for s in seen):
                return t.clone()
            seen.append(root)
            return t

        args, kwargs = _compat.tree_map(dealias, (args, kwargs))
        return fn(self, *args, **kwargs)

    return forward


def checkpointed(fn: Callable) -> Callable:
    """Wraps a forward in non-reentrant activation checkpointing.

    Outside the region: the checkpoint saves only the region's inputs, and under compile
    the recompute is part of the compiled backward (the region's subgraph is still reused).
    """

    @functools.wraps(fn)
    def forward(self, *args, **kwargs):
        return checkpoint(fn, self, *args, use_reentrant=False, **kwargs)

    return forward


def contiguous_stream(fn: Callable) -> Callable:
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
        stream = next(
            (t for t in _compat.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None
        )
        if stream is None or not stream.is_contiguous() or not torch.compiler.is_compiling():
            return out

        def fix(t):
            if isinstance(t, torch.Tensor) and t.shape == stream.shape and not t.is_contiguous():
                return t.contiguous()
            return t

        return _compat.tree_map(fix, out)

    return forward


def detach_no_grad_outputs(fn: Callable) -> Callable:
    """Wraps a region forward so that an output that needs no gradient is ``detach()``-ed.

    Dynamo evaluates the condition at trace time, so the subgraph carries an explicit
    ``detach`` exactly where the traced output had ``requires_grad=False`` (a mask, a
    pass-through of a tensor that needs no gradient). Semantically a no-op; it keeps
    AOTAutograd's view of the output consistent with Dynamo's on torch releases whose
    ``InvokeSubgraphAutogradOp`` marks every output as requiring grad (torch 2.11; fixed
    by pytorch/pytorch#181208, which calls ``mark_non_differentiable``; 2.14 has it).
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
            if (
                isinstance(t, torch.Tensor)
                and not t.requires_grad
                and (t.is_floating_point() or t.is_complex())
            ):
                return t.detach()
            return t

        return _compat.tree_map(detach, out)

    return forward


@dataclass(frozen=True)
class ForwardFix:
    """One forward fix: ``wrap(forward) -> forward``, where it runs, with which option
    (``when``: a keyword of the region class, ``None``: always) and on which forwards."""

    wrap: Callable[[Callable], Callable]
    where: str  # INSIDE the region's subgraph, or OUTSIDE around its call
    when: str | None = None
    subgraph: bool = True  # the invoke_subgraph forward
    inline: bool = False  # a region compiled inline (nested=False)
    frames: bool = False  # frames mode's plain forward
