"""peft LoRA adapters for ``aotdist zoo --source peft`` and ``peft:TYPE`` specs.

:func:`peft_family` puts a LoRA adapter (rank 4 on the attention projections, dropout 0.05,
as a fine-tuning script sets it) on a frozen tiny ``transformers`` causal LM built from its
config (:func:`~aotdist.check.families.hf_family`), with random weights; the adapter's
``lora_B`` starts non-zero (seeded), not at peft's zeros, so every adapter weight gets a
gradient that says something. Only the adapter trains. :data:`PEFT_MODELS` lists the
families the sweep checks (``docs/models-diffusers-peft.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from aotdist.check.families import FAMILIES, Family, hf_family

# The adapter's settings (peft.LoraConfig's keywords), the attention projections aside.
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.05, "task_type": "CAUSAL_LM"}

# The attention projections of the listed types (a fused QKV where the model has one);
# another type gets peft's own default targets for it.
_SEPARATE = ("q_proj", "k_proj", "v_proj", "o_proj")
ATTENTION_PROJECTIONS = {
    **dict.fromkeys(("llama", "qwen2", "mistral", "gemma", "qwen3"), _SEPARATE),
    "phi3": ("qkv_proj", "o_proj"),
}


def peft_family(
    hf_type: str,
    kind: str | None = None,
    *,
    target_modules: Sequence[str] | None = None,
    notes: str = "",
    **overrides: Any,
) -> Family:
    """A LoRA adapter (:data:`LORA`) on ``target_modules`` (default: the attention
    projections, :data:`ATTENTION_PROJECTIONS`, else peft's default targets for the type)
    of the tiny ``hf_type`` causal LM, frozen:
    the listed family of that type where ``overrides`` are empty (its own overrides, a
    sliding window, kept), else ``hf_family(hf_type, **overrides)``. ``lora_B`` is drawn
    from a normal of std 0.1 (seeded) instead of peft's zeros."""
    listed = next((f for f in FAMILIES if f.name == hf_type), None)
    base = listed if listed is not None and not overrides else None
    base = base or hf_family(hf_type, "transformers model", **overrides)
    targets = target_modules or ATTENTION_PROJECTIONS.get(hf_type)
    targets = None if targets is None else list(targets)

    def build(seed: int):
        import peft

        model, batch = base.build(seed)
        config = peft.LoraConfig(target_modules=targets, **LORA)
        model = peft.get_peft_model(model, config)  # freezes every weight but the adapter's
        g = torch.Generator().manual_seed(seed + 2)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
        model.train()
        return model, batch

    where = "/".join(targets) if targets else "peft's default targets"
    return Family(hf_type, kind or f"LoRA on {where}, {base.kind}", build, "peft", notes)


PEFT_MODELS: tuple[Family, ...] = tuple(
    peft_family(t) for t in ("llama", "qwen2", "mistral", "gemma", "phi3", "qwen3")
)
