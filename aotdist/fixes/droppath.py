"""Stochastic depth inside a region: each block's drop rate is data, not a constant.

torchvision's ``StochasticDepth``, timm's ``DropPath`` and transformers' ``*DropPath`` hold a
drop rate that grows with depth, a float Dynamo specializes each block's subgraph on. Each
such module under a region instance gets a subclass of its own class whose rate lives in a
non-persistent 0-dim buffer (``state_dict()`` unchanged); the attribute (``p`` /
``drop_prob``) stays a float that writes through to it. While compiling, the forward draws
the mask from that tensor as the library does (transformers: the same ``torch.rand`` draw;
torchvision, timm: ``bernoulli_`` with the rate as a tensor, same distribution, another
stream). Only a module whose forward, and the library function it calls, are exactly the
code reproduced (:mod:`.droppath_reference`) is swapped; anything else runs as written.
Outside a compile the user's forward runs; a region on the meta device is left as it is.
"""

from __future__ import annotations

import functools
import sys
import types

import torch
from torch import nn

from aotdist.fixes import droppath_reference as reference
from aotdist.per_process import made_class

_KEEP = "_aotdist_keep"  # the buffer: 1 - rate


def same_code(fn: object, ref: types.FunctionType) -> bool:
    """Whether ``fn`` is a function with the same code as ``ref``: bytecode, names and
    constants (docstrings, line numbers and file names aside), nested code included."""
    code = getattr(fn, "__code__", None)
    return isinstance(code, types.CodeType) and _same(code, ref.__code__, fn.__doc__, ref.__doc__)


def _same(a: types.CodeType, b: types.CodeType, doc_a=None, doc_b=None) -> bool:
    if (a.co_code, a.co_names, a.co_varnames) != (b.co_code, b.co_names, b.co_varnames):
        return False
    ca, cb = _body_consts(a.co_consts, doc_a), _body_consts(b.co_consts, doc_b)
    return len(ca) == len(cb) and all(
        _same(x, y)
        if isinstance(x, types.CodeType) and isinstance(y, types.CodeType)
        else type(x) is type(y) and x == y
        for x, y in zip(ca, cb, strict=True)
    )


def _body_consts(consts: tuple, doc: str | None) -> tuple:
    # the first constant is the docstring, or None where there is none (CPython <= 3.13)
    return consts[1:] if consts and (consts[0] is None or consts[0] is doc) else consts


def _kind(cls: type) -> str | None:
    """Which library draw ``cls.forward`` is exactly ("rand", "bernoulli", "timm"), else
    ``None``: function identity (torchvision, timm) or the same code as the copy
    (transformers' 43 per-family copies), and the library function it calls unchanged."""
    forward = getattr(cls, "forward", None)
    tv = sys.modules.get("torchvision.ops.stochastic_depth")
    if (
        tv is not None
        and forward is tv.StochasticDepth.forward
        and same_code(tv.stochastic_depth, reference.torchvision_stochastic_depth)
    ):
        return "bernoulli"
    timm = sys.modules.get("timm.layers.drop")
    if (
        timm is not None
        and forward is timm.DropPath.forward
        and same_code(timm.drop_path, reference.timm_drop_path)
    ):
        return "timm"
    if getattr(forward, "__module__", "").startswith("transformers.") and same_code(
        forward, reference.transformers_drop_path_forward
    ):
        return "rand"
    return None


def _attribute(mod: nn.Module) -> str | None:
    """The rate attribute of a stochastic-depth module aotdist reproduces, else ``None``."""
    cls = type(mod)
    if "_aotdist_dp_base" in vars(cls):
        return None
    kind = _kind(cls)
    if kind is None or (kind == "bernoulli" and getattr(mod, "mode", None) not in ("row", "batch")):
        return None
    name = "p" if kind == "bernoulli" else "drop_prob"
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
    kind = self._aotdist_dp_kind
    if kind == "rand":  # transformers' DropPath, per sample
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)
        mask = torch.floor(torch.rand(shape, dtype=x.dtype, device=x.device) + keep)
        return x.div(keep) * mask
    row = kind == "timm" or self.mode == "row"
    size = [x.shape[0]] + [1] * (x.ndim - 1) if row else [1] * x.ndim
    noise = torch.empty(size, dtype=x.dtype, device=x.device).bernoulli_(keep)
    if kind == "timm" and not self.scale_by_keep:
        return x * noise
    return x * torch.where(keep > 0, noise / keep, noise)


@functools.cache
def _class(base: type, name: str) -> type:
    # remake: a saved graph pickles its instances as made again from ``base``
    return made_class(
        base,
        {
            "forward": _forward,
            name: _rate(name),
            "_aotdist_dp_base": base,
            "_aotdist_dp_name": name,
            "_aotdist_dp_kind": _kind(base),
        },
        remake=(_class, (base, name)),
    )


def swap(module: nn.Module) -> list[nn.Module]:
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


def restore(module: nn.Module) -> None:
    """Undoes :func:`swap` under ``module``."""
    for mod in module.modules():
        base = vars(type(mod)).get("_aotdist_dp_base")
        if base is None:
            continue
        name = type(mod)._aotdist_dp_name
        rate = mod.__dict__.pop("_aotdist_rate")
        mod.__class__ = base
        delattr(mod, _KEEP)  # nn.Module's: the buffer and its non-persistent mark
        setattr(mod, name, rate)
