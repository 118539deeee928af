"""Hub-kernel function wrappers inside a region: the module's own forward while compiling.

transformers 5.25 and later, with the ``kernels`` package it depends on, wrap layers that
call a hub-replaceable function (Llama's attention and ``apply_rotary_pos_emb``) with
``kernels``' ``use_kernelized_func``: each call sets and resets a context variable that
routes the function to the instance's kernel. While compiling, that variable is a global
object the call writes, a side effect that makes torch trace every instance of the region
again instead of reusing its subgraph (about 90 ms a layer more). Where none of the
instance's functions is kernelized (``kernels.kernelize`` replaced no ``forward``), kernels'
own rule runs the plain function either way: such a module gets a subclass whose forward,
while compiling, is the user's forward the wrapper wraps. Only a module whose ``forward``
is exactly kernels' wrapper (function identity by code) is swapped; a subclass with its own
forward, a kernelized instance, and every call outside a compile run as written.
"""

from __future__ import annotations

import functools
import sys
import types

import torch
from torch import nn

from aotdist.per_process import made_class


def _wrapper_code() -> types.CodeType | None:
    """The code of kernels' ``use_kernelized_func`` wrapper, from a probe class, or
    ``None`` where ``kernels`` is not imported (nothing of the model uses it)."""
    kernels = sys.modules.get("kernels")
    return None if kernels is None else _probed(kernels)


@functools.cache
def _probed(kernels: types.ModuleType) -> types.CodeType | None:
    use_func = getattr(kernels, "use_kernelized_func", None)
    use_forward = getattr(kernels, "use_kernel_forward_from_hub", None)
    if use_func is None or use_forward is None:
        return None

    def probe(x):
        return x

    try:
        func = use_forward("aotdist_probe")(probe)

        @use_func(func)
        class Probe(nn.Module):
            def forward(self, x):
                return x
    except Exception:  # another kernels release: its wrapper is not the one reproduced
        return None
    return getattr(Probe.forward, "__code__", None)


def _unwrapped(cls: type) -> types.FunctionType | None:
    """The forward kernels' wrapper on ``cls`` wraps, where ``cls.forward`` is the wrapper."""
    forward = getattr(cls, "forward", None)
    code = _wrapper_code()
    if code is None or getattr(forward, "__code__", None) is not code:
        return None
    inner = getattr(forward, "__wrapped__", None)
    return inner if isinstance(inner, types.FunctionType) else None


def _kernelized(mod: nn.Module) -> bool:
    """Whether ``kernels.kernelize`` gave one of ``mod``'s functions a forward of its own
    (kernels' own test, while compiling, for running the kernel)."""
    funcs = vars(mod).get("_kernel_funcs")
    if not isinstance(funcs, dict):
        return True  # not the state the wrapper keeps: leave the module as written
    return any(
        getattr(getattr(f, "forward", None), "__func__", None) is not type(f).forward
        for f in funcs.values()
    )


def _forward(self, *args, **kwargs):
    base = type(self)._aotdist_kf_base
    if not torch.compiler.is_compiling():
        return base.forward(self, *args, **kwargs)
    return type(self)._aotdist_kf_inner(self, *args, **kwargs)


@functools.cache
def _class(base: type) -> type:
    # remake: a saved graph pickles its instances as made again from ``base``
    return made_class(
        base,
        {"forward": _forward, "_aotdist_kf_base": base, "_aotdist_kf_inner": _unwrapped(base)},
        remake=(_class, (base,)),
    )


def swap(module: nn.Module) -> list[nn.Module]:
    """Gives each un-kernelized wrapped module under ``module`` the class above."""
    swapped = []
    for mod in module.modules():
        cls = type(mod)
        if "_aotdist_kf_base" in vars(cls) or _unwrapped(cls) is None or _kernelized(mod):
            continue
        mod.__class__ = _class(cls)
        swapped.append(mod)
    return swapped


def restore(module: nn.Module) -> None:
    """Undoes :func:`swap` under ``module``."""
    for mod in module.modules():
        base = vars(type(mod)).get("_aotdist_kf_base")
        if base is not None:
            mod.__class__ = base
