"""Bucketing of graph-mode FSDP's collectives (``fsdp.bucket_mb``).

Graph-mode FSDP (:mod:`aotdist.fsdp.graph`) gathers every parameter with its own
functional all-gather and reduce-scatters every gradient on its own.
:func:`bucket_collectives` merges them, per graph, into few collectives with torch's FX
bucketing passes (``torch._inductor.fx_passes.bucketing``), each bucket capped at
``bucket_mb`` MiB of gathered, unsharded data. It runs after AOTAutograd's partitioning:

- ``aot_eager``: :func:`bucketing_aot_eager`, a compiler that applies the pass to each
  graph and to every ``invoke_subgraph`` subgraph it calls;
- ``inductor``: :func:`bucketing_pass`, a post-grad pass (through
  :func:`aotdist.backends.named.inductor_options`).

Details: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

from aotdist import _compat

_DONE = "aotdist_bucketed"


def count_collectives(gm: torch.fx.GraphModule | torch.fx.Graph) -> dict[str, int]:
    """``{"all_gather": n, "reduce_scatter": m, "all_reduce": k}``: the functional
    collectives issued in ``gm``'s own graph (any ``_c10d_functional`` variant, the
    ``_out`` ones a merged bucket uses included; waits not counted)."""
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    out = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for node in graph.nodes:
        name = str(node.target) if node.op == "call_function" else ""
        if "_c10d_functional." not in name or "wait_tensor" in name:
            continue
        op = name.split("_c10d_functional.", 1)[1]
        for kind in out:
            if op.startswith(kind):
                out[kind] += 1
    return out


def _subgraphs(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    """The distinct ``invoke_subgraph`` subgraph modules ``gm`` calls (nested ones too)."""
    invoke = torch.ops.higher_order.invoke_subgraph
    found: dict[int, torch.fx.GraphModule] = {}
    todo = [gm]
    while todo:
        mod = todo.pop()
        for node in mod.graph.find_nodes(op="call_function", target=invoke):
            target = node.args[0]
            if not (isinstance(target, torch.fx.Node) and target.op == "get_attr"):
                continue
            sub = mod
            for part in target.target.split("."):
                sub = getattr(sub, part, None)
            if isinstance(sub, torch.fx.GraphModule) and id(sub) not in found:
                found[id(sub)] = sub
                todo.append(sub)
    return list(found.values())


def bucket_collectives(
    gm: torch.fx.GraphModule | torch.fx.Graph, bucket_mb: float, *, recurse: bool = True
) -> dict[str, int]:
    """Merges ``gm``'s independent all-gathers, reduce-scatters and all-reduces (HSDP's
    replicas) into buckets.

    Args:
        gm: A functionalized post-partition graph module (node ``meta["val"]`` set), or
            a bare graph whose ``owning_module`` is one (Inductor's post-grad pass).
        bucket_mb: Cap of one bucket, in MiB of collective input.
        recurse: Also bucket each ``invoke_subgraph`` subgraph ``gm`` calls (once each).

    Returns:
        The collectives left in ``gm``'s own graph (see :func:`count_collectives`).
    """
    if isinstance(gm, torch.fx.Graph):
        gm = gm.owning_module
    if recurse:
        for sub in _subgraphs(gm):
            bucket_collectives(sub, bucket_mb, recurse=False)
    if not getattr(gm, _DONE, False):
        b = _compat.fx_bucketing()
        cap = functools.partial(_cap, float(bucket_mb))
        # reduce-scatters first, then all-gathers (whose merge adds a mutation), then a
        # stable topological sort: a merged collective sits where the last of its bucket
        # was, and users of the earlier ones move after it (as Inductor's post-grad does)
        rs = b.bucket_reduce_scatter_by_mb(gm, cap, filter_wait_node=_sole_wait)
        if any(len(bucket) > 1 for bucket in rs):
            b.merge_reduce_scatter(gm, [bucket for bucket in rs if len(bucket) > 1])
        # torch buckets adjacent all-gathers of one dtype only; graph-mode float8.
        # fsdp_all_gather interleaves float8 bytes (uint8) with the other parameters, so
        # those graphs bucket across dtypes (each input packed bitwise into a byte buffer)
        mode = "custom_ops_multidtype" if len(_gather_dtypes(gm)) > 1 else "default"
        ag = b.bucket_all_gather_by_mb(gm, cap, filter_wait_node=_sole_wait, mode=mode)
        if any(len(bucket) > 1 for bucket in ag):
            b.merge_all_gather(gm, [bucket for bucket in ag if len(bucket) > 1], mode=mode)
        # HSDP: the replicas' all-reduces of the reduce-scattered shards
        for bucket in b.bucket_all_reduce_by_mb(gm, cap, filter_wait_node=_sole_wait):
            if len(bucket) > 1:
                b.merge_all_reduce_bucket(gm.graph, bucket)
        _compat.stable_topological_sort(gm.graph)
        gm.graph.lint()
        gm.recompile()
        setattr(gm, _DONE, True)
    return count_collectives(gm)


_OBSERVERS: list[tuple[list[torch.fx.GraphModule], Callable | None]] = []


@contextlib.contextmanager
def graphs_observed(
    each: Callable[[torch.fx.GraphModule], None] | None = None,
) -> Iterator[list[torch.fx.GraphModule]]:
    """Within, every graph :func:`bucketing_aot_eager` compiles is appended, bucketed, to
    the list it yields (``aotdist plan`` reads the collectives the job issues), and
    handed to ``each`` first, which may still change it (the tests count what runs)."""
    seen: list[torch.fx.GraphModule] = []
    entry = (seen, each)
    _OBSERVERS.append(entry)
    try:
        yield seen
    finally:
        _OBSERVERS.remove(entry)


def _gather_dtypes(gm: torch.fx.GraphModule) -> set[torch.dtype]:
    """The dtypes of ``gm``'s own (unbucketed) all-gathers."""
    return {
        n.meta["val"].dtype
        for n in gm.graph.nodes
        if n.op == "call_function"
        and str(n.target).endswith("all_gather_into_tensor.default")
        and "val" in n.meta
    }


def _sole_wait(wait: torch.fx.Node) -> bool:
    """Whether ``wait`` is its collective's only user. A collective whose raw result has
    more users (seen: ``reshard_after_forward: false``, where the partitioner returns the
    un-waited all-gather as saved for backward and both graphs wait on it) stays as it
    is; torch's merge asserts a single user."""
    coll = wait.args[0]
    return isinstance(coll, torch.fx.Node) and len(coll.users) == 1


def _cap(bucket_mb: float, bucket_idx: int) -> float:
    return bucket_mb


def bucketing_aot_eager(bucket_mb: float) -> Callable:
    """``aot_eager`` whose forward/backward compilers bucket each graph's collectives.

    Raises:
        TorchFeatureUnavailable: This torch lacks ``aot_eager``'s parts.
    """
    aot_eager, boxed_nop = _compat.aot_eager_parts()
    _register_bucket_ops()

    @functools.wraps(boxed_nop)
    def compile_graph(gm, example_inputs, *args, **kwargs):
        bucket_collectives(gm, bucket_mb)
        for seen, each in _OBSERVERS:
            if each is not None:
                each(gm)
            seen.append(gm)
        return boxed_nop(gm, example_inputs, *args, **kwargs)

    backend = functools.partial(aot_eager, fw_compiler=compile_graph, bw_compiler=compile_graph)
    backend.compiler_name = "aot_eager"  # what aotdist's backend naming reads
    backend.aotdist_bucket_mb = bucket_mb
    backend.aotdist_graph_compiler = compile_graph  # kept when aot_backend rebuilds it
    return backend


_UUID = "aotdist.bucket_collectives.v2"  # v2: all-gathers of mixed dtypes bucketed together


def _register_bucket_ops() -> None:
    """Imports torch's bucketing module, which registers the custom ops a graph bucketed
    across dtypes calls (``torch.ops.bucketing``): before any graph runs, compiled now or
    loaded from torch's caches or a saved bundle in a fresh process."""
    _compat.fx_bucketing()


@functools.cache
def _pass_class() -> type:
    class BucketingPass(_compat.custom_graph_pass_base()):
        """:func:`bucket_collectives` as an Inductor post-grad pass (Inductor calls it on
        each subgraph itself, so it does not recurse)."""

        def __init__(self, bucket_mb: float) -> None:
            self.bucket_mb = float(bucket_mb)

        def __call__(self, graph: torch.fx.Graph) -> None:
            bucket_collectives(graph, self.bucket_mb, recurse=False)

        def uuid(self) -> str:
            return f"{_UUID}:{self.bucket_mb!r}"

    return BucketingPass


def bucketing_pass(bucket_mb: float):
    """A post-grad pass (``CustomGraphPass``) bucketing each graph's collectives.

    Raises:
        TorchFeatureUnavailable: This torch has no ``CustomGraphPass``.
    """
    _register_bucket_ops()
    return _pass_class()(bucket_mb)


def is_bucketing_pass(obj) -> bool:
    """Whether ``obj`` came from :func:`bucketing_pass`."""
    return isinstance(obj, _pass_class())
