"""Dynamo's ``invoke_subgraph`` dedup: a scoped fix for a crash that costs region reuse.

When Dynamo traces a region at a second call site it compares the new body with the
subgraphs already installed (``are_same_graph_modules`` in
``torch._dynamo.variables.higher_order_ops``, checked on torch 2.11 and 2.15) and reuses
one that matches. The comparison reads ``node.meta["example_value"]`` of every
placeholder, recursing into nested graph modules. The backward body of an
``autograd.Function`` traced inside the region has placeholders for the unused backward
inputs that carry no ``example_value``: the comparison raises ``KeyError``, Dynamo fails
the frame, and aotdist must inline the region (correct, no reuse). Graph-mode FSDP's
gather (an ``autograd.Function`` whose backward reduce-scatters) hits it on torch 2.11,
where the region is re-traced at each call site; 2.15 reuses the first trace and never
compares.

:func:`tolerant_subgraph_dedup` wraps the comparison, for the duration of a compiled call,
so that a placeholder without ``example_value`` at the same position on both sides and
*without users* compares equal (nothing in the body reads it; its value comes from the
outer call's arguments, which the comparison checks), and any other missing
``example_value`` compares unequal (a new subgraph, no crash). Where the comparison
function does not exist the context manager does nothing.

The same comparison requires every ``call_function`` target to be the *same object*. torch
2.11 traces an allowed-in-graph ``autograd.Function.apply`` (torchao ``Float8Linear``'s
matmul) as a fresh ``trampoline_autograd_apply`` closure per trace, which only calls
``fn_cls.apply``: two such trampolines of one ``fn_cls`` at the same position compare
equal within the wrapper, so a Float8 region is one subgraph, not one per call site.

:func:`cached_subgraph_schemas` removes a per-call-site cost of AOTAutograd. Before
tracing a higher-order op under autograd, ``HigherOrderOperator``'s autograd kernel asks
the op for its schema to refuse input mutation in training (``gen_schema``, checked on
torch 2.11 and 2.15); ``invoke_subgraph``'s ``gen_schema`` re-traces the whole region body
to build it. AOTAutograd meets every call site twice (metadata collection, joint trace),
so a depth-32 model re-traced its one block body 64 times. Within the context manager the
schema is memoized per (subgraph object, identifier, operand metadata): call sites of
one region with the same argument shapes, strides, dtypes, devices, ``requires_grad`` and
aliasing get the schema of the first, as torch's own functionalization schema cache
(pytorch/pytorch#184646) already does keyed on operand types alone.

:func:`recomputable_reductions` lets AOTAutograd's min-cut partitioner recompute
reductions (``torch._functorch.config.ban_recompute_reductions``, checked on torch 2.11 and
2.15) while a graph holding regions compiles. A region body is partitioned on its own and
its input arrives materialized, so under torch's default it saves that input plus each
norm's mean and rstd, one per-row statistic more per norm than a whole-model partition
(see :mod:`aotdist.backends.recording`).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator

__all__ = ["cached_subgraph_schemas", "recomputable_reductions", "tolerant_subgraph_dedup"]

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
