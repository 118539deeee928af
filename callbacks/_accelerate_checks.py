"""Checks and settings :func:`aotdist.callbacks.prepare` and
:func:`aotdist.callbacks.prepare_pipeline` share: Accelerate's own dynamo refused, its
mixed precision as FSDP2's policy, an optimizer that can be rebound."""

from __future__ import annotations

from typing import Any

import torch

from aotdist import _compat
from aotdist.config import AOTDistConfig
from aotdist.errors import ConfigError, OrderingError


def check_accelerate_dynamo(config: AOTDistConfig, state: Any = None) -> None:
    """Accelerate's ``dynamo_config`` would ``torch.compile`` the model on top of aotdist."""
    if not config.compile.enabled:
        return
    if state is None:
        from accelerate.state import AcceleratorState

        if not _compat.accelerator_state_initialized():  # no Accelerator: nothing to check
            return
        state = AcceleratorState()
    plugin = getattr(state, "dynamo_plugin", None)
    backend = getattr(getattr(plugin, "backend", None), "value", "NO")
    if str(backend).upper() != "NO":
        raise ConfigError(
            f"Accelerate's dynamo_config is on (dynamo_backend={backend}), so "
            "accelerator.prepare would torch.compile the whole model on top of aotdist's "
            "regional compile (and add `_orig_mod.` to its keys). Fix: set dynamo_backend: "
            "'no' in the Accelerate config (or ACCELERATE_DYNAMO_BACKEND=no); aotdist compiles."
        )


_ACCELERATE_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def accelerate_mixed_precision(cfg: AOTDistConfig, accelerator: Any) -> AOTDistConfig:
    """Accelerate's ``mixed_precision`` on aotdist's FSDP2 path, as FSDP2's
    ``MixedPrecisionPolicy`` (what Accelerate's own FSDP2 path does: parameters gathered
    and computed in the dtype, gradients reduced in it unless ``fsdp.reduce_dtype`` says
    otherwise). Needed because an aotdist-sharded model is marked prepared, so
    ``accelerator.prepare`` skips its autocast wrapper (without FSDP it still applies it).

    Raises:
        ConfigError: ``fsdp.param_dtype`` conflicts with it, or ``mixed_precision`` is
            ``fp8`` (Accelerate's own Float8, not aotdist's).
    """
    mp = str(getattr(accelerator, "mixed_precision", "no") or "no")
    if mp == "fp8" and (cfg.fsdp.enabled or cfg.float8.enabled):
        raise ConfigError(
            "Accelerate's mixed_precision is fp8, which would convert the model with "
            "Accelerate's own Float8 backend, next to aotdist's. Fix: set mixed_precision to "
            "bf16 (or no) in the Accelerate config and float8.enabled: true in the aotdist one."
        )
    dtype = _ACCELERATE_DTYPES.get(mp)
    if dtype is None or not cfg.fsdp.enabled:
        return cfg
    if cfg.fsdp.param_dtype not in (None, dtype):
        raise ConfigError(
            f"Accelerate's mixed_precision is {mp} but the aotdist config says "
            f"fsdp.param_dtype: {cfg.fsdp.param_dtype}. Fix: remove fsdp.param_dtype (aotdist "
            f"then computes in {dtype}), or set mixed_precision to match or to 'no'."
        )
    return cfg.replace(fsdp={"param_dtype": dtype, "reduce_dtype": cfg.fsdp.reduce_dtype or dtype})


def check_optimizer(optimizer: torch.optim.Optimizer, old_names: dict[int, str]) -> None:
    """Refuses, before the model changes, an optimizer that aotdist cannot rebind."""
    if optimizer.state:
        raise OrderingError(
            "the optimizer already has state (it stepped); aotdist.callbacks.prepare must run "
            "before training. Fix: call it before the first optimizer.step()."
        )
    if any(id(p) not in old_names for g in optimizer.param_groups for p in g["params"]):
        raise ConfigError(
            "an optimizer passed to aotdist.callbacks.prepare holds a parameter that is "
            "not the model's; build it from model.parameters()."
        )
