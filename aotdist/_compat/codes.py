"""Code objects of aotdist's own: Dynamo's per-code state kept per model and per region,
and torch's own reasons for not reusing a region's subgraph, recorded by code name."""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import sys
import types
from collections.abc import Callable, Iterator

import torch

from aotdist._compat._base import attr, checked_on, unavailable

_CODE_SERIAL = itertools.count()


@checked_on("2.11", "2.14")
def unique_code_function(fn: Callable, label: str) -> Callable:
    """A copy of ``fn`` whose code object has a name of its own (``<name>__<label>_<n>``).

    Dynamo keys per-code state by code *name*, file and line (``torch._dynamo.pgo.CodeId``:
    automatic-dynamic profiles) and the ``invoke_subgraph`` reuse cache by code *value*:
    two copies of one function share both. A name per model / per region keeps one model's
    shapes, and one region's reuse entries, out of another's.
    """
    if isinstance(fn, types.MethodType):  # keep it bound
        return types.MethodType(unique_code_function(fn.__func__, label), fn.__self__)
    if not isinstance(fn, types.FunctionType):  # a partial, a callable object: as it is
        return fn
    name = f"{fn.__code__.co_name}__{_identifier(label)}_{next(_CODE_SERIAL)}"
    changes = {"co_name": name}
    if sys.version_info >= (3, 11):
        changes["co_qualname"] = name
    new = types.FunctionType(
        fn.__code__.replace(**changes), fn.__globals__, name, fn.__defaults__, fn.__closure__
    )
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__ = fn.__qualname__
    new.__module__ = fn.__module__
    new.__doc__ = fn.__doc__
    return new


def _identifier(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label)[:60] or "x"


@checked_on("2.11", "2.14")
def maybe_mark_dynamic(t: torch.Tensor) -> None:
    """``torch._dynamo.maybe_mark_dynamic`` on every dimension of ``t``: a hint,
    specialized without error where the program needs a static size."""
    fn = attr("torch._dynamo", "maybe_mark_dynamic")
    if fn is None:
        raise unavailable("torch._dynamo.maybe_mark_dynamic")
    for dim in range(t.dim()):
        fn(t, dim)


@checked_on("2.11", "2.14")
def region_options(max_reuse_entries: int) -> dict:
    """Keyword arguments for ``torch.compiler.nested_compile_region``: ``max_reuse_entries``
    where it exists (torch 2.14), else none (torch 2.11: no cap on reuse entries)."""
    import inspect

    params = inspect.signature(torch.compiler.nested_compile_region).parameters
    return {"max_reuse_entries": max_reuse_entries} if "max_reuse_entries" in params else {}


@checked_on("2.11", "2.14")
def dynamo_error_types() -> tuple[type, ...]:
    """``torch._dynamo.exc.TorchDynamoException``: the base of every error Dynamo raises
    while tracing or compiling, before any of the frame ran."""
    cls = attr("torch._dynamo.exc", "TorchDynamoException")
    return (cls,) if cls is not None else ()


@checked_on("2.11", "2.14")
def is_region_code(co_name: str, label: str) -> bool:
    """Whether ``co_name`` names a code object :func:`unique_code_function` made for
    ``label`` (not one made for another label, such as ``<label>_frame``): aotdist's own
    naming, not torch's."""
    return re.fullmatch(rf".+__{re.escape(_identifier(label))}_\d+", co_name) is not None


# Dynamo's log of subgraph reuse (checked on torch 2.14.1; torch 2.11 logs no such reason)
_REUSE_LOG = "torch._dynamo.variables.invoke_subgraph.__hierarchical_compile"
_REFUSED = ("subgraph_reuse: not eligible -- ", "subgraph_reuse: mutated sources detected")
_MISMATCH = "subgraph_reuse: reuse failed -- input "  # "... %d tensor metadata mismatch"
_FIELDS = ("shape", "stride", "dtype", "requires_grad", "storage_offset", "device")


