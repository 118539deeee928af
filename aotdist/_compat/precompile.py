"""torch's precompile: a whole-model graph saved with its guards and run without Dynamo.

``torch.compile(fn, fullgraph=True).aot_compile(((args), kwargs))`` traces and compiles
``fn`` once and returns a function that can be serialized; loaded in another process it
checks its guards and calls the compiled code directly (no Dynamo trace, no AOTAutograd
cache lookup). aotdist saves one with the cache bundle (:mod:`aotdist.cache.precompile`).
On torch 2.11 :func:`precompile_unavailable` says why not: it saves the output of
Inductor's own backend only, not of one that wraps it. Each accessor's ``checked_on``
record names the torch versions it was checked on.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import linecache
import re
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from aotdist._compat._base import attr, checked_on

_saving = False  # inside aot_compile: see unsaved_in_guards


@checked_on("2.11", "2.14")
@functools.cache
def precompile_unavailable() -> str | None:
    """Why this torch cannot save aotdist's whole-model graph, or ``None`` when it can
    (torch 2.14; 2.11 cannot)."""
    fullgraph = attr("torch._dynamo.aot_compile", "aot_compile_fullgraph")
    if fullgraph is None:
        return f"torch {torch.__version__} has no aot_compile"
    try:
        source = inspect.getsource(fullgraph)
    except (OSError, TypeError):
        return f"torch {torch.__version__}'s aot_compile source cannot be read"
    if "compiled_fn.serialize" not in source:  # 2.11: only Inductor's own wrapper is saved
        return (
            f"torch {torch.__version__}'s aot_compile saves only Inductor's own backend, "
            "not one that wraps it (torch 2.14 and later do)"
        )
    return None


@checked_on("2.11", "2.14")
def unserializable_guard_types() -> frozenset[str]:
    """Guard kinds torch cannot save with a precompiled graph (object identities)."""
    cfm = attr("torch._dynamo.guards", "CheckFunctionManager")
    return frozenset(getattr(cfm, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", ()))


@contextlib.contextmanager
def _grads_detached(model: nn.Module):
    """Parameters without ``.grad`` while guards are saved: torch 2.14 pickles a
    parameter's gradient as a placeholder that fails to load ("assigned grad expected
    to be a Tensor or None")."""
    grads = {p: p.grad for p in model.parameters() if p.is_leaf}  # not graph-mode FSDP's
    # local shards (views of their DTensors)
    for p in grads:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in grads.items():
            p.grad = grad


