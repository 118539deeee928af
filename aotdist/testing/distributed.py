"""Process groups in the test's own process: one gloo rank, or a fake world of several
(the multi-process runner is :mod:`aotdist.launch`'s, on :mod:`aotdist.testing`'s face)."""

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
