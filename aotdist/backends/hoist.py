"""Buffer updates that need no gradient leave the region: applied by the caller after it.

``invoke_subgraph`` refuses a subgraph that mutates an input in training ("does not
currently support training with in-place input or buffer mutations"), so a block that
counts or accumulates into a buffer (torchtitan's MoE tokens-per-expert count, a running
average) was demoted. This Dynamo-graph pass moves such an update out of the subgraph: the
update's tensor operands become extra outputs of the subgraph, and each call site applies
the same in-place op to its own buffer right after the call. It acts only where nothing
changes: the buffer and the operands need no gradient, the op's result is unused, and the
subgraph reads the buffer no more after the update, so every value the region computes,
and the buffer after the call, are as eager's. Anything else stays, and demotes as before.
Nested regions are handled from the innermost out.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from aotdist.log import get_logger

__all__ = ["hoist_buffer_updates"]

_log = get_logger(__name__)
_IN_PLACE_OPERATORS = {operator.iadd: "add_", operator.isub: "sub_", operator.imul: "mul_",
                       operator.itruediv: "div_"}
# in-place draws: moved after the call, they would take other numbers from the RNG stream
_RANDOM = {"bernoulli_", "cauchy_", "exponential_", "geometric_", "log_normal_", "normal_",
           "random_", "uniform_"}


@dataclass(frozen=True)
class _Update:
    """An in-place op on the subgraph's input ``index``; tensor operands are the extra
    outputs ``outputs`` (in order), other arguments kept as they are."""

    method: str
    index: int
    args: tuple  # each: ("out", k) for an extra output, ("input", j) for input j, or a value
    kwargs: dict


def hoist_buffer_updates(gm: fx.GraphModule) -> list[str]:
    """Rewrites ``gm``'s region subgraphs in place; returns the subgraphs changed."""
    changed: list[str] = []
    bodies: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if _is_invoke(node) and node.args[0].op == "get_attr":
            bodies.setdefault(node.args[0].target, []).append(node)
    for name, calls in bodies.items():
        body = gm.get_submodule(name)
        changed += [f"{name}.{n}" for n in hoist_buffer_updates(body)]  # innermost first
        updates = _take_updates(body)
        if not updates:
            continue
        updated = {u.index for u in updates}
        inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
        unused = {i for i in updated if not inputs[i].users}
        for call in calls:
            _apply_after(gm.graph, call, updates)
            _pass_updated_inputs(gm.graph, call, updated, unused)
        for i in sorted(unused, reverse=True):
            body.graph.erase_node(inputs[i])
        body.recompile()
        changed.append(name)
    if changed:
        gm.recompile()
        _log.debug("buffer updates applied after the region call: %s", changed)
    return changed


def _is_invoke(node: fx.Node) -> bool:
    return (node.op == "call_function"
            and getattr(node.target, "__name__", None) == "invoke_subgraph")


def _in_place(node: fx.Node) -> str | None:
    """The in-place method ``node`` calls, if any."""
    if (node.op == "call_method" and node.target.endswith("_")
            and not node.target.startswith("_") and node.target not in _RANDOM):
        return node.target
    if node.op == "call_function":
        return _IN_PLACE_OPERATORS.get(node.target)
    return None


def _needs_grad(value: object) -> bool:
    if not isinstance(value, fx.Node):
        return False
    example = value.meta.get("example_value")
    return not isinstance(example, torch.Tensor) or example.requires_grad


def _take_updates(body: fx.GraphModule) -> list[_Update]:
    """Removes the hoistable updates from ``body``, adds their operands as its last
    outputs (the existing results keep their indices); returns the updates."""
    graph = body.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    inputs = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    results = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else None
    if results is None:
        return []
    before, updates, extra = len(results), [], []
    for node in nodes:
        method = _in_place(node)
        if method is None or not node.args or node.users:
            continue
        target = node.args[0]
        if (not isinstance(target, fx.Node) or target.op != "placeholder" or _needs_grad(target)
                or any(order[u] > order[node] for u in target.users if u is not node)
                or any(_needs_grad(a) for a in (*node.args[1:], *node.kwargs.values())
                       if isinstance(a, fx.Node))
                or any(isinstance(a, (list, tuple, dict)) for a in
                       (*node.args[1:], *node.kwargs.values()))):
            continue

        def operand(a, _node=node):
            if not isinstance(a, fx.Node):
                return a
            if a.op == "placeholder":
                return ("input", inputs.index(a))
            with graph.inserting_before(_node):  # a copy: an output may not alias an input
                extra.append(graph.call_method("clone", (a,)))
                extra[-1].meta.update(a.meta)
            return ("out", before + len(extra) - 1)

        args = tuple(operand(a) for a in node.args[1:])
        kwargs = {k: operand(v) for k, v in node.kwargs.items()}
        updates.append(_Update(method, inputs.index(target), args, kwargs))
        graph.erase_node(node)
    if updates:
        output.args = (tuple(results + extra),)
        graph.lint()
    return updates


def _apply_after(graph: fx.Graph, call: fx.Node, updates: list[_Update]) -> None:
    """After ``call`` and its results, each update applied to the call site's own input,
    its operands detached (torch 2.11 marks every subgraph output as needing grad)."""
    cursor = call
    while cursor.next.op == "call_function" and cursor.next.args[:1] == (call,):
        cursor = cursor.next  # the getitems of the results
    operands = call.args[2:]
    body_outputs = _example_outputs(call)

    def insert(op: str, target, args, kwargs=None, example=None) -> fx.Node:
        nonlocal cursor
        with graph.inserting_after(cursor):
            cursor = graph.create_node(op, target, args, kwargs or {})
        if example is not None:
            cursor.meta["example_value"] = example
        return cursor

    def value(a):
        if isinstance(a, tuple) and len(a) == 2 and a[0] == "out":
            example = body_outputs[a[1]] if a[1] < len(body_outputs) else None
            item = insert("call_function", operator.getitem, (call, a[1]), example=example)
            return insert("call_method", "detach", (item,), example=example)
        if isinstance(a, tuple) and len(a) == 2 and a[0] == "input":
            return operands[a[1]]
        return a

    for update in updates:
        args = tuple(value(a) for a in update.args)
        kwargs = {k: value(v) for k, v in update.kwargs.items()}
        target = operands[update.index]
        insert("call_method", update.method, (target, *args), kwargs,
               example=target.meta.get("example_value"))


def _pass_updated_inputs(graph: fx.Graph, call: fx.Node, updated: set[int],
                         unused: set[int]) -> None:
    """The call no longer passes an updated input the subgraph stopped reading, and passes
    a copy of one it still reads (the subgraph saves its inputs for backward, and the
    update after the call would change what it saved)."""
    args = list(call.args)
    for i in sorted(updated, reverse=True):
        if i in unused:
            del args[2 + i]
            continue
        with graph.inserting_before(call):
            copy = graph.call_method("clone", (args[2 + i],))
        copy.meta.update(args[2 + i].meta)
        args[2 + i] = copy
    call.args = tuple(args)


def _example_outputs(call: fx.Node) -> list:
    """The example values of the subgraph's outputs (its output node's), for new nodes."""
    body = call.graph.owning_module.get_submodule(call.args[0].target)
    output = next(n for n in body.graph.nodes if n.op == "output")
    return [a.meta.get("example_value") if isinstance(a, fx.Node) else None
            for a in output.args[0]]
