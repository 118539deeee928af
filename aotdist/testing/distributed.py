"""Process groups in the test's own process: one gloo rank, or a fake world of several
(the multi-process runner is :mod:`aotdist.launch`'s, on :mod:`aotdist.testing`'s face);
and the collectives of compiled graphs, counted as they run (what a plan is checked
against)."""

import contextlib
from collections.abc import Iterator

from aotdist._compat.distributed import fake_store


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A gloo world of one rank in this process: FSDP2's real hooks and graph-mode FSDP's
    collectives, nothing spawned (a test of what one rank compiles, not of communication)."""
    import torch.distributed as dist

    with _world("gloo", dist.HashStore(), 1):
        yield


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A world of ``world_size`` ranks in this process, this one rank 0, whose collectives
    do nothing (torch's ``fake`` backend): for tracing collectives and for every
    rank-dependent step (meshes, shard shapes), never for values."""
    with _world("fake", fake_store(), world_size):
        yield


@contextlib.contextmanager
def _world(backend: str, store, world_size: int) -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group(backend, store=store, rank=0, world_size=world_size)
    try:
        yield
    finally:
        if dist.is_initialized():  # else the code under test ended it (Accelerate's end_training)
            dist.destroy_process_group()


def count_collectives_as_run(gm, names: dict[str, str], counted: dict) -> None:
    """Makes every functional collective in ``gm`` and its subgraphs count itself (kind,
    mesh dimension, unsharded bytes) into ``counted`` each time the graph runs it."""
    import torch

    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            name = str(node.target) if node.op == "call_function" else ""
            kind = next(
                (
                    k
                    for k in ("all_gather", "reduce_scatter", "all_reduce")
                    if f"_c10d_functional.{k}" in name
                ),
                None,
            )
            if kind is not None:
                node.target = counting_collective(node.target, kind, names, counted)
        module.recompile()


def counting_collective(op, kind: str, names: dict[str, str], counted: dict):
    """``op`` (a functional collective of ``kind``) counting each call into ``counted``:
    ``(kind, mesh dimension) -> (count, bytes)``, the bytes unsharded (a gather's output,
    a reduce-scatter's input); ``names`` maps a group's name to its mesh dimension."""

    def run(*args, **kwargs):
        result = op(*args, **kwargs)
        unsharded = args[0] if kind == "reduce_scatter" else result
        key = (kind, names[args[-1]])
        n, b = counted.get(key, (0, 0))
        counted[key] = (n + 1, b + unsharded.numel() * unsharded.element_size())
        return result

    return run
