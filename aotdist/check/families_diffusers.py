"""diffusers' denoisers for ``aotdist zoo --source diffusers`` and ``diffusers:CLASS`` specs.

:func:`diffusers_family` builds a diffusers model class from its constructor arguments at a
tiny size (2-3 blocks of width 32, a latent of a few patches) with random weights, in train
mode, and a batch of random inputs its ``forward`` takes (latents, timesteps, text
embeddings, pooled projections, position ids); the loss is the mean square of the output's
``sample``. :data:`DIFFUSERS_MODELS` lists the classes the sweep checks
(``docs/models-diffusers-peft.md``): DiT, MMDiT, UNet and video transformer denoisers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from aotdist.check.families import Family


def sample_loss(output: Any) -> torch.Tensor:
    """The mean square of a denoiser's prediction: the output's ``sample`` (a tuple: its
    first tensor)."""
    sample = getattr(output, "sample", None)
    if sample is None:
        sample = output if isinstance(output, torch.Tensor) else output[0]
    return sample.float().square().mean()


def diffusers_family(
    cls: str,
    kind: str,
    *,
    inputs: Callable[[torch.Generator], dict[str, Any]],
    notes: str = "",
    **kwargs: Any,
) -> Family:
    """``diffusers.<cls>(**kwargs)`` with random weights, in train mode; the batch is what
    ``inputs(generator)`` returns (keyword arguments of its ``forward``)."""

    def build(seed: int):
        import diffusers

        torch.manual_seed(seed)
        model = getattr(diffusers, cls)(**kwargs)
        model.train()
        return model, inputs(torch.Generator().manual_seed(seed + 1))

    return Family(cls, kind, build, "diffusers", notes, loss=sample_loss)


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def _steps(g: torch.Generator, batch: int = 2) -> torch.Tensor:
    """Integer timesteps of a 1000-step schedule."""
    return torch.randint(0, 1000, (batch,), generator=g)


def _sigmas(g: torch.Generator, batch: int = 2) -> torch.Tensor:
    """Flow-matching timesteps in [0, 1] (the model scales them by 1000)."""
    return torch.rand(batch, generator=g)


def _ids(frames: int, height: int, width: int) -> torch.Tensor:
    """(frame, row, column) position ids of a latent's patches, one row per patch."""
    grid = torch.meshgrid(
        torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij"
    )
    return torch.stack(grid, dim=-1).reshape(-1, 3).float()


def _dit(g):
    return {
        "hidden_states": _randn(g, 2, 4, 8, 8),
        "timestep": _steps(g),
        "class_labels": torch.randint(0, 10, (2,), generator=g),
    }


def _pixart(g):
    return {
        "hidden_states": _randn(g, 2, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 2, 6, 16),
        "timestep": _steps(g),
        "added_cond_kwargs": {"aspect_ratio": None, "resolution": None},
    }


def _sd3(g):
    return {
        "hidden_states": _randn(g, 2, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 2, 6, 16),
        "pooled_projections": _randn(g, 2, 16),
        "timestep": _steps(g),
    }


def _flux(g):
    return {
        "hidden_states": _randn(g, 1, 16, 16),  # a 4x4 latent, packed
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "pooled_projections": _randn(g, 1, 16),
        "timestep": _sigmas(g, 1),
        "img_ids": _ids(1, 4, 4),
        "txt_ids": torch.zeros(6, 3),
    }


def _auraflow(g):
    return {
        "hidden_states": _randn(g, 2, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 2, 6, 16),
        "timestep": _sigmas(g),
    }


def _sana(g):
    return {
        "hidden_states": _randn(g, 2, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 2, 6, 16),
        "timestep": _steps(g),
    }


def _lumina2(g):
    return {
        "hidden_states": _randn(g, 2, 4, 8, 8),
        "timestep": _sigmas(g),
        "encoder_hidden_states": _randn(g, 2, 6, 16),
        "encoder_attention_mask": torch.ones(2, 6, dtype=torch.bool),
    }


