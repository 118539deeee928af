"""Joint-graph passes that decide what a compiled backward recomputes.

- :func:`tag_index_derived`: what a graph computes from integer or boolean inputs alone
  (an attention mask) is recomputed, not saved: a reused region would save its own float
  copy of SDPA's ``batch x seq x seq`` bias at every call site.
- :func:`save_checkpoint_boundaries`: with checkpointing around each region call, each
  region's input is saved and the backward recomputes one region at a time. torch tags
  that boundary ``MUST_SAVE``, but a region call is one multi-output ``invoke_subgraph``
  and the partitioner never bans recomputing a ``getitem``: it recomputed every region's
  forward from one saved hidden state before the first region's backward (a peak no lower
  than without checkpointing).

Inductor runs them as joint pre- and post-pass; aotdist's other compiles run the second
within :func:`saving_checkpoint_boundaries`. Details: docs/internals.md.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch

from aotdist import _compat
from aotdist._compat.ops import aten_to_copy

_aten = torch.ops.aten
# set beside a PREFER_RECOMPUTE tag aotdist adds (here, and on the glue around regions in
# aotdist.backends.partition): the policy is aotdist's, not a user's, so such a graph
# around regions keeps default_partition
AOTDIST_POLICY = "aotdist_recompute_policy"
_CHEAP = {
    _aten.full.default,
    _aten.scalar_tensor.default,
    aten_to_copy(),
    _aten.clone.default,
    _aten.expand.default,
    _aten.where.self,
    _aten.masked_fill.Scalar,
}


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
    return (
        node.name.startswith("primals")
        and isinstance(val, torch.Tensor)
        and not val.is_floating_point()
        and not val.is_complex()
    )


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
            node.meta[AOTDIST_POLICY] = True
            tagged.append(node.name)
    return tagged


def _recomputed(node: torch.fx.Node) -> bool:
    from torch.utils.checkpoint import CheckpointPolicy

    return node.meta.get("recompute") in (
        CheckpointPolicy.MUST_RECOMPUTE,
        CheckpointPolicy.PREFER_RECOMPUTE,
    )


def save_checkpoint_boundaries(graph: torch.fx.Graph) -> list[str]:
    """Routes each output of a checkpointed multi-output node (a region call) that a later
    checkpoint region takes through a copy tagged ``MUST_SAVE``, which the partitioner then
    saves (a ``getitem`` it would not): the later region is recomputed from it.

    Returns:
        The names of the outputs routed (none: ``graph`` is unchanged).
    """
    from torch.utils.checkpoint import CheckpointPolicy

    routed = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not operator.getitem:
            continue
        parent = node.args[0]
        if (
            not isinstance(parent, torch.fx.Node)
            or not _recomputed(parent)
            or "ac_graph_id" not in parent.meta
        ):
            continue
        later = [
            u
            for u in node.users
            if _recomputed(u) and u.meta.get("ac_graph_id", -1) > parent.meta["ac_graph_id"]
        ]
        if not later:
            continue
        # a copy, not a view: the partitioner saves a view's base, the recomputed output
        with graph.inserting_after(node):
            saved = graph.call_function(torch.ops.aten.clone.default, (node,))
        saved.meta.update({k: node.meta[k] for k in ("val", "tensor_meta") if k in node.meta})
        saved.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        for user in later:
            user.replace_input_with(node, saved)
        routed.append(node.name)
    return routed


def _joint_module_pass(joint: torch.fx.GraphModule, inputs: Any) -> torch.fx.GraphModule:
    if save_checkpoint_boundaries(joint.graph):
        joint.recompile()
    return joint


def saving_checkpoint_boundaries() -> Any:
    """Within, every AOTAutograd compile (any backend) runs
    :func:`save_checkpoint_boundaries` on its joint graph before partitioning it."""
    return _compat.functorch_joint_pass(_joint_module_pass)


class _BoundariesSaved:
    """An AOTAutograd backend (``aot_eager``) whose joint graphs get
    :func:`save_checkpoint_boundaries` before partitioning; other attributes are the
    backend's (its ``compiler_name``)."""

    def __init__(self, backend: Callable):
        self._backend = backend

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Any:
        with saving_checkpoint_boundaries():
            return self._backend(gm, example_inputs, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def boundaries_saved(backend: Callable) -> Callable:
    """``backend`` (``aot_eager`` or one built from its parts) with each checkpointed
    region's input saved and its recompute next to its backward (see the module)."""
    return backend if isinstance(backend, _BoundariesSaved) else _BoundariesSaved(backend)


@functools.cache
def _pass_class(name: str, uuid: str) -> type:
    """A ``CustomGraphPass`` class running the function ``name`` of this module on a graph
    (made once per process: Inductor's config compares passes by uuid)."""

    def call(self, graph: torch.fx.Graph) -> None:
        globals()[name](graph)

    return type(
        name.title().replace("_", "") + "Pass",
        (_compat.custom_graph_pass_base(),),
        {
            "__call__": call,
            "uuid": lambda self: uuid,
            "__doc__": f":func:`{name}` as an Inductor joint-graph pass.",
        },
    )


_RECOMPUTE = ("tag_index_derived", "aotdist.recompute_index_derived.v1")
_BOUNDARIES = ("save_checkpoint_boundaries", "aotdist.checkpoint_boundaries.v1")


def boundaries_pass():
    """A new instance of :func:`save_checkpoint_boundaries` as an Inductor joint post-pass
    (a ``CustomGraphPass``).

    Raises:
        TorchFeatureUnavailable: This torch has no ``CustomGraphPass``.
    """
    return _pass_class(*_BOUNDARIES)()


def recompute_pass():
    """A new instance of the joint-graph pass (a ``CustomGraphPass``).

    Raises:
        TorchFeatureUnavailable: This torch has no ``CustomGraphPass``.
    """
    return _pass_class(*_RECOMPUTE)()


def is_recompute_pass(obj) -> bool:
    """Whether ``obj`` is an instance of this joint-graph pass."""
    return isinstance(obj, _pass_class(*_RECOMPUTE))