@contextlib.contextmanager
def _closures_saved_by_code(fn: Callable):
    """Inside, functions in ``fn``'s closures (a decorator's wrapped function: transformers'
    ``deprecate_kwarg`` on a decoder layer's ``forward``) that pickle would look up by a
    name that finds another object (the decorated one) carry ``<locals>`` in their
    qualified name, which makes torch's pickler save them by code and closure instead
    (torch 2.14)."""
    renamed, seen, todo = [], set(), [fn]
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        for cell in getattr(f, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if not isinstance(value, types.FunctionType):
                continue
            todo.append(value)
            if "<locals>" not in value.__qualname__ and _by_name(value) is not value:
                renamed.append((value, value.__qualname__))
                value.__qualname__ = f"<locals>.{value.__qualname__}"
    try:
        yield
    finally:
        for value, qualname in renamed:
            value.__qualname__ = qualname


@contextlib.contextmanager
def _local_types_saved_by_path(model: nn.Module):
    """Inside, a class made in a function whose one instance is a global of the module the
    class names (transformers 5.25's hub-kernel functions, ``apply_rotary_pos_emb``: an
    instance of kernels' ``Func``) is named ``<global>.__class__``, a path pickle resolves
    in any process that imports the module: torch refuses to save a type guard on a class
    whose qualified name is not its name (torch 2.14). Only the modules of ``model``'s
    classes are read."""
    renamed, seen = [], set()
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        for key, value in list(vars(module).items()) if module is not None else ():
            cls = type(value)
            if cls in seen or "<locals>" not in cls.__qualname__ or cls.__module__ != name:
                continue
            seen.add(cls)
            renamed.append((cls, cls.__name__, cls.__qualname__))
            cls.__name__ = cls.__qualname__ = f"{key}.__class__"
    try:
        yield
    finally:
        for cls, name, qualname in renamed:
            cls.__name__, cls.__qualname__ = name, qualname


def _by_name(fn: types.FunctionType) -> Any:
    """What ``fn``'s module and qualified name lead to (pickle's lookup), or ``None``."""
    obj = sys.modules.get(fn.__module__)
    for part in fn.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj


@checked_on("2.11", "2.14")
@contextlib.contextmanager
def stand_in_parameters(module: nn.Module, params: dict[str, torch.Tensor]):
    """Inside, each parameter of ``module`` named in ``params`` (``"sub.name"`` -> an empty
    tensor with its metadata) is that tensor as a parameter (``requires_grad`` as the
    tensor's); the originals are back after. A trace reads metadata, not values: FSDP2's
    unsharded parameters, gone after a step, are traced this way."""
    swapped = []
    for name, empty in params.items():
        owner, _, leaf = name.rpartition(".")
        holder = module.get_submodule(owner)
        swapped.append((holder, leaf, holder._parameters[leaf]))
        holder._parameters[leaf] = nn.Parameter(empty.detach(), requires_grad=empty.requires_grad)
    try:
        yield
    finally:
        for holder, leaf, param in swapped:
            holder._parameters[leaf] = param


def _unsaved() -> None:
    return None


@checked_on("2.14", note="2.11 saves no graph of aotdist's: never called there")
def unsaved_in_guards(self, protocol: int):
    """``__reduce_ex__`` of a run-time object that a module holds as a callable attribute
    (aotdist's compiled-call wrappers): torch's guard pickler saves a module's callable
    attributes whole, so inside :func:`aot_compile` such objects pickle as ``None`` (no
    guard reads them; their state, a shared cache's store for one, cannot be pickled).
    Never called on torch 2.11, which saves no graph of aotdist's."""
    if _saving:
        return (_unsaved, ())
    return object.__reduce_ex__(self, protocol)


@contextlib.contextmanager
def _run_state_unsaved() -> Iterator[None]:
    global _saving
    before, _saving = _saving, True
    try:
        yield
    finally:
        _saving = before


_MODULE_REF = re.compile(r"^___module_\w+?_(\d+)_c\d+$")


@checked_on("2.14", note="2.11 saves no graph of aotdist's: never called there")
def aot_compile(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    *,
    model: nn.Module,
    backend: Any,
    dynamic: bool | None,
    guard_filter: Callable,
) -> tuple[bytes, dict[str, str]]:
    """Traces ``fn(*args, **kwargs)`` as one graph with ``backend``; returns the serialized
    precompiled function and the modules its code reaches through globals Dynamo made up
    (``___module_<name>_<id>_c<n>``: name -> module name; the loader must pass them).
    Not on torch 2.11 (:func:`precompile_unavailable`). Raises what torch raises (a graph
    break, a guard that cannot be saved, an output it cannot serialize), and
    ``RuntimeError`` for code that reaches another made-up global."""
    compiled = torch.compile(
        fn,
        fullgraph=True,
        backend=backend,
        dynamic=dynamic,
        options={"guard_filter_fn": guard_filter},
    )
    patch = (
        {"enable_aot_compile": True} if hasattr(torch._dynamo.config, "enable_aot_compile") else {}
    )
    with (
        torch._dynamo.config.patch(**patch),
        _grads_detached(model),
        _closures_saved_by_code(fn),
        _local_types_saved_by_path(model),
        _run_state_unsaved(),
        warnings.catch_warnings(),
    ):
        # the guard pickler reads .grad of every tensor, graph-mode FSDP's local shards too
        warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf")
        result = compiled.aot_compile((args, kwargs))
    env = result._artifacts.runtime_env
    missing = (
        set(getattr(env, "external_refs", ()))
        - set(env.import_sources)
        - set(env.used_globals)
        - {result._artifacts.backend_id}
    )
    by_id = {id(m): m.__name__ for m in list(sys.modules.values()) if m is not None}
    modules = {}
    for ref in sorted(missing):
        match = _MODULE_REF.match(ref)
        if match is None or int(match.group(1)) not in by_id:
            raise RuntimeError(
                f"its code reads a global Dynamo made up, {ref}, that cannot be saved"
            )
        modules[ref] = by_id[int(match.group(1))]
    with _closures_saved_by_code(fn), _local_types_saved_by_path(model), _run_state_unsaved():
        return type(result).serialize(result).serialized_data, modules


@checked_on("2.14", note="2.11 saves none for aotdist: never made there")
class PrecompiledFunction:
    """A loaded precompiled function: its guard check, why a check failed, the call
    (torch 2.11 saves none for aotdist)."""

    def __init__(self, data: bytes, modules: dict[str, str]):
        cls = attr("torch._dynamo.aot_compile", "AOTCompiledFunction")
        refs = {ref: importlib.import_module(name) for ref, name in modules.items()}
        self._fn = cls.deserialize(data, f_globals=refs)
        self._fn.disable_guard_check()  # checked here first, so a miss can fall back

    def check(self, args: tuple, kwargs: dict) -> bool:
        return bool(self._fn.guard_check(*args, **kwargs))

    def why(self, args: tuple, kwargs: dict) -> str:
        """The failing guard, as torch words it."""
        manager = self._fn._artifacts.guard_manager
        verbose = manager.check_verbose(self._fn.prepare_f_locals(*args, **kwargs))
        parts = getattr(verbose, "verbose_code_parts", None)
        text = "; ".join(map(str, parts)) if isinstance(parts, (list, tuple)) else str(verbose)
        return " ".join(text.split())[:300]

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        return self._fn(*args, **kwargs)

    def changed_source(self) -> str | None:
        """A traced function whose source changed since the save (``module lines a-b``),
        or ``None``: the guards do not check the code, so this must."""
        linecache.checkcache()
        for src in self._fn.source_info().inlined_sources:
            try:
                module = importlib.import_module(src.module)
                lines = inspect.getsourcelines(module)[0][src.firstlineno - 1 : src.lastlineno - 1]
            except (ImportError, OSError, TypeError):
                return f"{src.module} (cannot be read)"
            if _hash("".join(lines)) != src.checksum:
                return f"{src.module} lines {src.firstlineno}-{src.lastlineno - 1}"
        return None


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
