"""The models ``aotdist bench`` trains: tiny GPT / ResNet, torchvision's ViT, a transformers
Llama, and a GPT whose blocks sit in an ``nn.ModuleDict``.

All are built from configs with random weights (no downloads). Each comes with a
synthetic batch and a loss, so a training step is the same code for every model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aotdist._compat.extras import require
from aotdist.errors import ConfigError, MissingDependencyError
from aotdist.testing.models import TinyGPT

MODELS = {
    "gpt": "TinyGPT (aotdist.testing): dim 32, 2 heads, seq 16, vocab 64; blocks in a ModuleList",
    "vit": "torchvision VisionTransformer: image 32, patch 8, hidden 32, MLP 64, 2 heads, "
    "10 classes; encoder blocks in an nn.Sequential",
    "resnet": "TinyResNet (aotdist.testing): 3 stages of BasicBlocks (BatchNorm)",
    "llama": "transformers LlamaForCausalLM from a config: hidden 64, MLP 128, 4 heads (2 KV), "
    "seq 16, vocab 128, random weights; decoder layers in a ModuleList",
    "dictgpt": "TinyGPT with its blocks in an nn.ModuleDict (Accelerate's compile_regions "
    "finds no ModuleList there and compiles the whole model)",
    "flux": "diffusers FluxTransformer2DModel from a config: depth double-stream and depth "
    "single-stream blocks, 2 heads x 16, a packed 4x4 latent of 16 channels, 6 text tokens, "
    "random weights; both block classes are its _repeated_blocks (what "
    "compile_repeated_blocks compiles)",
}
_FLUX = {
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "in_channels": 16,
    "joint_attention_dim": 16,
    "pooled_projection_dim": 16,
    "axes_dims_rope": (4, 6, 6),
}
_FLUX_PATCHES, _FLUX_TEXT = 16, 6
_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "use_cache": False,
}
_SEQ = 16

_VIT = {
    "image_size": 32,
    "patch_size": 8,
    "num_heads": 2,
    "hidden_dim": 32,
    "mlp_dim": 64,
    "num_classes": 10,
}


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
    if name == "llama":
        try:
            import transformers as tf
        except ImportError as exc:
            raise MissingDependencyError(
                f"the bench model 'llama' needs transformers ({exc}). Fix: pip install "
                "transformers (aotdist's dev extra has it).",
                extra="dev",
            ) from exc
        config = tf.AutoConfig.for_model("llama", num_hidden_layers=depth, **_LLAMA)
        return _LogitsOnly(tf.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"))
    if name == "dictgpt":
        return _DictGPT(depth=depth)
    if name == "flux":
        diffusers = require("diffusers", feature="the bench model 'flux'")
        flux = diffusers.FluxTransformer2DModel(num_layers=depth, num_single_layers=depth, **_FLUX)
        return _FluxSample(flux)
    raise ConfigError(f"unknown bench model {name!r}; choose one of {', '.join(MODELS)} (--model)")


def synthetic_batch(
    name: str, model: nn.Module, *, batch: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and integer targets for one step of model ``name`` (on the CPU)."""
    if name == "llama":
        x = torch.randint(0, _LLAMA["vocab_size"], (batch, _SEQ), generator=generator)
        return x, torch.randint(0, _LLAMA["vocab_size"], (batch, _SEQ), generator=generator)
    if name == "flux":  # the loss: cross-entropy of each patch's 16 channels
        channels = _FLUX["in_channels"]
        x = torch.randn(batch, _FLUX_PATCHES, channels, generator=generator)
        return x, torch.randint(0, channels, (batch, _FLUX_PATCHES), generator=generator)
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


class _LogitsOnly(nn.Module):
    """A transformers causal LM returning its logits tensor (the bench's loss takes one).
    The model stays a child as it is: its decoder layers are what the strategies find."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids).logits


class _FluxSample(nn.Module):
    """Flux at one fixed timestep, text embedding and positions, returning its sample (the
    bench's loss takes one tensor). The denoiser stays a child as it is."""

    def __init__(self, denoiser: nn.Module):
        super().__init__()
        self.denoiser = denoiser
        g = torch.Generator().manual_seed(0)
        text = torch.randn(1, _FLUX_TEXT, _FLUX["joint_attention_dim"], generator=g)
        self.register_buffer("text", text, persistent=False)
        pooled = torch.randn(1, _FLUX["pooled_projection_dim"], generator=g)
        self.register_buffer("pooled", pooled, persistent=False)
        rows = torch.arange(4).repeat_interleave(4)
        img_ids = torch.stack([torch.zeros(16), rows, torch.arange(4).repeat(4)], -1)
        self.register_buffer("img_ids", img_ids.float(), persistent=False)
        self.register_buffer("txt_ids", torch.zeros(_FLUX_TEXT, 3), persistent=False)

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        batch = latents.shape[0]
        return self.denoiser(
            hidden_states=latents,
            encoder_hidden_states=self.text.expand(batch, -1, -1),
            pooled_projections=self.pooled.expand(batch, -1),
            timestep=torch.full((batch,), 0.5, device=latents.device),
            img_ids=self.img_ids,
            txt_ids=self.txt_ids,
        ).sample


class _DictGPT(TinyGPT):
    """TinyGPT whose blocks are held by name in an ``nn.ModuleDict``."""

    def __init__(self, *, depth: int):
        super().__init__(depth=depth)
        self.blocks = nn.ModuleDict({f"layer{i}": b for i, b in enumerate(self.blocks)})

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x))
