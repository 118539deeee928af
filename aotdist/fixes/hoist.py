"""Buffer updates that need no gradient leave the region: applied by the caller after it.

``invoke_subgraph`` refuses a subgraph that mutates an input in training, so a block that
counts or accumulates into a buffer (MoE token counts, BatchNorm's running statistics)
was demoted. This Dynamo-graph pass takes such updates out: an in-place op whose result
is unused and after which the buffer is not read again moves to each call site, right
after the call; any other write to an input that needs no gradient runs, as written, on a
copy made at the start of the subgraph, which each call site writes back into its own
buffer. Storage resizes of such an input at the region's edges (grown before its first
use, freed after its last: FSDP's pattern on a buffer) move around each call; a subgraph
that resizes an input elsewhere, or writes one whose storage is empty at the call, is
left alone (torch refuses it, and the region is demoted with a warning). Every value the
region computes, and the buffer after the call, are as eager's; nested regions are
handled innermost first.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from aotdist import _compat
from aotdist.log import get_logger

_log = get_logger(__name__)
_IN_PLACE_OPERATORS = {
    operator.iadd: "add_",
    operator.isub: "sub_",
    operator.imul: "mul_",
    operator.itruediv: "div_",
}
# in-place draws: moved after the call, they would take other numbers from the RNG stream
_RANDOM = {
    "bernoulli_",
    "cauchy_",
    "exponential_",
    "geometric_",
    "log_normal_",
    "normal_",
    "random_",
    "uniform_",
}


@dataclass(frozen=True)
class _Resizes:
    """Storage resizes of inputs at the subgraph's edges, taken out of it: ``before`` the
    call and ``after`` it, each ``(input index, target, nbytes)`` in program order."""

    before: list[tuple[int, object, int]]
    after: list[tuple[int, object, int]]

    def inputs(self) -> set[int]:
        return {i for i, _, _ in (*self.before, *self.after)}


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
    bodies: dict[int, tuple[fx.GraphModule, str, list[fx.Node]]] = {}
    order: list[int] = []
    _collect_calls(gm, bodies, order)
    recomputed = {id(g.graph) for g in _graphs_calling_regions(gm)[1:]}
    changed: list[str] = []
    touched: dict[int, fx.GraphModule] = {}
    for key in order:  # innermost first: an inner body's writes become its caller's
        body, name, calls = bodies[key]
        resizes = _take_edge_resizes(
            body, name, recomputed=any(id(c.graph) in recomputed for c in calls)
        )
        if resizes is None:  # not safe to rewrite: torch decides, as without this pass
            continue
        updates = _take_updates(body)
        copied = _copy_written_inputs(body)
        if not updates and not copied and not resizes.inputs():
            continue
        updated = {u.index for u in updates} | set(copied) | resizes.inputs()
        inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
        unused = {i for i in updated if not inputs[i].users}
        for call in calls:  # every call site, in whichever graph it sits
            _resize_before(call, resizes.before)
            _apply_after(call.graph, call, updates, copied, resizes.after)
            _pass_updated_inputs(call.graph, call, updated, unused)
            owner = call.graph.owning_module
            touched[id(owner)] = owner
        for i in sorted(unused, reverse=True):
            body.graph.erase_node(inputs[i])
        body.recompile()
        changed.append(name)
    for owner in touched.values():
        owner.recompile()
    if changed:
        _log.debug("buffer updates applied after the region call: %s", changed)
    return changed


def _collect_calls(gm: fx.GraphModule, bodies: dict, order: list[int]) -> None:
    """Every region call under ``gm`` (nested regions included), grouped by the subgraph
    called; ``order`` lists the subgraphs innermost first, each once, however many graphs
    call it."""
    for owner in _graphs_calling_regions(gm):
        for node in owner.graph.nodes:
            if not (_is_invoke(node) and node.args[0].op == "get_attr"):
                continue
            body = owner.get_submodule(node.args[0].target)
            if id(body) not in bodies:
                bodies[id(body)] = (body, node.args[0].target, [])
                _collect_calls(body, bodies, order)
                order.append(id(body))
            bodies[id(body)][2].append(node)


def _graphs_calling_regions(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """``gm`` and the bodies of the other higher-order ops it calls, at any depth (the
    region call of an instance under activation checkpointing sits in the body of a
    ``tag_activation_checkpoint``), not the region bodies themselves."""
    found = [gm]
    for node in gm.graph.nodes:
        if node.op == "get_attr" and any(
            u.op == "call_function" and not _is_invoke(u) for u in node.users
        ):
            sub = gm.get_submodule(str(node.target))
            if isinstance(sub, fx.GraphModule):
                found += _graphs_calling_regions(sub)
    return found


def _is_invoke(node: fx.Node) -> bool:
    return (
        node.op == "call_function" and getattr(node.target, "__name__", None) == "invoke_subgraph"
    )


def _in_place(node: fx.Node) -> str | None:
    """The in-place method ``node`` calls, if any."""
    if (
        node.op == "call_method"
        and node.target.endswith("_")
        and not node.target.startswith("_")
        and node.target not in _RANDOM
    ):
        return node.target
    if node.op == "call_function":
        return _IN_PLACE_OPERATORS.get(node.target)
    return None


def _needs_grad(value: object) -> bool:
    if not isinstance(value, fx.Node):
        return False
    example = value.meta.get("example_value")
    return not isinstance(example, torch.Tensor) or example.requires_grad


def _storage_bytes(value: object) -> int | None:
    try:
        return value.untyped_storage().nbytes() if isinstance(value, torch.Tensor) else None
    except (RuntimeError, NotImplementedError):  # a tensor without storage: not known
        return None


def _take_edge_resizes(body: fx.GraphModule, name: str, *, recomputed: bool) -> _Resizes | None:
    """Removes the storage resizes of inputs that come before every other use of the input
    or after every one, and returns them; ``None`` (``body`` unchanged) when rewriting
    the subgraph's buffer writes is not safe: an input resized between its uses, by a
    size computed in the subgraph, one that needs a gradient, an input written whose
    storage is empty when the subgraph starts (a copy of it would read freed memory), or
    any resize where a call site is recomputed in backward (activation checkpointing: the
    recomputed call would copy a buffer whose storage the moved resize freed)."""
    graph = body.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    inputs = [n for n in nodes if n.op == "placeholder"]
    before, after, edge = [], [], []
    for node in nodes:
        if not _compat.is_storage_resize(node):
            continue
        target, nbytes = node.args[0], node.args[1] if len(node.args) > 1 else None
        if (
            recomputed
            or not isinstance(target, fx.Node)
            or target.op != "placeholder"
            or _needs_grad(target)
            or not isinstance(nbytes, int)
        ):
            _log.debug("subgraph %s resizes a storage it cannot move: left alone", name)
            return None
        uses = [u for u in target.users if not _compat.is_storage_resize(u)]
        index = inputs.index(target)
        if all(order[u] > order[node] for u in uses):
            before.append((index, node.target, nbytes))
        elif all(order[u] < order[node] for u in uses):
            after.append((index, node.target, nbytes))
        else:
            _log.debug("subgraph %s resizes input %d between its uses: left alone", name, index)
            return None
        edge.append(node)
    grown = {i for i, _, nbytes in before if nbytes > 0}
    for i, node in enumerate(inputs):  # any copy the pass makes reads the storage at the call
        if i not in grown and node.users and _storage_bytes(node.meta.get("example_value")) == 0:
            _log.debug("subgraph %s uses input %d, empty at the call: left alone", name, i)
            return None
    for node in edge:
        graph.erase_node(node)
    if edge:
        graph.lint()
        body.recompile()
    return _Resizes(before, after)


def _resize_before(call: fx.Node, resizes: list) -> None:
    """The resizes moved from the subgraph's start, applied to the call site's own inputs
    right before ``call``."""
    for index, target, nbytes in resizes:
        with call.graph.inserting_before(call):
            call.graph.call_function(target, (call.args[2 + index], nbytes))


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
        if (
            not isinstance(target, fx.Node)
            or target.op != "placeholder"
            or _needs_grad(target)
            or any(order[u] > order[node] for u in target.users if u is not node)
            or any(
                _needs_grad(a)
                for a in (*node.args[1:], *node.kwargs.values())
                if isinstance(a, fx.Node)
            )
            or any(
                isinstance(a, (list, tuple, dict)) for a in (*node.args[1:], *node.kwargs.values())
            )
        ):
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


def _written_inputs(body: fx.GraphModule) -> list[int]:
    """The inputs of ``body`` that need no gradient and that running it writes in place:
    an op writes their storage (as its schema declares) when the subgraph runs once on
    fake copies of its example inputs (exact whatever op writes them, ``F.batch_norm``'s
    running statistics included; empty when it cannot run so)."""
    inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
    examples = [n.meta.get("example_value") for n in inputs]
    candidates = [
        i
        for i, e in enumerate(examples)
        if isinstance(e, torch.Tensor) and not e.requires_grad and inputs[i].users
    ]
    mode = _compat.fake_mode_of(examples) if candidates else None
    if mode is None:
        return []
    try:
        # a .tolist() run here (an MoE's split sizes) makes unbacked symbols no trace binds
        with mode, torch.no_grad(), _compat.fresh_unbacked_ignored(mode):
            args = [e.clone() if isinstance(e, torch.Tensor) else e for e in examples]
            with _compat.recorded_writes() as writes:
                fx.Interpreter(body).run(*args)
    except Exception as exc:  # noqa: BLE001 - not runnable so: left to torch, as before
        _log.debug("subgraph not run on fake inputs (%s): its writes stay", exc)
        return []
    return [i for i in candidates if writes.wrote(args[i])]


def _copy_written_inputs(body: fx.GraphModule) -> dict[int, int]:
    """Makes each input :func:`_written_inputs` finds a copy at the start of ``body``, read
    and written by the subgraph in its place, and returned as an extra output; returns
    input index -> output index."""
    graph = body.graph
    output = next(n for n in graph.nodes if n.op == "output")
    written = _written_inputs(body) if isinstance(output.args[0], (tuple, list)) else []
    if not written:
        return {}
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    results = list(output.args[0])
    copied = {}
    for i in written:
        with graph.inserting_after(inputs[-1]):
            copy = graph.call_method("clone", (inputs[i],))
        copy.meta.update(inputs[i].meta)
        inputs[i].replace_all_uses_with(copy, delete_user_cb=lambda user, c=copy: user is not c)
        copied[i] = len(results)
        results.append(copy)
    output.args = (tuple(results),)
    graph.lint()
    body.recompile()
    return copied


def _apply_after(
    graph: fx.Graph, call: fx.Node, updates: list[_Update], copied: dict[int, int], resizes: list
) -> None:
    """After ``call`` and its results, each update applied to the call site's own input,
    its operands detached (torch 2.11 marks every subgraph output as needing grad), each
    copied input's final value written back into the call site's own input, then the
    resizes moved from the subgraph's end."""
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
        insert(
            "call_method",
            update.method,
            (target, *args),
            kwargs,
            example=target.meta.get("example_value"),
        )
    for index, out in copied.items():
        target = operands[index]
        insert(
            "call_method",
            "copy_",
            (target, value(("out", out))),
            example=target.meta.get("example_value"),
        )
    for index, target, nbytes in resizes:
        insert("call_function", target, (operands[index], nbytes))


def _pass_updated_inputs(
    graph: fx.Graph, call: fx.Node, updated: set[int], unused: set[int]
) -> None:
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
    return [a.meta.get("example_value") if isinstance(a, fx.Node) else None for a in output.args[0]]
