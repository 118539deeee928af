"""A joint-graph pass: what a graph computes from integer or boolean inputs alone (an
attention mask, position indices) is recomputed in the backward, not saved.

SDPA turns a boolean attention mask into a float bias inside every decoder layer. A
whole-model compile deduplicates those identical conversions and saves one bias for
backward; a reused region saves its own at every call site: one float copy of the
``batch x seq x seq`` mask per layer. Tagged ``PREFER_RECOMPUTE``, those nodes are left to
AOTAutograd's min-cut partitioner to recompute (cheap pointwise work) in each backward, and
it saves the mask itself, one tensor that every call site shares. Inductor runs the pass on
the region's joint graph before partitioning it (torch 2.11, 2.14). Details:
docs/internals.md.
"""

from __future__ import annotations

import functools

import torch

from aotdist import _compat

__all__ = ["is_recompute_pass", "recompute_pass", "tag_index_derived"]

_aten = torch.ops.aten
_CHEAP = {_aten.full.default, _aten.scalar_tensor.default, _aten._to_copy.default,
          _aten.clone.default, _aten.expand.default, _aten.where.self,
          _aten.masked_fill.Scalar}


def _cheap(node: torch.fx.Node) -> bool:
    """A pointwise, view or constant-making op: free to recompute next to its use."""
    target = node.target
    tags = getattr(target, "tags", None)  # an OpOverload's
    if tags is None:
        return False
    return target in _CHEAP or getattr(target, "is_view", False) or torch.Tag.pointwise in tags


def _index_input(node: torch.fx.Node) -> bool:
    """A forward input (``primals_*``) holding integers or booleans."""
    val = node.meta.get("val")
    return (node.name.startswith("primals") and isinstance(val, torch.Tensor)
            and not val.is_floating_point() and not val.is_complex())


def tag_index_derived(graph: torch.fx.Graph) -> list[str]:
    """Tags ``PREFER_RECOMPUTE`` every cheap op whose inputs all derive from integer or
    boolean forward inputs (and constants), with at least one such input behind it.

    Returns:
        The names of the nodes tagged (none: ``graph`` is unchanged).
    """
    from torch.utils.checkpoint import CheckpointPolicy

    const: set[torch.fx.Node] = set()
    derived: set[torch.fx.Node] = set()
    tagged = []
    for node in graph.nodes:
        if node.op == "placeholder":
            if _index_input(node):
                derived.add(node)
            continue
        if node.op != "call_function" or not _cheap(node):
            continue
        inputs = node.all_input_nodes
        if not all(i in derived or i in const for i in inputs):
            continue
        if not any(i in derived for i in inputs):
            const.add(node)
            continue
        derived.add(node)
        if "recompute" not in node.meta:  # a user's checkpoint policy wins
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            tagged.append(node.name)
    return tagged


_PASS_UUID = "aotdist.recompute_index_derived.v1"


@functools.cache
def _pass_class() -> type:
    class RecomputePass(_compat.custom_graph_pass_base()):
        """:func:`tag_index_derived` as an Inductor joint-graph pre-pass."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            tag_index_derived(graph)

        def uuid(self) -> str:
            return _PASS_UUID

    return RecomputePass


def recompute_pass():
    """A new instance of the joint-graph pass (a ``CustomGraphPass``).

    Raises:
        TorchFeatureUnavailable: This torch has no ``CustomGraphPass``.
    """
    return _pass_class()()


def is_recompute_pass(obj) -> bool:
    """Whether ``obj`` is an instance of this joint-graph pass."""
    return isinstance(obj, _pass_class())
