"""The first-step check (``compile.verify``) under FSDP2 hooks mode on 2 CPU ranks (gloo).

Training with the check on matches single-process eager; a region that computes wrong
(BatchNorm's fix forced onto a subclass with an activation, as aotdist once did) stops
every rank with ``RegionMismatchError`` naming it before any optimizer step, none hangs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import aotdist
from aotdist.testing import (
    accumulated_reference,
    build_model,
    rank_batches,
    rank_step,
    record_logs,
    run_distributed,
)
from aotdist.testing.models import BatchNormRelu, ConvNormBlock

pytestmark = pytest.mark.slow  # two spawns of 2 ranks: about a minute on 2 cores

CONFIG = {"fsdp": {"enabled": True}, "compile": {"backend": "aot_eager", "verify": True}}
STEPS, DEPTH = 3, 3


def _train(rank: int, world_size: int):
    torch.manual_seed(0)
    model = aotdist.parallelize(build_model("gpt", depth=DEPTH), config=CONFIG)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with record_logs() as logs:
        losses = [
            rank_step(model, opt, xs[rank], ys[rank])
            for xs, ys in rank_batches(model, world_size=world_size, steps=STEPS)
        ]
    return losses, [r.getMessage() for r in logs if "first-step check" in r.getMessage()]


def test_training_with_the_check_matches_eager_on_two_ranks():
    results = run_distributed(_train, 2, timeout=300)
    ref_losses, _, _ = accumulated_reference(CONFIG, world_size=2, depth=DEPTH, steps=STEPS)
    for losses, checks in results:
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5
        )
        assert len(checks) == 1 and "passed" in checks[0], checks


def _wrong_region(rank: int, world_size: int):
    from aotdist.fixes import batchnorm

    batchnorm._reproduced = lambda cls: True  # the isinstance swap aotdist once had
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1), *[ConvNormBlock(4, BatchNormRelu) for _ in range(3)], nn.Flatten()
    )
    aotdist.parallelize(model, config=CONFIG)
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(rank))
    try:
        model(x)
    except aotdist.RegionMismatchError as err:
        return err.regions
    return None


def test_a_wrong_region_stops_every_rank_and_is_named():
    assert run_distributed(_wrong_region, 2, timeout=300) == [["ConvNormBlock"], ["ConvNormBlock"]]
