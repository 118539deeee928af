"""torchtitan's models for ``aotdist zoo --source torchtitan`` and ``titan:NAME`` specs.

:func:`titan_family` builds a model from torchtitan's own model code at a tiny size (its
debug flavor, 3 blocks, fewer and narrower experts, SDPA attention) with random weights;
:data:`TITAN_MODELS` names the models checked, and :func:`titan_unavailable` says why
torchtitan's code does not import here (not installed, or a torch older than it needs).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from aotdist._compat.models import titan_qwen3_moe_layers
from aotdist.check.families import Family
from aotdist.errors import first_line


def _titan_tiny(name: str):
    """A torchtitan model config at a tiny size: its debug flavor's own code and layer
    builders, 3 blocks (DeepSeek-V3: one dense and 3 MoE), fewer and narrower experts,
    and torchtitan's SDPA inner attention (causal) for the flex attention its language
    models default to (a block mask needs positions from its data loader)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if name in ("llama3", "qwen3"):
        module = importlib.import_module(f"torchtitan.models.{name}")
        config = module.model_registry("debugmodel", attn_backend="flex").model
        config.layers = config.layers[:3]
    elif name == "qwen3_moe":
        from torchtitan.models import qwen3

        config = qwen3.model_registry("debugmodel_moe", attn_backend="flex").model
        rope = config.layers[0].attention.rope
        config.layers = titan_qwen3_moe_layers(
            n_layers=3,
            dim=config.dim,
            n_heads=16,
            n_kv_heads=8,
            head_dim=16,
            moe_hidden_dim=64,
            num_experts=8,
            top_k=2,
            attn_backend="flex",
            moe_comm_backend="standard",
            rope=_rope(rope, 16),
        )
    elif name == "deepseek_v3":
        from torchtitan.models import deepseek_v3

        config = deepseek_v3.model_registry("debugmodel", attn_backend="flex").model
        config.layers = config.layers[:4]
    else:
        raise ValueError(
            f"titan:{name}: torchtitan models checked here are {', '.join(TITAN_MODELS)}"
        )
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _rope(rope, head_dim: int):
    import dataclasses

    return dataclasses.replace(rope, dim=head_dim)


TITAN_MODELS = {
    "llama3": "dense decoder (Llama 3)",
    "qwen3": "dense decoder, QK norm (Qwen 3)",
    "qwen3_moe": "MoE decoder (Qwen 3 MoE)",
    "deepseek_v3": "MLA + MoE decoder (DeepSeek-V3)",
}

# torchtitan 0.3's model code imports torch.distributed.fsdp.DataParallelMeshDims (torch 2.12)
TITAN_MIN_TORCH = "2.12"


def titan_unavailable(name: str = "llama3") -> str | None:
    """Why torchtitan's model code for ``name`` does not import here (``None``: it does)."""
    module = "qwen3" if name == "qwen3_moe" else name
    try:
        importlib.import_module(f"torchtitan.models.{module}")
    except ModuleNotFoundError as exc:
        if (
            exc.name is not None
            and exc.name.split(".")[0] == "torchtitan"
            and ("." not in exc.name)
        ):
            return "torchtitan is not installed (pip install --no-deps torchtitan spmd_types tyro)"
        return f"needs torchtitan's dependency {exc.name}: {first_line(exc)}"
    except ImportError as exc:  # its code uses torch.distributed APIs newer than this torch
        return (
            f"needs torch >= {TITAN_MIN_TORCH} (torchtitan's model code does not import "
            f"on torch {torch.__version__.split('+')[0]}: {first_line(exc)})"
        )
    return None


def titan_family(name: str) -> Family:
    """A torchtitan model built from its own model code (:func:`_titan_tiny`) with random
    weights; the batch is 2 random token sequences of 16, the loss cross-entropy on the
    next token."""

    def build(seed: int):
        missing = titan_unavailable(name)
        if missing:
            raise RuntimeError(missing)
        torch.manual_seed(seed)
        config = _titan_tiny(name)
        model = config.build()
        model.init_weights()
        vocab = config.vocab_size
        g = torch.Generator().manual_seed(seed + 1)
        return model, {"*": (torch.randint(0, vocab, (2, 17), generator=g)[:, :-1],)}

    return Family(
        name, TITAN_MODELS.get(name, "torchtitan model"), build, "torchtitan", loss=_next_token_loss
    )


def _next_token_loss(logits: torch.Tensor) -> torch.Tensor:
    labels = torch.arange(logits.shape[1]).expand(logits.shape[:2]) % logits.shape[-1]
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
