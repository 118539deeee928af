"""Stochastic depth inside a region: each block's drop rate is data, not a constant.

torchvision's ``StochasticDepth`` (ConvNeXt, EfficientNet, Swin, MaxViT) and transformers'
``*DropPath`` modules (ConvNeXT, Swin, BEiT, DINOv2...) hold a drop rate that grows with
depth, a Python float the forward reads: Dynamo specializes each block's subgraph on it,
so no two blocks shared one in training. Marking gives each such module under a region
instance a subclass of its own class whose rate lives in a non-persistent 0-dim buffer
(``state_dict()`` unchanged); the attribute (``p`` / ``drop_prob``) stays a float that
writes through to it. While compiling, the forward computes the mask from that tensor as
the user's class does (transformers: the same ``torch.rand`` draw; torchvision: a
``bernoulli_`` draw with the rate as a tensor, same distribution, another stream); a block
whose rate is 0 draws its all-ones mask too. Outside a compile the user's forward runs.
A region on the meta device is left as it is (``to_empty`` would not keep the buffer).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["restore_drop_paths", "swap_drop_paths"]

_KEEP = "_aotdist_keep"  # the buffer: 1 - rate


def _attribute(mod: nn.Module) -> str | None:
    """The rate attribute of a stochastic-depth module aotdist knows, else ``None``."""
    cls = type(mod)
    if "_aotdist_dp_base" in vars(cls):
        return None
    if (cls.__name__ == "StochasticDepth" and cls.__module__.startswith("torchvision.")
            and getattr(mod, "mode", None) in ("row", "batch")):
        name = "p"
    elif cls.__name__.endswith("DropPath") and cls.__module__.startswith("transformers."):
        name = "drop_prob"
    else:
        return None
    value = vars(mod).get(name)
    return name if isinstance(value, (int, float)) and 0.0 <= value <= 1.0 else None


def _rate(name: str) -> property:
    def get(self):
        return self.__dict__["_aotdist_rate"]

    def set_(self, value):
        self.__dict__["_aotdist_rate"] = value
        with torch.no_grad():
            getattr(self, _KEEP).fill_(1.0 - float(value))

    return property(get, set_, doc=f"the drop rate (aotdist keeps 1 - {name} as a tensor)")


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    if not torch.compiler.is_compiling():
        return self._aotdist_dp_base.forward(self, x)
    if not self.training:
        return x
    keep = getattr(self, _KEEP)
    if self._aotdist_dp_name == "drop_prob":  # transformers' DropPath, per sample
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)
        mask = torch.floor(torch.rand(shape, dtype=x.dtype, device=x.device) + keep)
        return x.div(keep) * mask
    size = [x.shape[0]] + [1] * (x.ndim - 1) if self.mode == "row" else [1] * x.ndim
    noise = torch.empty(size, dtype=x.dtype, device=x.device).bernoulli_(keep)
    return x * torch.where(keep > 0, noise / keep, noise)


@functools.cache
def _class(base: type, name: str) -> type:
    # _aotdist_remake: a saved graph pickles its instances as made again from ``base``
    return type(base.__name__, (base,), {
        "forward": _forward, name: _rate(name), "_aotdist_dp_base": base,
        "_aotdist_dp_name": name, "_aotdist_remake": (_class, (base, name)),
        "__module__": base.__module__, "__qualname__": base.__qualname__,
    })


def swap_drop_paths(module: nn.Module) -> list[nn.Module]:
    """Gives each stochastic-depth module under ``module`` the class above; returns them."""
    swapped = []
    device = next((p.device for p in module.parameters()), None)
    if device is not None and device.type == "meta":  # to_empty would leave it garbage
        return swapped
    for mod in module.modules():
        name = _attribute(mod)
        if name is None:
            continue
        rate = vars(mod).pop(name)
        keep = torch.tensor(1.0 - float(rate), dtype=torch.float32, device=device)
        mod.register_buffer(_KEEP, keep, persistent=False)
        mod.__class__ = _class(type(mod), name)
        mod.__dict__["_aotdist_rate"] = rate
        swapped.append(mod)
    return swapped


def restore_drop_paths(module: nn.Module) -> None:
    """Undoes :func:`swap_drop_paths` under ``module``."""
    for mod in module.modules():
        base = vars(type(mod)).get("_aotdist_dp_base")
        if base is None:
            continue
        name = type(mod)._aotdist_dp_name
        rate = mod.__dict__.pop("_aotdist_rate")
        mod.__class__ = base
        del mod._buffers[_KEEP]
        setattr(mod, name, rate)
