"""Accelerate's ``save_state``/``load_state`` for an FSDP2-sharded model: full, unsharded
state dicts (plain keys, loadable into an unsharded model), put back into the sharded one.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn


class _AlreadyLoaded:
    """Stands in for a model whose state a load hook restored itself: Accelerate's loader
    (``safetensors.torch.load_model``) compares keys and calls ``load_state_dict``."""

    def __init__(self, keys):
        self._keys = list(keys)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: torch.empty(0) for k in self._keys}  # keys only: the data went in already

    def load_state_dict(self, *args, **kwargs):
        return [], []  # (missing, unexpected): none


def full_state_checkpoints(
    accelerator: Any, model: nn.Module, optimizers: list[torch.optim.Optimizer]
) -> None:
    """``save_state``/``load_state`` of an FSDP2 model as full, unsharded state dicts."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def save_hook(models, weights, output_dir):
        for i, m in enumerate(models):
            if m is model:  # every rank takes part in the gather; the main process writes
                weights[i] = get_model_state_dict(model, options=options)

    def load_hook(models, input_dir):
        from accelerate.utils import load_state_dict as read_weights

        for i, m in enumerate(models):
            if m is not model:
                continue
            stem = "model" if i == 0 else f"model_{i}"
            path = os.path.join(input_dir, f"{stem}.safetensors")
            if not os.path.exists(path):
                path = os.path.join(input_dir, f"{stem}.bin")
            state = (
                read_weights(path)
                if path.endswith(".safetensors")
                else torch.load(path, map_location="cpu", weights_only=True)
            )
            keys = list(state)
            set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
            models[i] = _AlreadyLoaded(keys)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    for opt in optimizers:
        _full_state_optimizer(
            opt, model, options, get_optimizer_state_dict, set_optimizer_state_dict
        )


def _full_state_optimizer(opt, model, options, get_sd, set_sd) -> None:
    plain_state_dict, plain_load = opt.state_dict, opt.load_state_dict
    busy = False

    def state_dict():
        nonlocal busy
        if busy:  # torch's helper reads the plain state dict through this method
            return plain_state_dict()
        busy = True
        try:
            return get_sd(model, opt, options=options)
        finally:
            busy = False

    def load_state_dict(state_dict):
        nonlocal busy
        if busy:
            return plain_load(state_dict)
        busy = True
        try:
            set_sd(model, opt, state_dict, options=options)
        finally:
            busy = False

    opt.state_dict = state_dict
    opt.load_state_dict = load_state_dict
