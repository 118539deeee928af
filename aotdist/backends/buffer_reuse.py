"""An Inductor post-grad pass that makes buffer reuse safe around reused regions.

A reused region's partitioned forward may return one of its own *inputs* as an
activation saved for backward; Inductor's outer graph then counts the argument dead after
the call and may reuse its storage, overwriting the saved activation (a torch bug: wrong
gradients). :func:`forward_aliased_outputs` makes the outer graph use the argument itself
(or a replay of the view chain that produced the output) wherever it used that output, so
Inductor keeps the argument alive; where it cannot replay a view exactly, it turns buffer
reuse off for that graph. :func:`reuse_pass` wraps it as a post-grad pass, which runs on
every graph Inductor compiles, region subgraphs included. Details: docs/internals.md.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch

from aotdist import _compat


@dataclass
class AliasReport:
    """What :func:`forward_aliased_outputs` found in one graph.

    Attributes:
        forwarded: Names of the ``getitem`` nodes replaced by the outer argument.
        replayed: Names of the ``getitem`` nodes that are views of an argument, replaced
            by the same views of the outer argument.
        views: Names of the ``getitem`` nodes that are views of an argument and could not
            be replayed (not rewritten; buffer reuse must stay off for this graph).
    """

    forwarded: list[str] = field(default_factory=list)
    replayed: list[str] = field(default_factory=list)
    views: list[str] = field(default_factory=list)


def _submodule(gm: torch.nn.Module, target: str) -> torch.nn.Module | None:
    mod = gm
    for part in target.split("."):
        mod = getattr(mod, part, None)
        if mod is None:
            return None
    return mod


def _view_chain(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """``[placeholder, view_1, ..., node]`` where ``node`` is a chain of view ops of a
    placeholder, else ``None``."""
    chain = []
    while (
        node.op == "call_function"
        and getattr(node.target, "is_view", False)
        and node.args
        and isinstance(node.args[0], torch.fx.Node)
    ):
        chain.append(node)
        node = node.args[0]
    return [node, *reversed(chain)] if node.op == "placeholder" and chain else None


def _same_layout(a, b) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.storage_offset() == b.storage_offset()
    )


def _replay_view(
    graph: torch.fx.Graph, base: torch.fx.Node, views: list[torch.fx.Node], getitem: torch.fx.Node
) -> torch.fx.Node | None:
    """``views`` (view ops of a region placeholder) applied to the outer argument
    ``base`` before ``getitem``; ``None`` (nothing inserted) unless every view takes
    constant arguments only and the result has the getitem's size, stride and offset."""
    vals = [base.meta.get("val")]
    if not isinstance(vals[0], torch.Tensor) or any(
        isinstance(leaf, torch.fx.Node)
        for v in views
        for leaf in _compat.tree_leaves((v.args[1:], v.kwargs))
    ):
        return None
    try:
        for v in views:
            vals.append(v.target(vals[-1], *v.args[1:], **v.kwargs))
    except Exception:  # noqa: BLE001 - a view that does not replay: leave the graph alone
        return None
    if not _same_layout(vals[-1], getitem.meta.get("val")):
        return None
    prev = base
    with graph.inserting_before(getitem):
        for v, val in zip(views, vals[1:], strict=True):
            prev = graph.call_function(v.target, (prev, *v.args[1:]), dict(v.kwargs))
            prev.meta["val"] = val
    return prev


def forward_aliased_outputs(graph: torch.fx.Graph | torch.fx.GraphModule) -> AliasReport:
    """Replaces each region output that is the region's own input by the outer argument.

    For every ``getitem(invoke_subgraph(subgraph, name, *args), i)`` whose subgraph
    returns its placeholder ``k`` as output ``i``, the uses of the ``getitem`` become uses
    of ``args[k]``: the same tensor at run time, but now visible to Inductor's liveness.

    Args:
        graph: A post-grad FX graph (or its module) whose owning module holds the
            subgraphs its ``invoke_subgraph`` calls name.

    Returns:
        The nodes forwarded, the views replayed, and the views left alone.
    """
    gm = graph if isinstance(graph, torch.fx.GraphModule) else graph.owning_module
    graph = gm.graph if isinstance(graph, torch.fx.GraphModule) else graph
    invoke = torch.ops.higher_order.invoke_subgraph
    report = AliasReport()
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not invoke:
            continue
        target = node.args[0]
        sub = (
            _submodule(gm, target.target)
            if gm is not None and isinstance(target, torch.fx.Node) and target.op == "get_attr"
            else None
        )
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        placeholders = [p for p in sub.graph.nodes if p.op == "placeholder"]
        outputs = next(n for n in reversed(sub.graph.nodes) if n.op == "output").args[0]
        operands = node.args[2:]
        if not isinstance(outputs, (list, tuple)) or len(placeholders) != len(operands):
            continue
        for user in list(node.users):
            if user.target is not operator.getitem or not isinstance(user.args[1], int):
                continue
            out = outputs[user.args[1]]
            if not isinstance(out, torch.fx.Node):
                continue
            if out.op == "placeholder":
                arg = operands[placeholders.index(out)]
                if isinstance(arg, torch.fx.Node):
                    user.replace_all_uses_with(arg)
                    report.forwarded.append(user.name)
            elif user.users and (chain := _view_chain(out)) is not None:
                arg = operands[placeholders.index(chain[0])]
                view = (
                    _replay_view(graph, arg, chain[1:], user)
                    if isinstance(arg, torch.fx.Node)
                    else None
                )
                if view is None:
                    report.views.append(user.name)
                else:
                    user.replace_all_uses_with(view)
                    report.replayed.append(user.name)
    return report


_PASS_UUID = "aotdist.forward_aliased_outputs.v2"


@functools.cache
def _pass_class() -> type:
    class ReusePass(_compat.custom_graph_pass_base()):
        """:func:`forward_aliased_outputs` as an Inductor post-grad pass; buffer reuse off
        for a graph where a region returns a view of its input. ``reports`` keeps what it
        did to the last graphs it saw (for tests and debugging)."""

        def __init__(self) -> None:
            self.reports: list[AliasReport] = []

        def __call__(self, graph: torch.fx.Graph) -> None:
            report = forward_aliased_outputs(graph)
            if report.forwarded or report.replayed or report.views:
                self.reports.append(report)
                del self.reports[:-64]
            if report.views:
                _compat.inductor_disable_buffer_reuse()

        def uuid(self) -> str:
            return _PASS_UUID

    return ReusePass


def reuse_pass():
    """A new instance of the post-grad pass (a ``CustomGraphPass``).

    Raises:
        TorchFeatureUnavailable: This torch has no ``CustomGraphPass``.
    """
    return _pass_class()()


def is_reuse_pass(obj) -> bool:
    """Whether ``obj`` is an instance of aotdist's post-grad pass (from :func:`reuse_pass`)."""
    return isinstance(obj, _pass_class())


def comparable_options(options: dict) -> dict:
    """``options`` with graph-pass instances (aotdist's buffer-reuse and bucketing passes,
    their chain: anything with a ``uuid()``) replaced by that uuid, so two completions of
    the same options compare equal (each completion makes new pass instances)."""

    def name(v):
        if isinstance(v, (list, tuple)):
            return [name(x) for x in v]
        uuid = getattr(v, "uuid", None)
        return f"<pass {uuid()}>" if callable(uuid) else v

    return {k: name(v) for k, v in options.items()}
