"""Code objects of aotdist's own: Dynamo's per-code state kept per model and per region."""

from __future__ import annotations

import itertools
import sys
import types
from collections.abc import Callable

import torch

from aotdist._compat._base import attr, unavailable

__all__ = ["dynamo_error_types", "maybe_mark_dynamic", "region_options", "unique_code_function"]

_CODE_SERIAL = itertools.count()


def unique_code_function(fn: Callable, label: str) -> Callable:
    """A copy of ``fn`` whose code object has a name of its own (``<name>__<label>_<n>``).

    Dynamo keys per-code state by code *name*, file and line (``torch._dynamo.pgo.CodeId``:
    automatic-dynamic profiles) and the ``invoke_subgraph`` reuse cache by code *value*
    (torch 2.11, 2.15): two copies of one function share both. A name per model /
    per region keeps one model's shapes, and one region's reuse entries, out of another's.
    """
    if isinstance(fn, types.MethodType):  # keep it bound
        return types.MethodType(unique_code_function(fn.__func__, label), fn.__self__)
    if not isinstance(fn, types.FunctionType):  # a partial, a callable object: as it is
        return fn
    name = f"{fn.__code__.co_name}__{_identifier(label)}_{next(_CODE_SERIAL)}"
    changes = {"co_name": name}
    if sys.version_info >= (3, 11):
        changes["co_qualname"] = name
    new = types.FunctionType(fn.__code__.replace(**changes), fn.__globals__, name,
                             fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__ = fn.__qualname__
    new.__module__ = fn.__module__
    new.__doc__ = fn.__doc__
    return new


def _identifier(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label)[:60] or "x"


def maybe_mark_dynamic(t: torch.Tensor) -> None:
    """``torch._dynamo.maybe_mark_dynamic`` on every dimension of ``t`` (torch 2.11, 2.15):
    a hint, specialized without error where the program needs a static size."""
    fn = attr("torch._dynamo", "maybe_mark_dynamic")
    if fn is None:
        raise unavailable("torch._dynamo.maybe_mark_dynamic")
    for dim in range(t.dim()):
        fn(t, dim)


def region_options(max_reuse_entries: int) -> dict:
    """Keyword arguments for ``torch.compiler.nested_compile_region``: ``max_reuse_entries``
    where it exists (torch 2.14, 2.15), else none (torch 2.11: no cap on reuse entries)."""
    import inspect

    params = inspect.signature(torch.compiler.nested_compile_region).parameters
    return {"max_reuse_entries": max_reuse_entries} if "max_reuse_entries" in params else {}


def dynamo_error_types() -> tuple[type, ...]:
    """``torch._dynamo.exc.TorchDynamoException``: the base of every error Dynamo raises
    while tracing or compiling (torch 2.11, 2.15), before any of the frame ran."""
    cls = attr("torch._dynamo.exc", "TorchDynamoException")
    return (cls,) if cls is not None else ()
