"""The model families ``aotdist zoo`` checks: tiny random-weight builds, offline.

Each :class:`Family` builds a model and one batch from a config alone (``transformers``'
``AutoConfig.for_model`` shrunk to a few layers of width 64, a ``torchvision``
constructor, ``timm.create_model`` with stochastic depth on and a small input where the
architecture takes one, or torchtitan's own model code at a tiny size): no weights or
datasets are downloaded.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from aotdist.errors import first_line

__all__ = ["FAMILIES", "TIMM_MODELS", "TITAN_MODELS", "Family", "causal_lm_types", "family",
           "hf_family", "stochastic_depth", "timm_family", "titan_family", "titan_unavailable",
           "torchvision_family",
           "without_randomness"]

# Config attributes that set the size of a transformers model, and their tiny values.
# Only those a config has are set; a family's own overrides come after.
TINY = {
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "dim": 64,
    "intermediate_size": 128, "ffn_dim": 128, "d_ff": 128, "n_inner": 128,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "num_hidden_layers": 3, "n_layer": 3, "num_layers": 3, "n_layers": 3,
    "encoder_layers": 3, "decoder_layers": 3, "num_decoder_layers": 3,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "d_kv": 16,
    "vocab_size": 256, "max_position_embeddings": 128, "n_positions": 128,
    "max_source_positions": 64, "max_target_positions": 64,
    "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "use_cache": False, "tie_word_embeddings": False,
    "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 16,  # Gemma 3n/4
    "hidden_size_global": 64, "encoder_hash_byte_group_vocab": 256,  # BLT
}


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
    values = output.values() if isinstance(output, dict) else (
        output.to_tuple() if hasattr(output, "to_tuple") else output)
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
            getattr(m, "drop_prob", None), float):
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
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        elif (attr := _drop_rate(m)) is not None:
            setattr(m, attr, 0.0)
    return model


def hf_config(model_type: str, **overrides: Any):
    """``AutoConfig.for_model(model_type)`` with :data:`TINY` sizes and ``overrides``; the
    configs nested in it (a multimodal model's towers) take the :data:`TINY` sizes."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type)
    sizes = {k: v for k, v in {**TINY, **overrides}.items() if k in overrides or _has(config, k)}
    # Made again from the tiny sizes, so that the sizes it derives from them agree (Zamba's
    # attention width), with its layer lists cut where it checks their length; a config that
    # refuses them (Falcon's read-only head_dim, a check _consistent would satisfy) is the
    # default one, its sizes set one by one.
    for made in (sizes, {**_layer_lists(config, sizes.get("num_hidden_layers")), **sizes}):
        try:
            config = transformers.AutoConfig.for_model(model_type, **made)
            break
        except Exception:  # noqa: BLE001 - a config's own checks raise what they like
            pass
    for key, value in {**TINY, **overrides}.items():
        if key in overrides or _has(config, key):
            try:
                setattr(config, key, value)
            except AttributeError:  # a derived, read-only size (Falcon's head_dim)
                if key in overrides:
                    raise
    _consistent(config, overrides)
    for sub in _sub_configs(config):  # a multimodal model's text and vision towers, BLT's
        for key, value in TINY.items():
            if _has(sub, key):
                with contextlib.suppress(AttributeError):
                    setattr(sub, key, value)
        _consistent(sub, {})
    for cfg in (config, *_sub_configs(config)):  # dropout off: the step is deterministic
        for key, value in cfg.to_dict().items():
            if isinstance(value, float) and ("dropout" in key or "pdrop" in key) and (
                    key not in overrides):
                setattr(cfg, key, 0.0)
    # Special token ids past the shrunk vocabulary (or missing) become 0, 1, 2.
    text = _text_config(config)
    for cfg in (config,) if text is config else (config, text):
        for i, key in enumerate(("pad_token_id", "bos_token_id", "eos_token_id",
                                 "decoder_start_token_id")):
            value = getattr(cfg, key, None)
            if key not in overrides and (value is None or isinstance(value, int)) and (
                    value is None or value >= text.vocab_size):
                setattr(cfg, key, min(i, 2))
    return config


def _text_config(config):
    """The config of ``config``'s text model (itself for a text-only model; itself too
    where several are text models, as MusicGen's encoder and decoder)."""
    try:
        return config.get_text_config()
    except ValueError:
        return config


def _sub_configs(config) -> list:
    """The configs nested in ``config`` (``text_config``, ``vision_config``, BLT's
    encoder/decoder/global configs), at any depth, each once."""
    import transformers

    found, todo = {}, [config]
    while todo:
        for value in vars(todo.pop()).values():
            if isinstance(value, transformers.PretrainedConfig) and id(value) not in found:
                found[id(value)] = value
                todo.append(value)
    return list(found.values())


def _has(config, key: str) -> bool:
    try:
        return hasattr(config, key)
    except Exception:  # noqa: BLE001 - a per-layer size refuses a global read (Gemma 4's head_dim)
        return True


def _layer_lists(config, layers: int | None) -> dict[str, list]:
    """The config's per-layer kind lists (``layer_types``, Zamba-2's ``layers_block_type``) cut
    to ``layers``, the last layers taking the kinds the first ones lack."""
    lists = {}
    for key, kinds in config.to_dict().items():
        if (key.endswith("layer_types") or key == "layers_block_type") and isinstance(
                kinds, list) and layers and len(kinds) != layers:
            missing = [k for k in dict.fromkeys(kinds) if k not in kinds[:layers]][:layers - 1]
            lists[key] = kinds[:layers - len(missing)] + missing
    return lists


def _consistent(config, overrides: dict[str, Any]) -> None:
    """Sizes that must agree with the tiny ones :data:`TINY` set: MLA's rank and rotary
    head sizes (and its key/value heads, one per query head), a partial rotary dimension,
    one group of experts, Mamba-2 heads that fill the expanded width, and what a default
    config leaves out (Dots1's shared experts, LFM2-MoE's layer kinds)."""
    width = getattr(config, "hidden_size", None)

    def put(key: str, value: Any) -> None:
        if key not in overrides and getattr(config, key, None) is not None:
            setattr(config, key, value)

    if getattr(config, "qk_rope_head_dim", None) is not None:  # multi-head latent attention
        for key, value in (("q_lora_rank", 32), ("kv_lora_rank", 16), ("qk_rope_head_dim", 8),
                           ("qk_nope_head_dim", 8), ("v_head_dim", 16), ("qk_head_dim", 16),
                           ("head_dim", 8), ("index_head_dim", 16), ("index_n_heads", 4)):
            put(key, value)
        put("num_key_value_heads", getattr(config, "num_attention_heads", None))
    put("rotary_dim", 8)
    put("n_group", 1)  # expert groups for the group-limited top-k: 4 experts make one group
    put("topk_group", 1)
    if getattr(config, "n_shared_experts", 0) is None and "n_shared_experts" not in overrides:
        config.n_shared_experts = 1  # Dots1's default, None, builds no shared expert
    if config.model_type == "lfm2_moe" and config.layer_types is None:  # its checkpoints name them
        config.layer_types = [("conv", "full_attention")[i % 2]
                              for i in range(config.num_hidden_layers)]
    if isinstance(width, int):
        for heads, head_dim, expand in (("num_heads", "head_dim", "expand"),
                                        ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
                                        ("n_mamba_heads", "mamba_headdim", "mamba_expand")):
            if getattr(config, expand, None) and getattr(config, heads, None):
                put(head_dim, 16)
                put(heads, getattr(config, expand) * width // 16)
                put("mamba_d_ssm", getattr(config, expand) * width)  # Falcon-H1's own width
        put("attention_head_dim", 2 * width // 4)  # Zamba2: attention over [h, embeddings]
        put("adapter_rank", 8)
        put("linear_num_heads", 4)
        put("linear_head_dim", 16)
        put("mamba_d_state", 16)


def hf_family(model_type: str, kind: str, *, auto: str = "AutoModelForCausalLM",
              seq: int = 12, notes: str = "", inputs: Callable | None = None,
              name: str | None = None, **overrides: Any) -> Family:
    """A ``transformers`` family (called ``name``, default ``model_type``): the ``auto``
    class built ``from_config`` on the tiny config; the batch is 2 random token sequences
    of length ``seq`` that are also the labels (or what ``inputs(config, generator)``
    returns)."""

    def build(seed: int):
        import transformers

        torch.manual_seed(seed)
        config = hf_config(model_type, **overrides)
        model = without_randomness(
            getattr(transformers, auto).from_config(config, attn_implementation="eager"))
        g = torch.Generator().manual_seed(seed + 1)
        if inputs is not None:
            batch = inputs(config, g)
        else:
            vocab = _text_config(config).vocab_size  # a multimodal model's text tower
            ids = torch.randint(0, vocab, (2, seq), generator=g)
            batch = {"input_ids": ids, "labels": ids}
        return model, batch

    return Family(name or model_type, kind, build, "transformers", notes)


def _with_cache(model_type: str, kind: str, **overrides: Any) -> Family:
    """``model_type`` as users call it in training: ``model(input_ids=ids, labels=ids)``
    with the config's default ``use_cache=True`` (the other rows build with
    ``use_cache=False``), 16 tokens past a sliding window of 8 where it has one."""
    return hf_family(model_type, f"{kind}, default cache (use_cache=True)", seq=16,
                     name=f"{model_type}+cache", use_cache=True, **overrides)


def torchvision_family(name: str, kind: str, *, size: int = 32, batch: int = 2,
                       notes: str = "", ctor: str | None = None, **kwargs: Any) -> Family:
    """A ``torchvision.models`` constructor (``ctor``, default ``name``) with random weights
    and 10 classes; the batch is ``batch`` random images of ``size`` pixels square (a
    BatchNorm network gets 4 of 64: over 2 images of 32 its last BatchNorms normalize 2
    values, and a rounding difference grows by orders of magnitude, whole-model compile's
    too)."""

    def build(seed: int):
        import torchvision

        torch.manual_seed(seed)
        model = without_randomness(
            getattr(torchvision.models, ctor or name)(num_classes=10, **kwargs))
        g = torch.Generator().manual_seed(seed + 1)
        return model, {"x": torch.randn(batch, 3, size, size, generator=g)}

    return Family(name, kind, build, "torchvision", notes, loss=_classification_loss)


def _classification_loss(logits: torch.Tensor) -> torch.Tensor:
    if isinstance(logits, tuple | list):  # a distilled model trains on (class, distillation)
        return sum(_classification_loss(t) for t in logits)
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
    hf_family("deepseek_v3", "MLA + MoE decoder", q_lora_rank=32, kv_lora_rank=16,
              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
              qk_head_dim=16, num_key_value_heads=4, first_k_dense_replace=0,
              n_group=1, topk_group=1, n_shared_experts=1),
    hf_family("jamba", "hybrid attention/Mamba, MoE", num_hidden_layers=4,
              attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
              expert_layer_offset=1, use_mamba_kernels=False, mamba_d_state=8,
              mamba_dt_rank=8),
    # both cache settings: a sliding-window family called as users call it
    _with_cache("llama", "dense decoder"),
    _with_cache("mistral", "dense decoder, sliding window", sliding_window=8),
    _with_cache("phi3", "dense decoder, fused QKV", sliding_window=8),
    _with_cache("qwen3_moe", "MoE decoder", decoder_sparse_step=1, mlp_only_layers=[],
                sliding_window=8, use_sliding_window=True),
    hf_family("bert", "encoder", auto="AutoModelForMaskedLM", inputs=_masked),
    hf_family("t5", "encoder-decoder", auto="AutoModelForSeq2SeqLM", inputs=_seq2seq,
              num_heads=4, relative_attention_num_buckets=8),
    hf_family("whisper", "speech encoder-decoder", auto="AutoModelForSpeechSeq2Seq",
              inputs=_speech, num_mel_bins=16, max_source_positions=16),
    torchvision_family("resnet18", "CNN", size=64, batch=4),
    torchvision_family("efficientnet_b0", "CNN, squeeze-excitation, BatchNorm", size=64,
                       batch=4),
    torchvision_family("convnext_tiny", "CNN, stochastic depth"),
    torchvision_family("swin_t", "windowed vision transformer", size=64),
    torchvision_family("vit", "vision transformer", ctor="VisionTransformer", size=32,
                       image_size=32, patch_size=8, num_layers=3, num_heads=4, hidden_dim=64, mlp_dim=128),
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


def timm_family(arch: str, kind: str = "timm model", *, size: int | None = None,
                batch: int = 2, img_size: bool = True, notes: str = "",
                **kwargs: Any) -> Family:
    """A ``timm.create_model(arch)`` with random weights, 10 classes and stochastic depth
    on (``drop_path_rate=0.1``, timm's usual training setting, where the architecture has
    it), in train mode; ``kwargs``
    shrink it where timm takes them (``depth``, ``embed_dim``). The batch is ``batch``
    random images of ``size`` pixels square, passed as ``img_size`` where the
    architecture takes one (``img_size``), else its default input size."""

    def build(seed: int):
        import timm

        torch.manual_seed(seed)
        args = {"pretrained": False, "num_classes": 10, "drop_path_rate": 0.1, **kwargs}
        if size is not None and img_size:
            args["img_size"] = size
        try:
            model = timm.create_model(arch, **args)
        except TypeError as exc:  # an architecture without stochastic depth (GhostNet)
            if "drop_path_rate" not in str(exc):
                raise
            del args["drop_path_rate"]
            model = timm.create_model(arch, **args)
        model.train()
        shape = (3, size, size) if size is not None else tuple(
            model.pretrained_cfg.get("input_size", (3, 224, 224)))
        g = torch.Generator().manual_seed(seed + 1)
        return model, {"x": torch.randn(batch, *shape, generator=g)}

    return Family(arch, kind, build, "timm", notes, loss=_classification_loss)


# timm's families, each at the smallest size it builds at: a transformer at 64 pixels (its
# own img_size, fewer blocks where it takes depth), a BatchNorm network on 4 images of 64.
_VIT = {"size": 64, "depth": 4}
_CNN = {"size": 64, "batch": 4, "img_size": False}
TIMM_MODELS: tuple[Family, ...] = (
    timm_family("vit_tiny_patch16_224", "ViT", **_VIT),
    timm_family("vit_small_patch16_224", "ViT", **_VIT),
    timm_family("vit_relpos_small_patch16_224", "ViT, relative positions", **_VIT),
    timm_family("deit_tiny_patch16_224", "DeiT", **_VIT),
    timm_family("deit_tiny_distilled_patch16_224", "DeiT, distillation token", **_VIT),
    timm_family("deit3_small_patch16_224", "DeiT III, layer scale", **_VIT),
    timm_family("beit_base_patch16_224", "BEiT", embed_dim=192, num_heads=3, **_VIT),
    timm_family("beitv2_base_patch16_224", "BEiT v2", embed_dim=192, num_heads=3, **_VIT),
    timm_family("eva02_tiny_patch14_224", "EVA-02, rotary, SwiGLU", size=56, depth=4),
    timm_family("flexivit_small", "FlexiViT", size=64, depth=4),
    timm_family("cait_xxs24_224", "CaiT, class attention", **_VIT),
    timm_family("xcit_nano_12_p16_224", "XCiT, cross-covariance attention", **_VIT),
    timm_family("pit_ti_224", "PiT, pooling", size=64),
    timm_family("convit_tiny", "ConViT, gated positional attention", **_VIT),
    timm_family("swin_tiny_patch4_window7_224", "Swin", size=64, window_size=2),
    timm_family("swinv2_tiny_window8_256", "Swin v2", size=64, window_size=2),
    timm_family("levit_128s", "LeViT, attention with BatchNorm", size=64, batch=4),
    timm_family("levit_conv_128s", "LeViT, convolutional", size=64, batch=4),
    timm_family("pvt_v2_b0", "PVT-v2, spatial-reduction attention", size=64, img_size=False),
    timm_family("twins_svt_small", "Twins, local/global attention", size=64),
    timm_family("maxvit_nano_rw_256", "MaxViT, BatchNormAct2d", size=64, batch=4),
    timm_family("maxvit_rmlp_pico_rw_256", "MaxViT, relative-position MLP", size=64, batch=4),
    timm_family("coatnet_nano_rw_224", "CoAtNet, BatchNormAct2d", size=64, batch=4),
    timm_family("coatnet_0_rw_224", "CoAtNet, BatchNormAct2d", size=64, batch=4),
    timm_family("fastvit_t8", "FastViT, reparameterizable", **_CNN),
    timm_family("mobilevit_xxs", "MobileViT, BatchNormAct2d", **_CNN),
    timm_family("mobilevitv2_050", "MobileViT v2", **_CNN),
    timm_family("convnext_atto", "ConvNeXt", **_CNN),
    timm_family("convnextv2_atto", "ConvNeXt v2, GRN", **_CNN),
    timm_family("poolformer_s12", "PoolFormer (MetaFormer)", **_CNN),
    timm_family("poolformerv2_s12", "PoolFormer v2 (MetaFormer)", **_CNN),
    timm_family("edgenext_xx_small", "EdgeNeXt", **_CNN),
    timm_family("efficientformerv2_s0", "EfficientFormer v2", size=64, batch=4),
    timm_family("efficientnet_b0", "EfficientNet, BatchNormAct2d", **_CNN),
    timm_family("efficientnetv2_rw_t", "EfficientNet v2, BatchNormAct2d", **_CNN),
    timm_family("tf_efficientnet_lite0", "EfficientNet-Lite, same padding", **_CNN),
    timm_family("mixnet_s", "MixNet, mixed kernels", **_CNN),
    timm_family("mobilenetv3_small_050", "MobileNetV3, hard-swish", **_CNN),
    timm_family("mobilenetv3_large_100", "MobileNetV3", **_CNN),
    timm_family("regnetx_002", "RegNetX, BatchNormAct2d", **_CNN),
    timm_family("regnety_002", "RegNetY, squeeze-excitation", **_CNN),
    timm_family("resnet18", "ResNet", **_CNN),
    timm_family("resnet50d", "ResNet-D, bottleneck", **_CNN),
    timm_family("resnext26ts", "ResNeXt (ByobNet)", **_CNN),
    timm_family("ghostnet_100", "GhostNet", **_CNN),
    timm_family("repvgg_a0", "RepVGG", **_CNN),
    timm_family("mambaout_femto", "MambaOut, gated CNN", **_CNN),
    timm_family("inception_next_atto", "InceptionNeXt", **_CNN),
)


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
        config.layers = qwen3._build_qwen3_moe_layers(
            n_layers=3, dim=config.dim, n_heads=16, n_kv_heads=8, head_dim=16,
            moe_hidden_dim=64, num_experts=8, top_k=2, attn_backend="flex",
            moe_comm_backend="standard", rope=_rope(rope, 16))
    elif name == "deepseek_v3":
        from torchtitan.models import deepseek_v3

        config = deepseek_v3.model_registry("debugmodel", attn_backend="flex").model
        config.layers = config.layers[:4]
    else:
        raise ValueError(f"titan:{name}: torchtitan models checked here are "
                         f"{', '.join(TITAN_MODELS)}")
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def _rope(rope, head_dim: int):
    import dataclasses

    return dataclasses.replace(rope, dim=head_dim)


TITAN_MODELS = {"llama3": "dense decoder (Llama 3)", "qwen3": "dense decoder, QK norm (Qwen 3)",
                "qwen3_moe": "MoE decoder (Qwen 3 MoE)",
                "deepseek_v3": "MLA + MoE decoder (DeepSeek-V3)"}

# torchtitan 0.3's model code imports torch.distributed.fsdp.DataParallelMeshDims (torch 2.12)
TITAN_MIN_TORCH = "2.12"


def titan_unavailable(name: str = "llama3") -> str | None:
    """Why torchtitan's model code for ``name`` does not import here (``None``: it does)."""
    module = "qwen3" if name == "qwen3_moe" else name
    try:
        importlib.import_module(f"torchtitan.models.{module}")
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] == "torchtitan" and (
                "." not in exc.name):
            return ("torchtitan is not installed (pip install --no-deps torchtitan "
                    "spmd_types tyro)")
        return f"needs torchtitan's dependency {exc.name}: {first_line(exc)}"
    except ImportError as exc:  # its code uses torch.distributed APIs newer than this torch
        return (f"needs torch >= {TITAN_MIN_TORCH} (torchtitan's model code does not import "
                f"on torch {torch.__version__.split('+')[0]}: {first_line(exc)})")
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

    return Family(name, TITAN_MODELS.get(name, "torchtitan model"), build, "torchtitan",
                  loss=_next_token_loss)


def _next_token_loss(logits: torch.Tensor) -> torch.Tensor:
    labels = torch.arange(logits.shape[1]).expand(logits.shape[:2]) % logits.shape[-1]
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
