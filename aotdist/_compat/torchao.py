"""torchao internals (checked on torchao 0.18; the torch versions: each accessor's
``checked_on`` record)."""

from __future__ import annotations

from typing import Any

import torch

from aotdist._compat._base import checked_on


@checked_on("2.11", "2.14", note="torchao 0.18")
def float8_weight_bits(
    hp: torch.Tensor, scale: torch.Tensor, float8_dtype: torch.dtype, mm_config: Any
) -> torch.Tensor:
    """``hp`` cast to ``float8_dtype`` with ``scale`` as torchao casts a Float8Linear's
    weight (``hp_tensor_and_scale_to_float8(..., GemmInputRole.WEIGHT)``), as the plain
    float8 tensor inside the ``Float8TrainingTensor`` it returns (its private ``_data``)."""
    from torchao.float8.float8_training_tensor import (
        GemmInputRole,
        hp_tensor_and_scale_to_float8,
    )

    cast = hp_tensor_and_scale_to_float8(hp, scale, float8_dtype, mm_config, GemmInputRole.WEIGHT)
    return cast._data
