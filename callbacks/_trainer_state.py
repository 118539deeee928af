"""The Hugging Face ``Trainer``'s checkpoints for a model aotdist sharded with FSDP2.

The Trainer saves a model it did not shard on the main process only (``save_pretrained``,
``torch.save(optimizer.state_dict())``), while an FSDP2 model's full state needs every
rank's shard. So every rank gathers the full state when the Trainer is about to save
(:func:`gather_for_save`, from ``on_step_end`` / ``on_epoch_end`` / ``on_train_end``), and
the main process's next ``state_dict()`` returns it. Loading goes the other way: the full
tensors the Trainer reads on every rank are put back as shards.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_GATHERED = "_aotdist_gathered_state"


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _serve_once(obj: Any) -> None:
    """``obj.state_dict()`` returns what :func:`gather_for_save` left, once, else the
    plain state dict."""
    if "state_dict" in obj.__dict__:
        return
    plain = type(obj).state_dict.__get__(obj)

    def state_dict(*args, **kwargs):
        gathered = obj.__dict__.pop(_GATHERED, None)
        if gathered is not None and not args and not kwargs:
            return gathered
        return plain(*args, **kwargs)

    obj.state_dict = state_dict


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)


def gather_for_save(model: nn.Module, optimizer: Any) -> None:
    """Every rank: gathers the full model (and optimizer) state; the main process keeps it
    for its next ``state_dict()`` call, which the Trainer's save makes."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opt = inner_optimizer(optimizer) if optimizer is not None else None
    for obj in (model, opt):
        if obj is None:
            continue
        _serve_once(obj)
        obj.__dict__.pop(_GATHERED, None)  # the gather reads the plain state dict
        if obj is model:
            full = get_model_state_dict(model, options=_options())
        else:
            full = get_optimizer_state_dict(model, obj, options=_options())
        if torch.distributed.get_rank() == 0:
            obj.__dict__[_GATHERED] = full


def load_full_model_state(model: nn.Module) -> None:
    """``model.load_state_dict(full)`` (the Trainer's resume, on every rank) loads the
    full tensors into the FSDP2 shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    plain_load = type(model).load_state_dict.__get__(model)
    busy = False

    def load_state_dict(state_dict, strict: bool = True, assign: bool = False):
        nonlocal busy
        if busy or assign:  # torch's helper loads the shards through this method
            return plain_load(state_dict, strict, assign)
        busy = True
        try:
            options = StateDictOptions(full_state_dict=True, strict=strict)
            return set_model_state_dict(model, state_dict, options=options)
        finally:
            busy = False

    model.load_state_dict = load_state_dict


def shard_loaded_optimizer_state(optimizer: Any) -> int:
    """After the Trainer loaded a full optimizer state (every rank, the same file): each
    tensor of a sharded parameter's state becomes that parameter's shard. Returns how many
    tensors it sharded."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    opt = inner_optimizer(optimizer)
    done = 0
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            if not isinstance(p, DTensor):
                continue
            for key, value in state.items():
                if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
                    continue
                if tuple(value.shape) == tuple(p.shape):
                    state[key] = distribute_tensor(
                        value.to(p.device), p.device_mesh, p.placements, src_data_rank=None
                    )
                    done += 1
    return done
