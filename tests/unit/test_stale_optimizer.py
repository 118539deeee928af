"""An optimizer built before ``aotdist.parallelize`` shards the model holds parameters the
model no longer uses: its first step is refused with the fix, never left to train nothing
(FSDP2 on one gloo rank in this process, hooks mode and graph-mode FSDP)."""

from __future__ import annotations

import pytest
import torch

import aotdist
from aotdist.testing import build_model, example_inputs
from aotdist.testing.distributed import one_rank_group

CONFIG = {"compile": {"backend": "aot_eager"}}


def _loss(model, x):
    return model(x).float().logsumexp(-1).mean()


@pytest.mark.parametrize("mode", ["hooks", "graph"])
def test_an_optimizer_built_before_sharding_is_refused_at_its_first_step(mode):
    model = build_model("gpt", depth=2)
    (x,), _ = example_inputs(model)
    early = torch.optim.SGD(model.parameters(), lr=0.5)
    with one_rank_group():
        aotdist.parallelize(model, config={**CONFIG, "fsdp": {"enabled": True, "mode": mode}})
        _loss(model, x).backward()
        with pytest.raises(aotdist.OrderingError, match=r"after aotdist\.parallelize"):
            early.step()
        late = torch.optim.SGD(model.parameters(), lr=0.5)  # what the message asks for
        losses = []
        for _ in range(3):
            late.zero_grad()
            loss = _loss(model, x)
            loss.backward()
            late.step()
            losses.append(loss.item())
    assert losses[2] < losses[0], losses  # it trains


def test_without_sharding_an_early_optimizer_still_steps_the_model():
    model = build_model("gpt", depth=2)
    (x,), _ = example_inputs(model)
    early = torch.optim.SGD(model.parameters(), lr=0.5)
    aotdist.parallelize(model, config=CONFIG)  # no parameter replaced
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, x).backward()
    early.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
