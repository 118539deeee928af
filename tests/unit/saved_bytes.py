"""The activation bytes one training step saves for backward, measured as the bench does
(:class:`aotdist.bench.saved.SavedBytes`); shared by the partition tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from aotdist.bench.saved import SavedBytes


def saved_activation_bytes(
    model: nn.Module, x: torch.Tensor, call: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> int:
    """The activation bytes one forward of ``call`` (default: ``model``) on ``x`` saves for
    backward, ``model``'s parameters and buffers apart (the bench's
    :class:`~aotdist.bench.saved.SavedBytes`); runs the backward, then clears the grads."""
    with SavedBytes(exclude=[*model.parameters(), *model.buffers()]) as saved:
        loss = (model if call is None else call)(x).float().square().mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return saved.activation_bytes
