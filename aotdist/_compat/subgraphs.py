"""Scoped fixes to how Dynamo and AOTAutograd handle ``invoke_subgraph``, each active for
a compiled call only and a no-op where the torch function it wraps does not exist (each
function's ``checked_on`` record names the torch versions it was checked on):

- :func:`tolerant_subgraph_dedup`: Dynamo's body comparison tolerates placeholders without
  ``example_value`` and per-trace trampolines of one autograd function.
- :func:`cached_subgraph_schemas`: ``invoke_subgraph``'s schema memoized per subgraph and
  operand metadata (AOTAutograd does not re-trace the body at every call site).
- :func:`recomputable_reductions`: the partitioner may recompute reductions;
  :func:`flat_nested_subgraph_refs`: nested subgraphs referred to by top-level names.
- :func:`single_use_inlining_deferred`: the backend sees every region call and inlines
  those still called once itself (:func:`inline_single_use_regions`).
- :func:`subclass_intermediates_inside`: a subclass made inside a region stays there (2.11).

Why each is needed: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator

from aotdist._compat._base import checked_on

_MODULE = "torch._dynamo.variables.higher_order_ops"
_NAME = "are_same_graph_modules"


def _placeholders(gm) -> list:
    return list(gm.graph.find_nodes(op="placeholder"))


def _trampoline_class(target) -> type | None:
    """The ``autograd.Function`` a Dynamo ``trampoline_autograd_apply`` closure calls."""
    if getattr(target, "__name__", "") != "trampoline_autograd_apply":
        return None
    cells = getattr(target, "__closure__", None) or ()
    classes = [c.cell_contents for c in cells if isinstance(c.cell_contents, type)]
    return classes[0] if len(classes) == 1 else None


@contextlib.contextmanager
def _same_trampolines(a_mod, b_mod) -> Iterator[None]:
    """Within: ``b_mod``'s trampolines that call the same ``autograd.Function`` as
    ``a_mod``'s at the same position are ``a_mod``'s objects; restored on exit."""
    swapped = []
    for a, b in zip(a_mod.graph.nodes, b_mod.graph.nodes, strict=False):  # lengths may differ
        if (
            a.op == b.op == "call_function"
            and a.target is not b.target
            and (cls := _trampoline_class(a.target)) is not None
            and _trampoline_class(b.target) is cls
        ):
            swapped.append((b, b.target))
            b.target = a.target
    try:
        yield
    finally:
        for node, target in swapped:
            node.target = target


def _tolerant(original: Callable) -> Callable:
    def are_same_graph_modules(fn_name, a_mod, b_mod, fake_mode):
        with _same_trampolines(a_mod, b_mod):
            return _compare(fn_name, a_mod, b_mod, fake_mode)

    def _compare(fn_name, a_mod, b_mod, fake_mode):
        a_ph, b_ph = _placeholders(a_mod), _placeholders(b_mod)
        a_missing = [i for i, n in enumerate(a_ph) if "example_value" not in n.meta]
        b_missing = [i for i, n in enumerate(b_ph) if "example_value" not in n.meta]
        if not a_missing and not b_missing:
            return original(fn_name, a_mod, b_mod, fake_mode)
        if a_missing != b_missing or len(a_ph) != len(b_ph):
            return False
        filled = [ph[i] for ph in (a_ph, b_ph) for i in a_missing]
        if any(n.users for n in filled):
            return False  # a used placeholder of unknown metadata: do not guess
        try:
            for n in filled:
                n.meta["example_value"] = None  # compares equal, as two non-tensors do
            return original(fn_name, a_mod, b_mod, fake_mode)
        finally:
            for n in filled:
                n.meta.pop("example_value", None)

    are_same_graph_modules._aotdist_original = original
    return are_same_graph_modules


@checked_on("2.11", "2.14")
@contextlib.contextmanager
def tolerant_subgraph_dedup() -> Iterator[None]:
    """Within: Dynamo's subgraph comparison tolerates unused placeholders without
    ``example_value`` (see the module docstring); restored on exit. Nested use is a no-op."""
    try:
        module = importlib.import_module(_MODULE)
    except ImportError:
        yield
        return
    original = getattr(module, _NAME, None)
    if original is None or hasattr(original, "_aotdist_original"):
        yield
        return
    setattr(module, _NAME, _tolerant(original))
    try:
        yield
    finally:
        setattr(module, _NAME, original)


_HOP_MODULE = "torch._higher_order_ops.invoke_subgraph"
_HOP_CLASS = "InvokeSubgraphHOP"
_SCALARS = (int, float, bool, str, type(None))


def _operand_key(operands: tuple) -> tuple | None:
    """What of the operands the schema depends on; ``None`` where unsure (no caching)."""
    import torch

    key, seen = [], {}
    for i, op in enumerate(operands):
        if isinstance(op, torch.Tensor):
            if op.layout != torch.strided:
                return None
            alias = seen.setdefault(id(op), i)  # the same tensor passed twice
            key.append(
                (
                    type(op),
                    tuple(op.shape),
                    tuple(op.stride()),
                    op.dtype,
                    op.device,
                    op.requires_grad,
                    alias,
                )
            )
        elif type(op) in _SCALARS:
            key.append((type(op), op))
        else:  # symbolic sizes, script objects...: let torch build the schema
            return None
    return tuple(key)


def _memoized(original: Callable, cache: dict) -> Callable:
    def gen_schema(self, subgraph, identifier, *operands):
        ops_key = _operand_key(operands)
        if ops_key is None or not isinstance(identifier, str):
            return original(self, subgraph, identifier, *operands)
        key = (id(subgraph), identifier, ops_key)
        hit = cache.get(key)
        if hit is not None and hit[0] is subgraph:
            return hit[1]
        schema = original(self, subgraph, identifier, *operands)
        cache[key] = (subgraph, schema)  # holds subgraph: its id stays unique meanwhile
        return schema

    gen_schema._aotdist_original = original
    return gen_schema


@checked_on("2.11", "2.14")
@contextlib.contextmanager
def cached_subgraph_schemas() -> Iterator[None]:
    """Within: ``invoke_subgraph``'s ``gen_schema`` is memoized per subgraph, identifier
    and operand metadata (see the module docstring), so
    AOTAutograd traces a region body for its schema once, not at every call site; the
    cache is dropped and the method restored on exit. Nested use is a no-op."""
    try:
        cls = getattr(importlib.import_module(_HOP_MODULE), _HOP_CLASS)
    except (ImportError, AttributeError):
        yield
        return
    original = cls.__dict__.get("gen_schema")
    if original is None or hasattr(original, "_aotdist_original"):
        yield
        return
    cls.gen_schema = _memoized(original, {})
    try:
        yield
    finally:
        cls.gen_schema = original


@checked_on("2.11", "2.14")
@contextlib.contextmanager
def recomputable_reductions() -> Iterator[None]:
    """Within: AOTAutograd's min-cut partitioner may recompute reductions in the backward
    (``torch._functorch.config.ban_recompute_reductions = False``; see the module
    docstring); restored on exit. A no-op where the option
    is missing or already off."""
    try:
        import torch._functorch.config as functorch_config
    except ImportError:
        yield
        return
    if not getattr(functorch_config, "ban_recompute_reductions", False):
        yield
        return
    with functorch_config.patch(ban_recompute_reductions=False):
        yield


@checked_on("2.11", "2.14")
@contextlib.contextmanager
def flat_nested_subgraph_refs() -> Iterator[None]:
    """Within: when AOTAutograd's tracer (``PythonKeyTracer``) emits a ``get_attr`` of a
    graph module it finds only under a dotted name (a region's backward subgraph registered
    inside another's: ``repeated_subgraph16.repeated_subgraph1``), the node refers to a
    top-level alias of that module instead; ``create_node`` reads the target back with a
    plain ``getattr``, which raised AttributeError for the dotted name (a region nested in
    another: timm's LeViT, ResNeXt, FastViT); restored on
    exit. Nested use and a torch without the tracer: a no-op."""
    try:
        module = importlib.import_module("torch.fx.experimental.proxy_tensor")
    except ImportError:
        yield
        return
    cls = getattr(module, "PythonKeyTracer", None)
    original = getattr(cls, "create_node", None)
    if original is None or hasattr(original, "_aotdist_original"):
        yield
        return

    def create_node(self, kind, target, args, kwargs, *rest, **more):
        if kind == "get_attr" and isinstance(target, str) and "." in target:
            target = _flat_alias(self, target)
        return original(self, kind, target, args, kwargs, *rest, **more)

    create_node._aotdist_original = original
    cls.create_node = create_node
    try:
        yield
    finally:
        cls.create_node = original


def _flat_alias(tracer, target: str) -> str:
    """A top-level name on ``tracer.root`` for the graph module at dotted ``target`` (one
    per module), or ``target`` itself when that is not a graph module."""
    import torch.fx

    try:
        sub = tracer.root.get_submodule(target)
    except (AttributeError, TypeError):
        return target
    if not isinstance(sub, torch.fx.GraphModule):
        return target
    aliases = tracer.__dict__.setdefault("_aotdist_flat_aliases", {})
    if id(sub) not in aliases:
        aliases[id(sub)] = name = tracer.get_fresh_qualname("repeated_subgraph")
        tracer.root.register_module(name, sub)
    return aliases[id(sub)]


_INLINING_DEFERRED: list[bool] = []  # non-empty within single_use_inlining_deferred


@checked_on("2.11", "2.14", note="2.11 has no such pass: a no-op there")
@contextlib.contextmanager
def single_use_inlining_deferred() -> Iterator[None]:
    """Within: Dynamo leaves a region subgraph that is called once as a call
    (``inline_single_use_invoke_subgraph`` off: torch 2.14 inlines it before the
    backend sees it; torch 2.11 has no such pass), so that the recording backend sees every
    call site of a region, and calls :func:`inline_single_use_regions` after merging the
    subgraphs that differ only in an input's layout. A no-op where the option does not
    exist or is off (the user's choice stays), and nested; restored on exit."""
    try:
        import torch._dynamo.config as dynamo_config
    except ImportError:
        yield
        return
    if not getattr(dynamo_config, "inline_single_use_invoke_subgraph", False):
        yield
        return
    _INLINING_DEFERRED.append(True)
    try:
        with dynamo_config.patch(inline_single_use_invoke_subgraph=False):
            yield
    finally:
        _INLINING_DEFERRED.pop()


@checked_on("2.11", "2.14", note="2.11 has no such pass: a no-op there")
def inline_single_use_regions(gm) -> None:
    """torch's own inlining of region subgraphs called once, applied to ``gm`` in place
    where :func:`single_use_inlining_deferred` put it off (torch 2.14); else a no-op
    (torch 2.11 has no such pass and inlines nothing)."""
    if not _INLINING_DEFERRED:
        return
    try:
        from torch._higher_order_ops.passes.inline_invoke_subgraph import (
            inline_single_use_invoke_subgraph,
        )
    except ImportError:
        return
    inline_single_use_invoke_subgraph(gm)


_TRACKER = "StorageAliasingTracker"


@checked_on("2.11", "2.14", note="needed on 2.11; a no-op on 2.14")
@contextlib.contextmanager
def subclass_intermediates_inside() -> Iterator[None]:
    """Within: Dynamo keeps a tensor subclass that a region's body makes (graph-mode FSDP's
    ``Float8TrainingTensor`` of float8-gathered bytes) inside the region. torch 2.11 offers
    every intermediate of an ``invoke_subgraph`` body as a possible extra output and asserts
    each is a ``FakeTensor`` (``_collect_fake_inputs``: "Expected FakeTensor, got
    Float8TrainingTensor"); 2.14 looks inside subclasses and needs nothing. An
    intermediate refused this way is one no output may alias, as torch filters them
    already. Restored on exit; a no-op where the tracker does not exist."""
    try:
        module = importlib.import_module(_MODULE)
    except ImportError:
        yield
        return
    tracker = getattr(module, _TRACKER, None)
    original = getattr(tracker, "check_and_track", None)
    if original is None or hasattr(original, "_aotdist_original"):
        yield
        return

    def check_and_track(self, proxy_node) -> bool:
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        node = getattr(proxy_node, "node", proxy_node)
        if is_traceable_wrapper_subclass(getattr(node, "meta", {}).get("example_value")):
            return False
        return original(self, proxy_node)

    check_and_track._aotdist_original = original
    tracker.check_and_track = check_and_track
    try:
        yield
    finally:
        tracker.check_and_track = original