def _cogview4(g):
    size = torch.tensor([[64.0, 64.0]] * 2)
    return {
        "hidden_states": _randn(g, 2, 4, 8, 8),
        "encoder_hidden_states": _randn(g, 2, 6, 16),
        "timestep": _steps(g),
        "original_size": size,
        "target_size": size,
        "crop_coords": torch.zeros(2, 2),
    }


def _qwenimage(g):
    return {
        "hidden_states": _randn(g, 2, 16, 16),  # a 4x4 latent, packed
        "encoder_hidden_states": _randn(g, 2, 6, 16),
        "encoder_hidden_states_mask": torch.ones(2, 6, dtype=torch.long),
        "timestep": _sigmas(g),
        "img_shapes": [(1, 4, 4)] * 2,
    }


def _unet_cond(g):
    return {
        "sample": _randn(g, 2, 4, 16, 16),
        "timestep": _steps(g),
        "encoder_hidden_states": _randn(g, 2, 6, 16),
    }


def _unet(g):
    return {"sample": _randn(g, 2, 3, 16, 16), "timestep": _steps(g)}


def _wan(g):
    return {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "timestep": _steps(g, 1),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
    }


def _ltx(g):
    return {
        "hidden_states": _randn(g, 1, 2 * 4 * 4, 8),  # 2 frames of 4x4, packed
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "timestep": _steps(g, 1),
        "encoder_attention_mask": torch.ones(1, 6, dtype=torch.long),
        "num_frames": 2,
        "height": 4,
        "width": 4,
    }


def _cogvideox(g):
    return {
        "hidden_states": _randn(g, 1, 2, 4, 8, 8),  # (batch, frames, channels, h, w)
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "timestep": _steps(g, 1),
    }


def _hunyuan_video(g):
    return {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "timestep": _steps(g, 1),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "encoder_attention_mask": torch.ones(1, 6, dtype=torch.long),
        "pooled_projections": _randn(g, 1, 16),
        "guidance": torch.tensor([1000.0]),
    }


def _mochi(g):
    return {
        "hidden_states": _randn(g, 1, 4, 2, 8, 8),
        "encoder_hidden_states": _randn(g, 1, 6, 16),
        "timestep": _steps(g, 1),
        "encoder_attention_mask": torch.ones(1, 6, dtype=torch.long),
    }


