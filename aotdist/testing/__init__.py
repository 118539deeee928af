"""Test helpers: tiny models with repeated regions and a multi-process runner."""

from aotdist.testing.models import (
    AliasingNet,
    TinyGPT,
    TinyResNet,
    TinyViT,
    build_model,
    example_inputs,
)

__all__ = [
    "AliasingNet",
    "TinyGPT",
    "TinyResNet",
    "TinyViT",
    "build_model",
    "example_inputs",
]
