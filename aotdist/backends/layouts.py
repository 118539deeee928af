"""Call sites of a region that differ only in an input's layout share one subgraph.

Dynamo traces a region's body anew when a call site passes an input whose strides differ
from an earlier call's, and keeps the new body as another subgraph even when its ops are
the same (it compares bodies with their inputs' strides). CaiT's class-attention blocks
are the common case: the first is handed the class token expanded over the batch (stride
0), the second the first's output. This Dynamo-graph pass finds the subgraphs of a graph
whose bodies are the same ops on inputs of the same shapes, dtypes and ``requires_grad``,
and points every call of the lesser-used ones at the subgraph most call sites use, with
each input whose layout differs first copied into that subgraph's layout (contiguous or
channels_last). Only inputs that need a gradient are copied (no region writes those), so
the values every op sees, the outputs and the gradients are eager's; only the call sites
that differed pay the copy. A body that reads its inputs' memory (``as_strided``,
storages, data pointers), or calls whose outputs' layouts differ, are left as they are.
"""

from __future__ import annotations

import torch
from torch import fx

from aotdist import _compat
from aotdist.log import get_logger

__all__ = ["merge_layout_variants"]

_log = get_logger(__name__)
# ops whose result depends on an input's memory, not only on its values
_MEMORY_READERS = ("as_strided", "storage", "data_ptr", "stride", "view_as_real")


def merge_layout_variants(gm: fx.GraphModule) -> list[str]:
    """Rewrites the region calls of ``gm``'s own graph in place; returns the subgraphs
    some or all of whose calls now go to another one."""
    calls: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if _is_invoke(node) and node.args[0].op == "get_attr":
            calls.setdefault(str(node.args[0].target), []).append(node)
    groups: list[list[str]] = []
    for name in calls:
        body = gm.get_submodule(name)
        group = next((g for g in groups if _same_ops(gm.get_submodule(g[0]), body)), None)
        if group is None:
            groups.append([name])
        else:
            group.append(name)
    merged: list[str] = []
    getters = {c.args[0] for cs in calls.values() for c in cs}
    for group in groups:
        if len(group) < 2:
            continue
        # the most called, of those with the fewest inputs in no standard layout
        target = min(
            group,
            key=lambda n: (
                -len(calls[n]),
                sum(_layout(p) is None for p in _placeholders(gm.get_submodule(n))),
            ),
        )
        inputs = _placeholders(gm.get_submodule(target))
        outputs = _value(calls[target][0])
        for name in group:
            if name == target:
                continue
            rewritten = [
                c
                for c in calls[name]
                if _same_outputs(_value(c), outputs) and _redirect(c, calls[target][0], inputs)
            ]
            if rewritten:
                merged.append(name)
    if merged:
        for getter in getters:
            if not getter.users:  # not dead-code elimination:
                gm.graph.erase_node(getter)  # it would drop unused in-place updates too
        gm.recompile()
        _log.debug("region subgraphs merged across input layouts: %s", merged)
    return merged


def _is_invoke(node: fx.Node) -> bool:
    return (
        node.op == "call_function" and getattr(node.target, "__name__", None) == "invoke_subgraph"
    )


def _placeholders(body: fx.GraphModule) -> list[fx.Node]:
    return [n for n in body.graph.nodes if n.op == "placeholder"]


