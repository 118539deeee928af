"""Float8 training with torchao: conversion with a module filter, and the scale precompute.

Conversion swaps eligible ``nn.Linear`` layers for torchao's ``Float8Linear``. It must
run before regions are found (the signature sees the new classes) and before
``fully_shard`` (with float8 all-gather the sharded weights become torchao's
``WeightWithDynamicFloat8CastTensor`` subclass, which FSDP2 must see when it shards).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import sys

import torch
from torch import nn

from aotdist._compat.distributed import is_fake
from aotdist._compat.extras import require
from aotdist.config import Float8Config
from aotdist.errors import ConfigError, RegionCompileWarning
from aotdist.log import rank_zero_warn

__all__ = [
    "convert_to_float8",
    "float8_linears",
    "precompute_float8_scales",
    "uses_fsdp_float8_all_gather",
]

# torch._scaled_mm needs both dims of the weight to be multiples of 16.
_ALIGN = 16


def _eligible(module: nn.Module, fqn: str, exclude: tuple[str, ...]) -> bool:
    if type(module) is not nn.Linear:  # subclasses (already Float8Linear, LoRA...) stay
        return False
    if any(fnmatch.fnmatchcase(fqn, pattern) for pattern in exclude):
        return False
    return module.in_features % _ALIGN == 0 and module.out_features % _ALIGN == 0


def convert_to_float8(model: nn.Module, config: Float8Config) -> list[str]:
    """Swaps ``model``'s eligible ``nn.Linear`` layers for torchao ``Float8Linear``.

    Eligible: exactly ``nn.Linear``, both dims multiples of 16, FQN not matched by
    ``config.exclude``.

    Returns:
        The FQNs of the converted layers.

    Raises:
        ConfigError: A ``config.exclude`` pattern matches no ``Linear`` layer, no
            layer is eligible (float8 would do nothing), or ``config.recipe`` cannot run
            on the model's device (no float8 matmul there, or no row-wise scaling).
    """
    ao = require("torchao.float8", feature="float8.enabled (torchao Float8 training)")

    linears = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    unknown = [p for p in config.exclude if not any(fnmatch.fnmatchcase(f, p) for f in linears)]
    if unknown:
        raise ConfigError(
            f"float8.exclude: patterns {unknown} match no Linear layer of "
            f"{type(model).__name__}; Linear layers are e.g. {linears[:6]}. Fix the patterns."
        )
    chosen = [fqn for fqn, m in model.named_modules() if _eligible(m, fqn, config.exclude)]
    if not chosen:
        raise ConfigError(
            f"float8.enabled: no Linear layer of {type(model).__name__} can run in float8 "
            f"(needs in/out features that are multiples of {_ALIGN}, not excluded; Linear "
            f"layers: {linears[:6]}). Fix: set float8.enabled: false."
        )
    ao_config = ao.Float8LinearConfig.from_recipe_name(config.recipe)
    first = model.get_submodule(chosen[0]).weight
    if not is_fake(first):  # aotdist plan: nothing runs, nothing to probe
        _check_recipe_runs(ao, ao_config, config.recipe, first.device, first.dtype)
    if config.fsdp_all_gather:
        ao_config = dataclasses.replace(ao_config, enable_fsdp_float8_all_gather=True)
    chosen_set = set(chosen)
    ao.convert_to_float8_training(
        model, config=ao_config, module_filter_fn=lambda _m, fqn: fqn in chosen_set
    )
    return chosen


def _check_recipe_runs(
    ao, ao_config, recipe: str, device: torch.device, dtype: torch.dtype
) -> None:
    """Runs one tiny ``Float8Linear`` of ``recipe`` forward and backward on ``device``.

    Every recipe needs ``torch._scaled_mm``: CUDA GPUs of compute capability >= 8.9; on
    CPU, torch emulates it, or calls oneDNN where the CPU reports AMX, and oneDNN fails
    when ``ONEDNN_MAX_CPU_ISA`` caps it below AMX ("could not create a primitive
    descriptor for the matmul primitive"). Row-wise scaling also needs per-row scales,
    which some CPU torch versions lack (2.15 has them, 2.11 fails with an internal assert
    "only supports per-tensor scaling for CPU backend"). Probing torchao's own layer finds
    that out at ``parallelize`` instead of at the first training step. Not probed: meta
    tensors, and a CPU model on a machine with a GPU (it most likely trains there).

    Raises:
        ConfigError: The recipe cannot run on ``device``; names the cause and the fix.
    """
    if device.type == "meta":
        return
    if device.type == "cpu" and torch.cuda.is_available():
        return  # a CPU model on a GPU machine is most likely moved to the GPU to train
    probe = nn.Sequential(nn.Linear(16, 16, bias=False)).to(device=device, dtype=dtype)
    ao.convert_to_float8_training(probe, config=ao_config)
    try:
        with torch.enable_grad():
            probe(torch.ones(16, 16, device=device, dtype=dtype)).sum().backward()
    except (RuntimeError, NotImplementedError, AssertionError) as exc:
        cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if recipe != "tensorwise":
            fix = (
                "set float8.recipe: tensorwise, or train on a CUDA GPU of compute "
                "capability >= 8.9 (row-wise scaled matmul)"
            )
        elif device.type == "cpu" and os.environ.get("ONEDNN_MAX_CPU_ISA"):
            fix = (
                f"torch's CPU float8 matmul runs in oneDNN on this AMX CPU, and "
                f"ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']} caps oneDNN below "
                "AMX: unset it (or set AVX512_CORE_AMX), or set float8.enabled: false"
            )
        elif device.type == "cpu":
            fix = "set float8.enabled: false on this machine, or train on a CUDA GPU"
        else:
            fix = (
                "train on a GPU with float8 matmuls (CUDA compute capability >= 8.9), or "
                "set float8.enabled: false"
            )
        raise ConfigError(
            f"float8.recipe: {recipe!r} cannot run on {device} with torch {torch.__version__}"
            f" (torchao's Float8Linear fails: {cause}). Fix: {fix}."
        ) from exc


def float8_linears(model: nn.Module) -> list[nn.Module]:
    """Every torchao ``Float8Linear`` in ``model`` (empty when torchao was never used)."""
    linear = sys.modules.get("torchao.float8.float8_linear")
    if linear is None:  # never imported, so no Float8Linear exists: torchao stays unloaded
        return []
    return [m for m in model.modules() if isinstance(m, linear.Float8Linear)]


def uses_fsdp_float8_all_gather(model: nn.Module) -> bool:
    """Whether ``model`` has Float8 weights that FSDP2 all-gathers in float8."""
    from torch.distributed.tensor import DTensor

    for m in float8_linears(model):
        w = m.weight
        if m.config.enable_fsdp_float8_all_gather and isinstance(w, DTensor):
            return True
    return False


def warn_unverified_combination(config, *, stacklevel: int = 3) -> None:
    """Warns when ``config`` asks for Inductor + FSDP2 float8 all-gather, where aotdist's
    parity test sees a drift from the same Float8 model in eager: Inductor's, the same with
    the all-gather off and under ``torch.compile`` of the whole model (the measurements:
    docs/guide/limits.md)."""
    if (
        config.float8.enabled
        and config.float8.fsdp_all_gather
        and config.fsdp.enabled
        and config.compile.enabled
        and config.compile.backend == "inductor"
    ):
        rank_zero_warn(
            "float8.fsdp_all_gather with compile.backend: inductor: aotdist's parity test "
            "sees parameters drift from eager Float8 by up to 1.5e-3 after 5 SGD steps on "
            f"CPU (torch 2.11 and 2.14; you run {torch.__version__}). The all-gather is not "
            "the cause: with it off, and under torch.compile of the whole model, the drift "
            "is the same; Inductor's kernels round in the last bits unlike eager's and "
            "Float8's 3-bit rounding carries it (docs/guide/limits.md). Fix, if you need "
            "eager-exact Float8: compile.backend: aot_eager; keeping the all-gather costs "
            "nothing more.",
            RegionCompileWarning,
            stacklevel=stacklevel,
        )


@torch.no_grad()
def precompute_float8_scales(model: nn.Module) -> bool:
    """Precomputes the float8 weight scales for FSDP2 float8 all-gather.

    Call after each ``optimizer.step()``: one all-reduce computes every weight's scale
    for the next all-gather. A no-op (returns ``False``) when the model has no
    float8 all-gather weights, so it is safe to call unconditionally.

    Returns:
        Whether scales were computed.
    """
    if not uses_fsdp_float8_all_gather(model):
        return False
    ao = require("torchao.float8", feature="precompute_float8_scales")
    ao.precompute_float8_dynamic_scale_for_fsdp(model)
    return True
