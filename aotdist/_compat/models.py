"""Model libraries' private names: the blocks a diffusers model declares for its own
regional compile, and the layer builder of torchtitan's Qwen 3 MoE (checked on diffusers
0.42 and torchtitan 0.3; the torch versions: each accessor's ``checked_on`` record)."""

from __future__ import annotations

from typing import Any

from aotdist._compat._base import checked_on


@checked_on("2.11", "2.14")
def declared_repeated_blocks(obj: Any) -> Any:
    """The class names a model (or its class) declares as its repeated blocks, for
    diffusers' ``compile_repeated_blocks()`` (its ``_repeated_blocks``, private by
    diffusers' naming), ``None`` where it declares none; as found, the caller checks it."""
    return getattr(obj, "_repeated_blocks", None)


@checked_on("2.14", note="torchtitan 0.3's model code needs torch >= 2.12")
def titan_qwen3_moe_layers(**kwargs: Any) -> list:
    """The layer configs of torchtitan's Qwen 3 MoE, built by the private helper its
    ``debugmodel_moe`` flavor uses (``torchtitan.models.qwen3._build_qwen3_moe_layers``),
    with the caller's sizes."""
    from torchtitan.models import qwen3

    return qwen3._build_qwen3_moe_layers(**kwargs)
