"""The model families ``aotdist check`` and ``aotdist zoo`` know: tiny random-weight builds.

Each :class:`Family` builds a model and one batch from a config alone, offline: no weights
or datasets are downloaded. :data:`FAMILIES` is the registry of the listed families,
``transformers`` ones (:func:`hf_family`, on :mod:`~aotdist.check.tiny_config`'s tiny
configs) and ``torchvision`` ones (:func:`torchvision_family`). The other sources build
the same :class:`Family`: timm's architectures in :mod:`~aotdist.check.families_timm`,
torchtitan's models in :mod:`~aotdist.check.families_titan`, diffusers' denoisers in
:mod:`~aotdist.check.families_diffusers`, peft's adapters in :mod:`~aotdist.check.families_peft`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from aotdist._compat.modules import dropout_base
from aotdist.check.tiny_config import hf_config, text_config


@dataclass(frozen=True)
class Family:
    """One model family: ``build(seed)`` returns ``(model, inputs)``; ``inputs`` is a dict of
    keyword arguments, and ``loss(model(**inputs))`` a scalar to train on."""

    name: str
    kind: str  # a short description of the architecture: "dense decoder", "MoE", ...
    build: Callable[[int], tuple[nn.Module, dict[str, Any]]]
    source: str = "transformers"
    notes: str = ""
    loss: Callable[[Any], torch.Tensor] | None = None  # default: :func:`loss_of`

    def loss_of(self, output: Any) -> torch.Tensor:
        return (self.loss or loss_of)(output)


def loss_of(output: Any) -> torch.Tensor:
    """A scalar from a model's output: its ``loss`` when it has one, else the mean of
    every floating tensor in it."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor):
        return output.float().square().mean()
    values = (
        output.values()
        if isinstance(output, dict)
        else (output.to_tuple() if hasattr(output, "to_tuple") else output)
    )
    tensors = [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if not tensors:
        raise TypeError(f"no loss and no floating tensor in the output ({type(output).__name__})")
    return sum(t.float().square().mean() for t in tensors)


def _drop_rate(m: nn.Module) -> str | None:
    """The rate attribute of a stochastic-depth module (torchvision's ``StochasticDepth``,
    timm's ``DropPath`` and ``DropBlock2d``, transformers' ``*DropPath``), else ``None``."""
    name = type(m).__name__
    if name == "StochasticDepth":
        return "p"
    if name.endswith(("DropPath", "DropBlock2d")) and isinstance(
        getattr(m, "drop_prob", None), float
    ):
        return "drop_prob"
    return None


def stochastic_depth(model: nn.Module) -> bool:
    """Whether some stochastic-depth module of ``model`` drops with a rate above 0."""
    return any((attr := _drop_rate(m)) and getattr(m, attr) > 0 for m in model.modules())


def without_randomness(model: nn.Module) -> nn.Module:
    """``model`` with dropout and stochastic depth off, so that a training step is
    deterministic and comparable with eager (torchvision's and timm's compiled stochastic
    depth draw their masks from another random stream; the blocks share one subgraph
    either way: tests/unit/test_stochastic_depth.py)."""
    for m in model.modules():
        if isinstance(m, dropout_base()):
            m.p = 0.0
        elif (attr := _drop_rate(m)) is not None:
            setattr(m, attr, 0.0)
    return model


def hf_family(
    model_type: str,
    kind: str,
    *,
    auto: str = "AutoModelForCausalLM",
    seq: int = 12,
    notes: str = "",
    inputs: Callable | None = None,
    name: str | None = None,
    **overrides: Any,
) -> Family:
    """A ``transformers`` family (called ``name``, default ``model_type``): the ``auto``
    class built ``from_config`` on the tiny config; the batch is 2 random token sequences
    of length ``seq`` that are also the labels (or what ``inputs(config, generator)``
    returns)."""

    def build(seed: int):
        import transformers

        torch.manual_seed(seed)
        config = hf_config(model_type, **overrides)
        model = without_randomness(
            getattr(transformers, auto).from_config(config, attn_implementation="eager")
        )
        g = torch.Generator().manual_seed(seed + 1)
        if inputs is not None:
            batch = inputs(config, g)
        else:
            vocab = text_config(config).vocab_size  # a multimodal model's text tower
            ids = torch.randint(0, vocab, (2, seq), generator=g)
            batch = {"input_ids": ids, "labels": ids}
        return model, batch

    return Family(name or model_type, kind, build, "transformers", notes)


def _with_cache(model_type: str, kind: str, **overrides: Any) -> Family:
    """``model_type`` as users call it in training: ``model(input_ids=ids, labels=ids)``
    with the config's default ``use_cache=True`` (the other rows build with
    ``use_cache=False``), 16 tokens past a sliding window of 8 where it has one."""
    return hf_family(
        model_type,
        f"{kind}, default cache (use_cache=True)",
        seq=16,
        name=f"{model_type}+cache",
        use_cache=True,
        **overrides,
    )


def torchvision_family(
    name: str,
    kind: str,
    *,
    size: int = 32,
    batch: int = 2,
    notes: str = "",
    ctor: str | None = None,
    **kwargs: Any,
) -> Family:
    """A ``torchvision.models`` constructor (``ctor``, default ``name``) with random weights
    and 10 classes; the batch is ``batch`` random images of ``size`` pixels square (a
    BatchNorm network gets 4 of 64: over 2 images of 32 its last BatchNorms normalize 2
    values, and a rounding difference grows by orders of magnitude, whole-model compile's
    too)."""

    def build(seed: int):
        import torchvision

        torch.manual_seed(seed)
        model = without_randomness(
            getattr(torchvision.models, ctor or name)(num_classes=10, **kwargs)
        )
        g = torch.Generator().manual_seed(seed + 1)
        return model, {"x": torch.randn(batch, 3, size, size, generator=g)}

    return Family(name, kind, build, "torchvision", notes, loss=classification_loss)


def classification_loss(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of image-classification logits on fixed labels (a tuple: summed)."""
    if isinstance(logits, tuple | list):  # a distilled model trains on (class, distillation)
        return sum(classification_loss(t) for t in logits)
    labels = torch.arange(logits.shape[0]) % logits.shape[-1]
    return nn.functional.cross_entropy(logits, labels)


def _seq2seq(config, g):
    ids = torch.randint(0, config.vocab_size, (2, 10), generator=g)
    return {"input_ids": ids, "labels": ids}


def _masked(config, g):
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=g)
    return {"input_ids": ids, "labels": ids}


def _speech(config, g):
    feats = torch.randn(2, config.num_mel_bins, 2 * config.max_source_positions, generator=g)
    labels = torch.randint(0, config.vocab_size, (2, 8), generator=g)
    return {"input_features": feats, "labels": labels}


FAMILIES: tuple[Family, ...] = (
    hf_family("llama", "dense decoder"),
    hf_family("mistral", "dense decoder, sliding window", sliding_window=8),
    hf_family("qwen2", "dense decoder, QKV bias"),
    hf_family("qwen3", "dense decoder, QK norm"),
    hf_family("gemma", "dense decoder, GeGLU"),
    hf_family("gemma2", "dense decoder, local/global, soft-capping", sliding_window=8),
    hf_family("phi3", "dense decoder, fused QKV"),
    hf_family("olmo2", "dense decoder, post-norm"),
    hf_family("granite", "dense decoder, scaled residuals"),
    hf_family("gpt2", "dense decoder, learned positions"),
    hf_family("gpt_neox", "dense decoder, parallel residual"),
    hf_family("mixtral", "MoE decoder"),
    hf_family("qwen3_moe", "MoE decoder", decoder_sparse_step=1, mlp_only_layers=[]),
    hf_family(
        "deepseek_v3",
        "MLA + MoE decoder",
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        head_dim=8,
        qk_head_dim=16,
        num_key_value_heads=4,
        first_k_dense_replace=0,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
    ),
    hf_family(
        "jamba",
        "hybrid attention/Mamba, MoE",
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        use_mamba_kernels=False,
        mamba_d_state=8,
        mamba_dt_rank=8,
    ),
    # both cache settings: a sliding-window family called as users call it
    _with_cache("llama", "dense decoder"),
    _with_cache("mistral", "dense decoder, sliding window", sliding_window=8),
    _with_cache("phi3", "dense decoder, fused QKV", sliding_window=8),
    _with_cache(
        "qwen3_moe",
        "MoE decoder",
        decoder_sparse_step=1,
        mlp_only_layers=[],
        sliding_window=8,
        use_sliding_window=True,
    ),
    hf_family("bert", "encoder", auto="AutoModelForMaskedLM", inputs=_masked),
    hf_family(
        "t5",
        "encoder-decoder",
        auto="AutoModelForSeq2SeqLM",
        inputs=_seq2seq,
        num_heads=4,
        relative_attention_num_buckets=8,
    ),
    hf_family(
        "whisper",
        "speech encoder-decoder",
        auto="AutoModelForSpeechSeq2Seq",
        inputs=_speech,
        num_mel_bins=16,
        max_source_positions=16,
    ),
    torchvision_family("resnet18", "CNN", size=64, batch=4),
    torchvision_family("efficientnet_b0", "CNN, squeeze-excitation, BatchNorm", size=64, batch=4),
    torchvision_family("convnext_tiny", "CNN, stochastic depth"),
    torchvision_family("swin_t", "windowed vision transformer", size=64),
    torchvision_family(
        "vit",
        "vision transformer",
        ctor="VisionTransformer",
        size=32,
        image_size=32,
        patch_size=8,
        num_layers=3,
        num_heads=4,
        hidden_dim=64,
        mlp_dim=128,
    ),
)


def family(name: str) -> Family:
    """The family called ``name`` in :data:`FAMILIES`; an error lists the names."""
    for f in FAMILIES:
        if f.name == name:
            return f
    names = ", ".join(f.name for f in FAMILIES)
    raise KeyError(f"no model family {name!r}; the families are: {names}")


def causal_lm_types() -> list[str]:
    """Every model type of the installed ``transformers``' causal-LM auto mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