def _value(node: fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def _tensor_kind(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.device, t.requires_grad, type(t))


def _same_ops(a: fx.GraphModule, b: fx.GraphModule) -> bool:
    """Whether ``a`` and ``b`` run the same ops on the same arguments, with placeholders
    of the same kind (strides aside), and neither reads its inputs' memory."""
    a_nodes, b_nodes = list(a.graph.nodes), list(b.graph.nodes)
    if len(a_nodes) != len(b_nodes):
        return False
    mapping: dict[fx.Node, fx.Node] = {}

    def same(x, y) -> bool:
        if isinstance(x, fx.Node):
            return isinstance(y, fx.Node) and mapping.get(x) is y
        if isinstance(x, (list, tuple)):
            return (
                type(x) is type(y)
                and len(x) == len(y)
                and all(same(i, j) for i, j in zip(x, y, strict=True))
            )
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, slice):
            return isinstance(y, slice) and same(
                (x.start, x.stop, x.step), (y.start, y.stop, y.step)
            )
        if isinstance(x, torch.Tensor):  # a constant tensor: the same object only
            return x is y
        if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return type(x) is type(y) and str(x) == str(y)  # no guard from comparing
        return type(x) is type(y) and x == y

    for x, y in zip(a_nodes, b_nodes, strict=True):
        if x.op != y.op or (x.op != "placeholder" and x.target != y.target):
            return False
        name = getattr(x.target, "__name__", str(x.target))
        if name.startswith("resize_storage_bytes_"):  # sizes a storage, reads no layout:
            if not _same_layout(x.args[0], mapping.get(x.args[0])):  # only one's that differs
                return False
        elif name.split(".")[0] == "set_" or any(r in name for r in _MEMORY_READERS):
            return False
        if x.op == "placeholder":
            vx, vy = _value(x), _value(y)
            if isinstance(vx, torch.Tensor) != isinstance(vy, torch.Tensor):
                return False
            if isinstance(vx, torch.Tensor):
                if _tensor_kind(vx) != _tensor_kind(vy):
                    return False
            elif not same(vx, vy):
                return False
        elif not (same(x.args, y.args) and same(x.kwargs, y.kwargs)):
            return False
        mapping[x] = y
    return True


def _same_layout(a: object, b: object) -> bool:
    va, vb = (_value(n) if isinstance(n, fx.Node) else None for n in (a, b))
    return (
        isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.stride() == vb.stride()
    )


def _layout(node: fx.Node) -> torch.memory_format | None:
    """The memory format a placeholder's example value is laid out in, if it is one."""
    value = _value(node)
    if not isinstance(value, torch.Tensor):
        return None
    if value.is_contiguous():
        return torch.contiguous_format
    if value.dim() == 4 and value.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return None


def _same_outputs(a, b) -> bool:
    """Whether two calls' outputs match in kind and strides (later ops saw one layout)."""
    a, b = _compat.tree_leaves(a), _compat.tree_leaves(b)
    return len(a) == len(b) and all(
        (_tensor_kind(x), x.stride()) == (_tensor_kind(y), y.stride())
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        else not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor)
        for x, y in zip(a, b, strict=True)
    )


def _redirect(call: fx.Node, model: fx.Node, inputs: list[fx.Node]) -> bool:
    """Points ``call`` at the subgraph ``model`` calls, copying each input whose layout
    differs from that subgraph's (``inputs``: its placeholders) into its layout; ``False``
    (and nothing changed) where an input cannot be: it needs no gradient, or the layout
    is neither format."""
    args = list(call.args)
    if len(args) - 2 != len(inputs):
        return False
    copies: list[tuple[int, torch.memory_format]] = []
    for i, (arg, placeholder) in enumerate(zip(args[2:], inputs, strict=True)):
        value = _value(arg) if isinstance(arg, fx.Node) else None
        layout = _layout(placeholder)
        if not isinstance(value, torch.Tensor) or value.stride() == _value(placeholder).stride():
            continue
        if layout is not None and value.is_contiguous(memory_format=layout):
            continue
        if layout is None or not value.requires_grad:
            return False
        copies.append((i, layout))
    fake_mode = _compat.fake_mode_of([_value(a) for a in args[2:] if isinstance(a, fx.Node)])
    if fake_mode is None:
        return False
    graph = call.graph
    with graph.inserting_before(call):
        args[0] = graph.get_attr(model.args[0].target)
        args[1] = model.args[1]
        for i, layout in copies:
            source = args[2 + i]
            kwargs = {} if layout is torch.contiguous_format else {"memory_format": layout}
            copy = graph.call_method("contiguous", (source,), kwargs)
            copy.meta.update(
                {
                    k: v
                    for k, v in call.meta.items()
                    if k in ("nn_module_stack", "stack_trace", "source_fn_stack")
                }
            )
            with fake_mode:
                copy.meta["example_value"] = _value(source).contiguous(memory_format=layout)
            args[2 + i] = copy
    call.args = tuple(args)
    return True
