"""BatchNorm inside a region in training: running statistics updated without a mutation
torch's ``invoke_subgraph`` sees.

``invoke_subgraph`` refuses in-place buffer mutation in training, so a block holding
BatchNorm was demoted. While compiling in training, a region's BatchNorm normalizes with
batch statistics (``F.batch_norm`` without running statistics: no mutation) and updates its
running statistics through ``aotdist::update_batch_norm_stats``, a custom op declared
non-mutating on purpose (nothing in a training step reads them after the update). In eval,
outside a compile and in a recompute in backward, BatchNorm runs as the user's class does.
Only a module whose ``forward`` is torch's own ``_BatchNorm.forward`` (function identity)
is swapped: a subclass with a forward of its own (timm's ``BatchNormAct2d``) runs as
written, and the buffer-write pass (aotdist.fixes.hoist) keeps its region reused.
Details: docs/internals.md.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from aotdist import _compat
from aotdist._compat.modules import batch_norm_base, check_batch_norm_input
from aotdist.per_process import made_class

_LIB = "aotdist::update_batch_norm_stats"


@functools.cache
def update_op():
    """Registers (once, on first use) and returns the running-statistics update op."""

    @torch.library.custom_op(_LIB, mutates_args=())
    def update_batch_norm_stats(
        running_mean: torch.Tensor,
        running_var: torch.Tensor,
        num_batches_tracked: torch.Tensor,
        mean: torch.Tensor,
        var: torch.Tensor,
        momentum: float,
    ) -> torch.Tensor:
        if _compat.in_autograd_backward():
            # activation checkpointing recomputes the region's call in backward: the
            # statistics were updated in forward already (once, as torch.compile does)
            return mean.new_zeros(())
        with torch.no_grad():
            num_batches_tracked.add_(1)
            # momentum=None (a cumulative average): the factor stays a tensor, no host sync
            factor = 1.0 / num_batches_tracked.to(running_mean.dtype) if momentum < 0 else momentum
            running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype) * factor)
            running_var.mul_(1 - factor).add_(var.to(running_var.dtype) * factor)
        return mean.new_zeros(())

    @update_batch_norm_stats.register_fake
    def _(running_mean, running_var, num_batches_tracked, mean, var, momentum):
        return mean.new_empty(())

    return update_batch_norm_stats


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    if not (
        self.training
        and self.track_running_stats
        and self.running_mean is not None
        and self.num_batches_tracked is not None
        and torch.compiler.is_compiling()
    ):
        return self._aotdist_bn_base.forward(self, x)
    check_batch_norm_input(self, x)
    dims = [0, *range(2, x.dim())]
    stats = x.detach().to(self.running_mean.dtype)
    zero = torch.ops.aotdist.update_batch_norm_stats(
        self.running_mean,
        self.running_var,
        self.num_batches_tracked,
        stats.mean(dims),
        stats.var(dims, correction=1),
        -1.0 if self.momentum is None else float(self.momentum),
    )
    out = F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
    return out + zero.to(out.dtype)


@functools.cache
def _class(base: type) -> type:
    # remake: a saved graph pickles its instances as made again from ``base``
    # (aotdist.per_process.pickled_with_region_depth)
    return made_class(
        base, {"forward": _forward, "_aotdist_bn_base": base}, remake=(_class, (base,))
    )


def _reproduced(cls: type) -> bool:
    """Whether ``cls.forward`` is exactly the function :func:`_forward` reproduces (torch's
    ``_BatchNorm.forward``): a subclass that overrides it (an activation after the norm,
    SyncBatchNorm) is never swapped, whatever its name or base."""
    return cls.forward is batch_norm_base().forward


def swap(module: nn.Module) -> list[nn.Module]:
    """Gives each BatchNorm under ``module`` whose forward is torch's own the class above;
    returns the modules swapped."""
    swapped = []
    if _compat.in_autograd_backward() is None:  # cannot tell a recompute: left demoted
        return swapped
    for mod in module.modules():
        cls = type(mod)
        if (
            isinstance(mod, batch_norm_base())
            and _reproduced(cls)
            and "_aotdist_bn_base" not in vars(cls)
        ):
            mod.__class__ = _class(cls)
            swapped.append(mod)
    if swapped:
        update_op()  # registered here, outside any trace
    return swapped


def restore(module: nn.Module) -> None:
    """Undoes :func:`swap` under ``module``."""
    for mod in module.modules():
        base = vars(type(mod)).get("_aotdist_bn_base")
        if base is not None:
            mod.__class__ = base
