"""Scoped fixes to how Dynamo and AOTAutograd handle ``invoke_subgraph``.

Four context managers, each active for the duration of a compiled call only, and each a
no-op where the torch function it wraps does not exist (checked on torch 2.11 and 2.15):

- :func:`tolerant_subgraph_dedup`: Dynamo's region body comparison tolerates placeholders
  without ``example_value`` and per-trace trampolines of one autograd function.
- :func:`cached_subgraph_schemas`: memoizes ``invoke_subgraph``'s schema per subgraph and
  operand metadata, so AOTAutograd does not re-trace the region body at every call site.
- :func:`recomputable_reductions`: lets AOTAutograd's partitioner recompute reductions
  while a graph holding regions compiles.
- :func:`flat_nested_subgraph_refs`: AOTAutograd's tracer refers to a region subgraph
  nested in another by a top-level name, not by a dotted one it cannot read back.

Why each is needed: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator

__all__ = ["cached_subgraph_schemas", "flat_nested_subgraph_refs", "recomputable_reductions",
           "tolerant_subgraph_dedup"]

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
        if (a.op == b.op == "call_function" and a.target is not b.target
                and (cls := _trampoline_class(a.target)) is not None
                and _trampoline_class(b.target) is cls):
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


@contextlib.contextmanager
def tolerant_subgraph_dedup() -> Iterator[None]:
    """Within: Dynamo's subgraph comparison tolerates unused placeholders without
    ``example_value`` (see the module docstring; checked on torch 2.11 and 2.15); restored
    on exit. Nested use is a no-op."""
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
            key.append((type(op), tuple(op.shape), tuple(op.stride()), op.dtype,
                        op.device, op.requires_grad, alias))
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


@contextlib.contextmanager
def cached_subgraph_schemas() -> Iterator[None]:
    """Within: ``invoke_subgraph``'s ``gen_schema`` is memoized per subgraph, identifier
    and operand metadata (see the module docstring; checked on torch 2.11 and 2.15), so
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


@contextlib.contextmanager
def recomputable_reductions() -> Iterator[None]:
    """Within: AOTAutograd's min-cut partitioner may recompute reductions in the backward
    (``torch._functorch.config.ban_recompute_reductions = False``; see the module
    docstring; checked on torch 2.11 and 2.15); restored on exit. A no-op where the option
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


@contextlib.contextmanager
def flat_nested_subgraph_refs() -> Iterator[None]:
    """Within: when AOTAutograd's tracer (``PythonKeyTracer``) emits a ``get_attr`` of a
    graph module it finds only under a dotted name (a region's backward subgraph registered
    inside another's: ``repeated_subgraph16.repeated_subgraph1``), the node refers to a
    top-level alias of that module instead; ``create_node`` reads the target back with a
    plain ``getattr``, which raised AttributeError for the dotted name (a region nested in
    another: timm's LeViT, ResNeXt, FastViT; checked on torch 2.11 and 2.15); restored on
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