# Each denoiser at width 32 (heads x head size), 2-3 blocks, text embeddings of width 16.
_HEADS = {"num_attention_heads": 2, "attention_head_dim": 16}
DIFFUSERS_MODELS: tuple[Family, ...] = (
    diffusers_family(
        "DiTTransformer2DModel",
        "DiT, class-conditioned",
        inputs=_dit,
        in_channels=4,
        num_layers=3,
        norm_num_groups=8,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
        **_HEADS,
    ),
    diffusers_family(
        "PixArtTransformer2DModel",
        "DiT, cross-attention (PixArt)",
        inputs=_pixart,
        in_channels=4,
        out_channels=8,
        num_layers=3,
        norm_num_groups=8,
        sample_size=8,
        patch_size=2,
        cross_attention_dim=32,
        caption_channels=16,
        use_additional_conditions=False,
        **_HEADS,
    ),
    diffusers_family(
        "SD3Transformer2DModel",
        "MMDiT (Stable Diffusion 3)",
        inputs=_sd3,
        sample_size=8,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=3,
        joint_attention_dim=16,
        caption_projection_dim=32,
        pooled_projection_dim=16,
        pos_embed_max_size=16,
        **_HEADS,
    ),
    diffusers_family(
        "FluxTransformer2DModel",
        "MMDiT (Flux), double and single blocks",
        inputs=_flux,
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        joint_attention_dim=16,
        pooled_projection_dim=16,
        axes_dims_rope=(4, 6, 6),
        **_HEADS,
    ),
    diffusers_family(
        "AuraFlowTransformer2DModel",
        "MMDiT (AuraFlow), joint and single blocks",
        inputs=_auraflow,
        sample_size=8,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_mmdit_layers=2,
        num_single_dit_layers=2,
        joint_attention_dim=16,
        caption_projection_dim=32,
        pos_embed_max_size=64,
        **_HEADS,
    ),
    diffusers_family(
        "SanaTransformer2DModel",
        "DiT, linear attention (Sana)",
        inputs=_sana,
        in_channels=4,
        out_channels=4,
        num_layers=3,
        num_cross_attention_heads=2,
        cross_attention_head_dim=16,
        cross_attention_dim=32,
        caption_channels=16,
        sample_size=8,
        patch_size=1,
        **_HEADS,
    ),
    diffusers_family(
        "Lumina2Transformer2DModel",
        "DiT, refiner and rotary (Lumina 2)",
        inputs=_lumina2,
        sample_size=8,
        patch_size=2,
        in_channels=4,
        hidden_size=32,
        num_layers=3,
        num_refiner_layers=2,
        num_attention_heads=2,
        num_kv_heads=1,
        multiple_of=16,
        axes_dim_rope=(4, 6, 6),
        axes_lens=(32, 32, 32),
        cap_feat_dim=16,
    ),
    diffusers_family(
        "CogView4Transformer2DModel",
        "DiT, joint attention (CogView 4)",
        inputs=_cogview4,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=3,
        text_embed_dim=16,
        time_embed_dim=16,
        condition_dim=8,
        rope_axes_dim=(4, 4),
        **_HEADS,
    ),
    diffusers_family(
        "QwenImageTransformer2DModel",
        "MMDiT (Qwen-Image)",
        inputs=_qwenimage,
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=3,
        joint_attention_dim=16,
        axes_dims_rope=(4, 6, 6),
        **_HEADS,
    ),
    diffusers_family(
        "UNet2DConditionModel",
        "UNet, cross-attention (Stable Diffusion)",
        inputs=_unet_cond,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=2,
        norm_num_groups=8,
        cross_attention_dim=16,
        attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    ),
    diffusers_family(
        "UNet2DModel",
        "UNet, self-attention (DDPM)",
        inputs=_unet,
        sample_size=16,
        in_channels=3,
        out_channels=3,
        block_out_channels=(16, 32),
        layers_per_block=2,
        norm_num_groups=8,
        attention_head_dim=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    ),
    diffusers_family(
        "WanTransformer3DModel",
        "video transformer (Wan)",
        inputs=_wan,
        patch_size=(1, 2, 2),
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=32,
        ffn_dim=64,
        num_layers=3,
        rope_max_seq_len=32,
        **_HEADS,
    ),
    diffusers_family(
        "LTXVideoTransformer3DModel",
        "video transformer (LTX-Video)",
        inputs=_ltx,
        in_channels=8,
        out_channels=8,
        cross_attention_dim=32,
        num_layers=3,
        caption_channels=16,
        **_HEADS,
    ),
    diffusers_family(
        "CogVideoXTransformer3DModel",
        "video transformer (CogVideoX)",
        inputs=_cogvideox,
        in_channels=4,
        out_channels=4,
        time_embed_dim=16,
        text_embed_dim=16,
        num_layers=3,
        sample_width=8,
        sample_height=8,
        sample_frames=5,
        patch_size=2,
        max_text_seq_length=6,
        **_HEADS,
    ),
    diffusers_family(
        "HunyuanVideoTransformer3DModel",
        "video transformer (HunyuanVideo), MMDiT",
        inputs=_hunyuan_video,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        num_single_layers=2,
        num_refiner_layers=2,
        patch_size=2,
        patch_size_t=1,
        text_embed_dim=16,
        pooled_projection_dim=16,
        rope_axes_dim=(4, 6, 6),
        **_HEADS,
    ),
    diffusers_family(
        "MochiTransformer3DModel",
        "video transformer (Mochi), asymmetric joint attention",
        inputs=_mochi,
        patch_size=2,
        num_layers=3,
        pooled_projection_dim=16,
        in_channels=4,
        text_embed_dim=16,
        time_embed_dim=16,
        max_sequence_length=6,
        **_HEADS,
    ),
)
