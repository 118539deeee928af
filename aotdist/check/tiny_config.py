"""Tiny ``transformers`` configs: any model type shrunk to a few layers of width 64.

:func:`hf_config` builds ``AutoConfig.for_model(model_type)`` with the :data:`TINY` sizes a
config has, made again from them so that the sizes it derives agree, then repairs the
sizes that must agree with the tiny ones (multi-head latent attention, Mamba heads, expert
groups) in it and in every config nested in it (a multimodal model's towers). Dropout is
off and special token ids fall inside the shrunk vocabulary, so one training step is
deterministic and builds offline.
"""

from __future__ import annotations

import contextlib
from typing import Any

# Config attributes that set the size of a transformers model, and their tiny values.
# Only those a config has are set; a family's own overrides come after.
TINY = {
    "hidden_size": 64,
    "d_model": 64,
    "n_embd": 64,
    "dim": 64,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "d_ff": 128,
    "n_inner": 128,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "num_hidden_layers": 3,
    "n_layer": 3,
    "num_layers": 3,
    "n_layers": 3,
    "encoder_layers": 3,
    "decoder_layers": 3,
    "num_decoder_layers": 3,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "d_kv": 16,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "max_source_positions": 64,
    "max_target_positions": 64,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "use_cache": False,
    "tie_word_embeddings": False,
    "vocab_size_per_layer_input": 256,
    "hidden_size_per_layer_input": 16,  # Gemma 3n/4
    "hidden_size_global": 64,
    "encoder_hash_byte_group_vocab": 256,  # BLT
}


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
            if (
                isinstance(value, float)
                and ("dropout" in key or "pdrop" in key)
                and (key not in overrides)
            ):
                setattr(cfg, key, 0.0)
    # Special token ids past the shrunk vocabulary (or missing) become 0, 1, 2.
    text = text_config(config)
    for cfg in (config,) if text is config else (config, text):
        for i, key in enumerate(
            ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
        ):
            value = getattr(cfg, key, None)
            if (
                key not in overrides
                and (value is None or isinstance(value, int))
                and (value is None or value >= text.vocab_size)
            ):
                setattr(cfg, key, min(i, 2))
    return config


def text_config(config):
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
        if (
            (key.endswith("layer_types") or key == "layers_block_type")
            and isinstance(kinds, list)
            and layers
            and len(kinds) != layers
        ):
            missing = [k for k in dict.fromkeys(kinds) if k not in kinds[:layers]][: layers - 1]
            lists[key] = kinds[: layers - len(missing)] + missing
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
        for key, value in (
            ("q_lora_rank", 32),
            ("kv_lora_rank", 16),
            ("qk_rope_head_dim", 8),
            ("qk_nope_head_dim", 8),
            ("v_head_dim", 16),
            ("qk_head_dim", 16),
            ("head_dim", 8),
            ("index_head_dim", 16),
            ("index_n_heads", 4),
        ):
            put(key, value)
        put("num_key_value_heads", getattr(config, "num_attention_heads", None))
    put("rotary_dim", 8)
    put("n_group", 1)  # expert groups for the group-limited top-k: 4 experts make one group
    put("topk_group", 1)
    if getattr(config, "n_shared_experts", 0) is None and "n_shared_experts" not in overrides:
        config.n_shared_experts = 1  # Dots1's default, None, builds no shared expert
    if config.model_type == "lfm2_moe" and config.layer_types is None:  # its checkpoints name them
        config.layer_types = [
            ("conv", "full_attention")[i % 2] for i in range(config.num_hidden_layers)
        ]
    if isinstance(width, int):
        for heads, head_dim, expand in (
            ("num_heads", "head_dim", "expand"),
            ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
            ("n_mamba_heads", "mamba_headdim", "mamba_expand"),
        ):
            if getattr(config, expand, None) and getattr(config, heads, None):
                put(head_dim, 16)
                put(heads, getattr(config, expand) * width // 16)
                put("mamba_d_ssm", getattr(config, expand) * width)  # Falcon-H1's own width
        put("attention_head_dim", 2 * width // 4)  # Zamba2: attention over [h, embeddings]
        put("adapter_rank", 8)
        put("linear_num_heads", 4)
        put("linear_head_dim", 16)
        put("mamba_d_state", 16)
