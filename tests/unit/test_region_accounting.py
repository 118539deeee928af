"""Every instance of a region is accounted for in ``metrics``: called, inlined, inside
another region's subgraph, or named as in no compiled graph (``RegionStats.unseen``)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import aotdist
from aotdist import metrics
from aotdist.testing.parity import assert_training_parity


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class _SpareLast(nn.Module):
    """Four blocks, the last one never called (as a diffusers block whose context output
    is not needed leaves a norm unused)."""

    def __init__(self, used: int = 3):
        super().__init__()
        self.embed = nn.Linear(8, 8)  # every block's input needs a gradient
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.used = used

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks[: self.used]:
            x = block(x)
        return x.sum()


def _track(model, reference):
    aotdist.compile_regions(model, backend="aot_eager")
    batches = [(torch.randn(2, 8),) for _ in range(3)]
    with metrics.track(model) as m:
        assert_training_parity(model, reference, batches, loss_fn=lambda out: out)
    return m


def test_an_instance_the_forward_never_calls_is_named_not_lost():
    torch.manual_seed(0)
    model = _SpareLast()
    m = _track(model, copy.deepcopy(model))
    st = m.regions["_Block"]
    assert (st.instances, st.call_sites, st.subgraphs) == (4, 3, 1), m.summary()
    assert st.unseen == ("blocks.3",), m.summary()
    assert "1 in no graph (blocks.3)" in m.summary()


def test_a_model_that_calls_every_instance_has_none_unseen():
    torch.manual_seed(0)
    model = _SpareLast(used=4)
    m = _track(model, copy.deepcopy(model))
    st = m.regions["_Block"]
    assert (st.instances, st.call_sites, st.unseen) == (4, 4, ()), m.summary()
