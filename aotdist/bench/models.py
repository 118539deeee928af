"""The models ``aotdist bench`` trains: built-in tiny GPT / ResNet and torchvision's ViT.

All are built from configs with random weights (no downloads). Each comes with a
synthetic batch and a loss, so a training step is the same code for every model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aotdist._compat.extras import require
from aotdist.errors import ConfigError

__all__ = ["MODELS", "build_bench_model", "describe_model", "synthetic_batch", "training_loss"]

MODELS = {
    "gpt": "TinyGPT (aotdist.testing): dim 32, 2 heads, seq 16, vocab 64; blocks in a ModuleList",
    "vit": "torchvision VisionTransformer: image 32, patch 8, hidden 32, MLP 64, 2 heads, "
           "10 classes; encoder blocks in an nn.Sequential",
    "resnet": "TinyResNet (aotdist.testing): 3 stages of BasicBlocks (BatchNorm)",
}

_VIT = {"image_size": 32, "patch_size": 8, "num_heads": 2, "hidden_dim": 32, "mlp_dim": 64,
        "num_classes": 10}


def describe_model(name: str) -> str:
    """One line saying what ``name`` is, for the report."""
    return MODELS.get(name, name)


def build_bench_model(name: str, *, depth: int) -> nn.Module:
    """A fresh model with ``depth`` repeated blocks and random weights.

    Raises:
        ConfigError: ``name`` is not one of :data:`MODELS`.
    """
    if name == "vit":
        tv = require("torchvision.models", feature="the bench model 'vit'")
        return tv.VisionTransformer(num_layers=depth, **_VIT)
    if name in ("gpt", "resnet"):
        from aotdist.testing.models import build_model

        return build_model(name, depth=depth)
    raise ConfigError(f"unknown bench model {name!r}; choose one of {', '.join(MODELS)} "
                      "(--model)")


def synthetic_batch(name: str, model: nn.Module, *, batch: int,
                    generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and integer targets for one step of model ``name`` (on the CPU)."""
    if name == "vit":
        size, classes = _VIT["image_size"], _VIT["num_classes"]
        x = torch.randn(batch, 3, size, size, generator=generator)
        return x, torch.randint(0, classes, (batch,), generator=generator)
    from aotdist.testing.models import example_inputs

    (x,), y = example_inputs(model, batch, generator=generator)
    return x, y


def training_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension (token logits or class logits)."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target.reshape(-1))
