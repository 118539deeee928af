"""Accelerate internals (checked on accelerate 1.x; the torch versions: each accessor's
``checked_on`` record)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from aotdist._compat._base import checked_on

# --------------------------------------------------------------------- Accelerate


@checked_on("2.11", "2.14")
def accelerator_state_initialized() -> bool:
    """Whether an ``Accelerator`` was created in this process
    (``AcceleratorState._shared_state`` non-empty; accelerate 1.x)."""
    from accelerate.state import AcceleratorState

    return bool(getattr(AcceleratorState, "_shared_state", None))


@checked_on("2.11", "2.14")
def accelerate_old_forward(module: nn.Module) -> Callable | None:
    """The forward Accelerate's ``add_hook_to_module`` wraps (``module._old_forward``),
    or ``None`` when no hook is attached (accelerate 1.x)."""
    return getattr(module, "_old_forward", None)


@checked_on("2.11", "2.14")
def set_accelerate_old_forward(module: nn.Module, fn: Callable) -> None:
    """Replaces the forward Accelerate's hook wraps (``module._old_forward``)."""
    module._old_forward = fn


@checked_on("2.11", "2.14")
def is_accelerate_prepared(model: nn.Module) -> bool:
    """Whether ``accelerator.prepare`` saw ``model`` (``_is_accelerate_prepared``)."""
    return bool(getattr(model, "_is_accelerate_prepared", False))


@checked_on("2.11", "2.14")
def mark_accelerate_prepared(model: Any) -> None:
    """Marks ``model`` (or a dataloader) as prepared, so ``accelerator.prepare`` registers
    it without wrapping it (``_is_accelerate_prepared``; accelerate 1.x)."""
    model._is_accelerate_prepared = True
