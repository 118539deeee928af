"""``nn.Module`` and ``Tensor`` internals outside the compiler: torch's private base
classes that aotdist's fixes match modules against, a module's forward-hook dicts and a
view's base tensor."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from aotdist._compat._base import checked_on


@checked_on("2.11", "2.14")
def batch_norm_base() -> type:
    """``nn.modules.batchnorm._BatchNorm``: the base of BatchNorm1d/2d/3d whose ``forward``
    the BatchNorm fix reproduces (private: torch exports only the concrete classes)."""
    return nn.modules.batchnorm._BatchNorm


@checked_on("2.11", "2.14")
def check_batch_norm_input(module: nn.Module, x: torch.Tensor) -> None:
    """Raises as ``module``'s own forward would for an input of the wrong rank
    (``_BatchNorm._check_input_dim``, each concrete class's private check).

    Raises:
        ValueError: ``x`` has the wrong number of dims for ``module``.
    """
    module._check_input_dim(x)


@checked_on("2.11", "2.14")
def dropout_base() -> type:
    """``nn.modules.dropout._DropoutNd``: the base of every dropout module with a rate
    ``p`` (private: torch exports only the concrete classes)."""
    return nn.modules.dropout._DropoutNd


@checked_on("2.11", "2.14")
def forward_hooks(module: nn.Module) -> list[Callable]:
    """``module``'s own forward pre-hooks, then its forward hooks (the private
    ``_forward_pre_hooks`` / ``_forward_hooks`` dicts: torch has no public getter)."""
    return [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]


@checked_on("2.11", "2.14")
def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of, ``None`` when it is no view (``Tensor._base``,
    private by its name; Dynamo traces it)."""
    return t._base
