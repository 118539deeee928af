"""How a graph that calls regions is split into its forward and backward.

AOTAutograd's min-cut partitioner costs about 23 ms per region call site on the graph
around the regions (an ``invoke_subgraph`` per block and its outputs; superlinear in
depth), while what it can decide there is small: each region's saved activations are the
outputs of its call, already chosen by the region's own partition. When that graph is not
lowered by Inductor (``aot_eager``, or Inductor with ``compile.outer: fx``), recomputing
its glue buys no fusion, so :func:`region_partition` saves what the backward needs
(``default_partition``, about 3 ms per call site). Any graph with a recompute policy
(checkpointing, graph-mode FSDP's gathers, aotdist's index-derived masks) and every region
body keep the min-cut partitioner. Details and figures: docs/internals.md.
"""

from __future__ import annotations

from typing import Any

import torch

from aotdist import _compat
from aotdist.version import __version__


def saves_what_backward_needs(joint: torch.fx.GraphModule) -> bool:
    """Whether ``joint`` is partitioned by ``default_partition``: it calls a region and no
    node carries a recompute policy (``meta["recompute"]``)."""
    invoke = torch.ops.higher_order.invoke_subgraph
    calls = False
    for node in joint.graph.nodes:
        if "recompute" in node.meta:
            return False
        calls = calls or (node.op == "call_function" and node.target is invoke)
    return calls


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
    around regions (:func:`saves_what_backward_needs`), min-cut for any other."""
    default, min_cut = _compat.partitioners()
    if saves_what_backward_needs(joint):
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

    Raises:
        TorchFeatureUnavailable: This torch has no ``CustomPartitionerFn``.
    """
    base = _compat.custom_partitioner_base()
    cls = type(
        "RegionPartition",
        (base,),
        {
            "__call__": lambda self, *args, **kwargs: region_partition(*args, **kwargs),
            "uuid": lambda self: f"aotdist.region_partition.{__version__}",
            "__doc__": ":func:`aotdist.backends.partition.region_partition`.",
        },
    )
    return cls()