def _metadata_difference(frame) -> str:
    """What differs between the cached and the current region input (torch 2.14.1's
    ``cached_val`` / ``cur_meta`` locals of the reuse check), e.g. ``shape (2, 8) vs
    (2, 4)``; '' where those locals are not there."""
    while frame is not None and not {"cur_meta", "cached_val"} <= frame.f_locals.keys():
        frame = frame.f_back
    if frame is None:
        return ""
    old, new = (_fields(frame.f_locals[k]) for k in ("cached_val", "cur_meta"))
    diffs = [
        f"{name} {_shown(old.get(name))} vs {_shown(new.get(name))}"
        for name in _FIELDS
        if old.get(name) != new.get(name)
    ]
    return "; ".join(diffs[:2])


def _fields(meta) -> dict:
    # torch 2.14.1 keeps (shape, stride, dtype, device, requires_grad); others TensorMetadata
    if type(meta) is tuple and len(meta) == 5:
        return dict(zip(("shape", "stride", "dtype", "device", "requires_grad"), meta, strict=True))
    return {name: getattr(meta, name, None) for name in _FIELDS}


def _shown(value) -> str:
    return str(tuple(value)) if isinstance(value, (tuple, list, torch.Size)) else str(value)


class _Refusals(logging.Handler):
    def __init__(self, sink: dict[str, str]) -> None:
        super().__init__(logging.DEBUG)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            mismatch = text.startswith(_MISMATCH) and "tensor metadata mismatch" in text
            if not (text.startswith(_REFUSED) or mismatch):
                return
            frame = sys._getframe(1)
            if mismatch and (diff := _metadata_difference(frame)):
                text = f"{text}: {diff}"
            while frame is not None and "fn_var" not in frame.f_locals:
                frame = frame.f_back  # up to the region call being traced
            fn = getattr(frame.f_locals["fn_var"], "fn", None) if frame is not None else None
            code = getattr(fn, "__code__", None)
            if code is not None:
                first = text.removeprefix("subgraph_reuse: ").split("\n", 1)[0]
                self.sink.setdefault(code.co_name, first)  # not the side effect's stack
        except Exception:  # noqa: BLE001 - a diagnosis only: never fail the compile
            pass


@checked_on("2.11", "2.14")
def reuses_by_comparing_bodies() -> bool:
    """Whether Dynamo reuses a region's subgraph only where the traced bodies compare equal
    node by node (torch 2.11's ``are_same_graph_modules``), not by guarding its inputs
    (torch 2.14's ``torch._dynamo.variables.invoke_subgraph``). The older check compares
    the symbolic-integer inputs of nested bodies (an ``autograd.Function``'s forward and
    backward) by identity: a host value traced anew at each call site never matches."""
    try:
        import torch._dynamo.variables.invoke_subgraph  # noqa: F401
    except ImportError:
        return True
    return False


@checked_on("2.11", "2.14", note="2.14.1; on 2.11 a no-op (no such log)")
@contextlib.contextmanager
def reuse_refusals(sink: dict[str, str]) -> Iterator[None]:
    """Within: each reason Dynamo gives for not reusing a traced region body (torch's
    ``TORCH_LOGS=+hierarchical_compile`` lines: "not eligible -- unsupported input VT
    types", "... subgraph has side effects", an input's metadata mismatch with what
    differs, ...) goes into ``sink``, keyed by the region function's code name. Only
    this handler receives them unless the user enabled that log; the logger's level is
    restored on exit. A no-op on torch 2.11 (no such log)."""
    try:
        import torch._dynamo.variables.invoke_subgraph  # noqa: F401

        logs = True
    except ImportError:
        logs = False
    if not logs:  # not yielded inside the except block: a compile error would chain to it
        yield
        return
    log = logging.getLogger(_REUSE_LOG)
    handler, level, propagate = _Refusals(sink), log.level, log.propagate
    log.addHandler(handler)
    if not log.isEnabledFor(logging.DEBUG):  # the user's log is off: ours alone
        log.setLevel(logging.DEBUG)
        log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate
