"""How a graph that calls regions is split into its forward and backward.

AOTAutograd's min-cut partitioner costs about 23 ms per region call site on the graph
around the regions (an ``invoke_subgraph`` per block and its outputs; superlinear in
depth), while what it can decide there is small: each region's saved activations are the
outputs of its call, already chosen by the region's own partition. When that graph is not
lowered by Inductor (``aot_eager``, or Inductor with ``compile.outer: fx``), recomputing
its glue buys no fusion, so :func:`region_partition` saves what the backward needs
(``default_partition``, about 3 ms per call site). aotdist's own tags on what the graph
computes from integer inputs (:func:`aotdist.backends.recompute.tag_index_derived`: a
causal mask, a loss's ignore mask) stay recomputed there, as min-cut recomputed them:
``default_partition`` recomputes tagged ops in the backward. Any graph with another
recompute policy (checkpointing, graph-mode FSDP's gathers), tags beside an impure op
(which ``default_partition`` refuses) and every region body keep the min-cut partitioner.
Details and figures: docs/internals.md.
"""

from __future__ import annotations

from typing import Any

import torch

from aotdist import _compat
from aotdist.backends.recompute import AOTDIST_POLICY
from aotdist.version import __version__

# The decision's revision, in the partitioner's cache key beside aotdist's version: a
# cached partition made under another rule is not reused.
_RULE = "2"


def saves_what_backward_needs(joint: torch.fx.GraphModule) -> bool:
    """Whether ``joint`` is partitioned by ``default_partition``: it calls a region, no node
    carries a recompute policy (``meta["recompute"]``) but aotdist's on index-derived ops,
    and where one does, no op is impure (``default_partition`` refuses recompute tags
    beside one)."""
    invoke = torch.ops.higher_order.invoke_subgraph
    calls = tagged = False
    for node in joint.graph.nodes:
        if "recompute" in node.meta:
            if not _aotdists(node):
                return False
            tagged = True
        calls = calls or (node.op == "call_function" and node.target is invoke)
    return calls and not (tagged and _has_impure_op(joint))


def recompute_pointwise_glue(joint: torch.fx.GraphModule) -> list[str]:
    """Tags ``PREFER_RECOMPUTE`` each forward pointwise op of a graph around regions (not
    random, not tagged already), so that ``default_partition`` recomputes it in the
    backward from what is saved anyway, as min-cut did: a final norm's output is not saved
    beside its input. Nothing is tagged in a graph with an impure op.

    Returns:
        The names of the nodes tagged.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    if _has_impure_op(joint):
        return []
    tangents: set[torch.fx.Node] = set()
    tagged = []
    for node in joint.graph.nodes:
        if node.op == "placeholder":
            if node.name.startswith("tangents"):
                tangents.add(node)
            continue
        if any(i in tangents for i in node.all_input_nodes):
            tangents.add(node)  # the backward's
            continue
        tags = getattr(node.target, "tags", ())
        if (
            node.op == "call_function"
            and torch.Tag.pointwise in tags
            and torch.Tag.nondeterministic_seeded not in tags
            and "recompute" not in node.meta
        ):
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            node.meta[AOTDIST_POLICY] = True
            tagged.append(node.name)
    return tagged


def _has_impure_op(joint: torch.fx.GraphModule) -> bool:
    """An op that writes or has side effects, random ops apart (``default_partition``'s
    test: it refuses recompute tags in a graph holding one)."""
    return any(
        n.op == "call_function" and n.is_impure(impure_random=False) for n in joint.graph.nodes
    )


def _aotdists(node: torch.fx.Node) -> bool:
    """Whether ``node``'s recompute policy is aotdist's own PREFER_RECOMPUTE (an
    index-derived op, or glue tagged here), not a user's checkpoint policy."""
    from torch.utils.checkpoint import CheckpointPolicy

    return bool(node.meta.get(AOTDIST_POLICY)) and (
        node.meta["recompute"] is CheckpointPolicy.PREFER_RECOMPUTE
    )


def region_partition(
    joint: torch.fx.GraphModule,
    joint_inputs: Any,
    compiler: str = "inductor",
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
    **kwargs: Any,
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """A partition function with min-cut's signature: ``default_partition`` for a graph
    around regions (:func:`saves_what_backward_needs`; its pointwise glue recomputed,
    :func:`recompute_pointwise_glue`), min-cut for any other."""
    default, min_cut = _compat.partitioners()
    if saves_what_backward_needs(joint):
        recompute_pointwise_glue(joint)
        return default(
            joint,
            joint_inputs,
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices,
        )
    return min_cut(
        joint,
        joint_inputs,
        compiler,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_indices=static_lifetime_input_indices,
        **kwargs,
    )


def inductor_partitioner():
    """:func:`region_partition` as Inductor's ``custom_partitioner_fn`` (a
    ``CustomPartitionerFn`` whose uuid names this version of aotdist).

    The class is built once and bound to this module as ``RegionPartition``: Inductor's
    FX graph cache pickles its config into each graph's key, and a class pickle cannot
    find by its module and name fails that pickle, which bypasses the cache for every
    graph (kernels lowered again on every warm start).

    Raises:
        TorchFeatureUnavailable: This torch has no ``CustomPartitionerFn``.
    """
    cls = globals().get("RegionPartition")
    if cls is None:
        cls = type(
            "RegionPartition",
            (_compat.custom_partitioner_base(),),
            {
                "__call__": lambda self, *args, **kwargs: region_partition(*args, **kwargs),
                "uuid": lambda self: f"aotdist.region_partition.{__version__}.{_RULE}",
                "__doc__": ":func:`aotdist.backends.partition.region_partition`.",
                "__module__": __name__,  # else the metaclass's module: abc
                "__qualname__": "RegionPartition",
            },
        )
        globals()["RegionPartition"] = cls
    return cls()
