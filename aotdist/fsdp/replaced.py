"""Parameters that sharding replaced, and an optimizer that still holds them.

``fully_shard`` (and graph-mode FSDP's DTensor shards) give the model new parameter
objects. An optimizer built before ``aotdist.parallelize`` holds the old ones: its steps
change tensors the model no longer uses, so the loss never moves, and nothing says so.
``parallelize`` records the parameters it replaced; a process-wide optimizer step pre-hook
(torch's public ``register_optimizer_step_pre_hook``) refuses, at an optimizer's first
step, one that holds any of them, with the fix. Each optimizer is checked once; the hook
returns at once when no parameter was replaced.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import nn

from aotdist.errors import OrderingError

_REPLACED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> old param
_CHECKED: weakref.WeakSet = weakref.WeakSet()  # optimizers already checked
_hook = None


def record_replaced(model: nn.Module, before: Iterable[nn.Parameter]) -> int:
    """Remembers each parameter of ``before`` that ``model`` no longer holds; returns how
    many. Entries go with the parameters (weak references)."""
    global _hook
    alive = {id(p) for p in model.parameters()}
    stale = [p for p in before if id(p) not in alive]
    for p in stale:
        _REPLACED[id(p)] = p
    if stale and _hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _hook = register_optimizer_step_pre_hook(_check_first_step)
    return len(stale)


def _check_first_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if not _REPLACED or optimizer in _CHECKED:
        return
    _CHECKED.add(optimizer)
    held = sum(
        1 for group in optimizer.param_groups for p in group["params"] if _REPLACED.get(id(p)) is p
    )
    if held:
        raise OrderingError(
            f"this {type(optimizer).__name__} holds {held} parameter(s) that "
            "aotdist.parallelize replaced when it sharded the model (FSDP2 gives the model "
            "new parameter objects), so its steps would train nothing the model uses. Fix: "
            "build the optimizer after aotdist.parallelize(model, ...), from "
            "model.parameters() (Lightning: in configure_optimizers; Accelerate: "
            "aotdist.callbacks.prepare rebinds the optimizers it is given)."
        )
