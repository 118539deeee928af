"""Sharded gradients compared shard by shard on 2 CPU ranks (gloo): the first-step check's
and ``aotdist check``'s comparison gathers no parameter, and every rank gets the figures
of the whole tensors."""

from __future__ import annotations

import pytest
import torch

from aotdist.testing import run_distributed

pytestmark = pytest.mark.slow  # one spawn of 2 ranks


def _compare(rank: int, world_size: int):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

    from aotdist.compile.verify import compare_grads

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    full = {"w": torch.randn(4, 3), "b": torch.randn(4), "unused": torch.zeros(4)}
    reference = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}
    reference["unused"] = None  # eager gave it no gradient; the compiled run zeros
    wrong = dict(full)
    wrong["w"] = full["w"].clone()
    wrong["w"][3, 0] += 0.5  # in rank 1's shard only
    grads = {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in wrong.items()}

    def no_gather(self, *args, **kwargs):
        raise AssertionError("compare_grads gathered a sharded gradient")

    DTensor.full_tensor = no_gather
    same = compare_grads(
        {n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in full.items()}, reference, rtol=1e-4
    )
    differ = compare_grads(grads, reference, rtol=1e-4)
    # aotdist check under FSDP: a sharded model against an unsharded reference
    whole = {**full, "unused": None}
    against_whole = compare_grads(grads, whole, rtol=1e-4)
    expected = 0.5 / (full["w"].abs().max().item() + 1e-6)
    return same, differ, against_whole, expected


def test_every_rank_gets_the_whole_tensors_figures_without_gathering():
    results = run_distributed(_compare, 2, timeout=240)
    for same, differ, against_whole, expected in results:
        assert same == (0.0, None, ["unused"])
        for worst, bad, zeros in (differ, against_whole):
            assert bad == "w" and zeros == ["unused"]
            assert worst == pytest.approx(expected, rel=1e-5)
