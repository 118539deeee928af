"""Call sites of a region that differ only in an input's layout share one subgraph.

Dynamo traces a region's body anew when a call site passes an input whose strides differ
from an earlier call's (CaiT's class token expanded over the batch, Flux's blocks handed
slices of a joined tensor), and keeps it as another subgraph even when its ops are the
same; it also drops the outputs no later op reads (the last block's). This Dynamo-graph
pass finds the subgraphs of a graph whose bodies are the same ops on inputs of the same
shapes, dtypes and ``requires_grad``, and points every call at one that returns every
output, with each input whose layout differs first copied into that subgraph's layout
(contiguous or channels_last; contiguous for every call where none is in either). Only
inputs that need a gradient are copied (no region writes those), so the values every op
sees, the outputs and the gradients are eager's. A body that reads its inputs' memory
(``as_strided``, storages, data pointers), or calls whose outputs differ, are left as
they are.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from aotdist import _compat
from aotdist.log import get_logger

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
        group = next(
            (g for g in groups if _same_ops(gm.get_submodule(g[0]), body, outputs=False)), None
        )
        if group is None:
            groups.append([name])
        else:
            group.append(name)
    merged: list[str] = []
    getters = {c.args[0] for cs in calls.values() for c in cs}
    for group in groups:
        if len(group) < 2:
            continue
        # of those that return every output the others do (Dynamo drops the outputs no
        # later op reads: the last of Flux's single blocks returns one of two), one with
        # the fewest inputs in no standard layout (the others' are copied into its), of
        # those the most called
        bodies = {n: gm.get_submodule(n) for n in group}
        covering = [
            t for t in group if all(_output_map(bodies[t], bodies[n]) is not None for n in group)
        ]
        if not covering:
            continue
        target = min(
            covering,
            key=lambda n: (
                sum(_layout(p) is None for p in _placeholders(bodies[n])),
                -len(calls[n]),
            ),
        )
        inputs = _placeholders(bodies[target])
        layouts = [_layout(p) for p in inputs]
        # an input in no standard layout in any of them, whose strides differ (a slice
        # of a joined tensor in one, a transpose in another: HunyuanVideo's single
        # blocks): every call gets it contiguous, the target's own calls too
        loose = [
            i
            for i, p in enumerate(inputs)
            if layouts[i] is None and len({_stride(_placeholders(bodies[n])[i]) for n in group}) > 1
        ]
        for i in loose:
            layouts[i] = torch.contiguous_format
        outputs = _value(calls[target][0])
        # the others first; the target's own calls get their copies only if one merged
        before = len(merged)
        for name in [n for n in group if n != target] + [target]:
            if name == target and not (loose and len(merged) > before):
                continue
            index = _output_map(bodies[target], bodies[name])
            rewritten = [
                c
                for c in calls[name]
                if _same_outputs(_value(c), [outputs[i] for i in index], strides=not loose)
                and _redirect(c, calls[target][0], inputs, index, layouts)
            ]
            if rewritten and name != target:
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


def _output_map(a: fx.GraphModule, b: fx.GraphModule) -> list[int] | None:
    """For bodies of the same ops: the position in ``a``'s outputs of each of ``b``'s, or
    ``None`` where ``b`` returns a value ``a`` does not."""
    nodes_a, nodes_b = list(a.graph.nodes), list(b.graph.nodes)
    at_a = {n: i for i, n in enumerate(nodes_a)}  # the same ops: node i of a is node i of b
    at_b = {n: i for i, n in enumerate(nodes_b)}
    returned = {at_a[v]: k for k, v in enumerate(_outputs(nodes_a[-1])) if v is not None}
    index = [returned.get(at_b.get(v)) for v in _outputs(nodes_b[-1])]
    return None if any(i is None for i in index) else index


def _outputs(output: fx.Node) -> list[fx.Node]:
    values = output.args[0]
    values = values if isinstance(values, (list, tuple)) else [values]
    return [v if isinstance(v, fx.Node) else None for v in values]


def _same_ops(a: fx.GraphModule, b: fx.GraphModule, *, outputs: bool = True) -> bool:
    """Whether ``a`` and ``b`` run the same ops on the same arguments, with placeholders
    of the same kind (strides aside), and neither reads its inputs' memory; without
    ``outputs``, whichever of their values they return."""
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
        if x.op == y.op == "output" and not outputs:
            return all(isinstance(v, fx.Node) for v in _outputs(x) + _outputs(y))
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


def _stride(node: fx.Node) -> tuple | None:
    value = _value(node)
    return value.stride() if isinstance(value, torch.Tensor) else None


def _same_outputs(a, b, *, strides: bool = True) -> bool:
    """Whether two calls' outputs match in kind and (``strides``) strides: later ops saw
    one layout. Not the strides where every call's input is made contiguous: AOTAutograd
    traces the graph again from the inputs' layouts."""
    a, b = _compat.tree_leaves(a), _compat.tree_leaves(b)
    return len(a) == len(b) and all(
        (_tensor_kind(x), x.stride() if strides else None)
        == (_tensor_kind(y), y.stride() if strides else None)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        else not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor)
        for x, y in zip(a, b, strict=True)
    )


def _redirect(
    call: fx.Node,
    model: fx.Node,
    inputs: list[fx.Node],
    index: list[int] | None = None,
    layouts: list | None = None,
) -> bool:
    """Points ``call`` at the subgraph ``model`` calls, copying each input whose layout
    differs from that subgraph's (``inputs``: its placeholders; ``layouts``: the layout
    each is to have, default the placeholder's) into that layout, and
    reading its ``k``-th output at ``index[k]`` of that subgraph's; ``False`` (and nothing
    changed) where an input cannot be copied (it needs no gradient, or the layout is
    neither format) or an output is read otherwise than by index."""
    args = list(call.args)
    if len(args) - 2 != len(inputs):
        return False
    width = len(_compat.tree_leaves(_value(model)))
    remap = index is not None and (index != list(range(len(index))) or len(index) != width)
    reads = list(call.users)
    if remap and any(u.target is not operator.getitem or u.args[0] is not call for u in reads):
        return False
    copies: list[tuple[int, torch.memory_format]] = []
    layouts = layouts or [_layout(p) for p in inputs]
    for i, (arg, placeholder) in enumerate(zip(args[2:], inputs, strict=True)):
        value = _value(arg) if isinstance(arg, fx.Node) else None
        layout = layouts[i]
        if not isinstance(value, torch.Tensor):
            continue
        if value.stride() == _stride(placeholder) and layout == _layout(placeholder):
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
    if remap:
        for read in reads:  # its outputs where the subgraph called now returns them
            read.args = (call, index[read.args[1]])
        full = list(_value(model))
        for k, value in enumerate(_value(call)):
            full[index[k]] = value
        call.meta["example_value"] = tuple(full)
    return True
