"""Regions that read a tensor's value on the host (``.tolist()``, ``.item()``): split sizes
from token counts, as a mixture-of-experts layer routes (the all-to-all of expert
parallelism: tests/distributed/test_expert_parallel.py). aotdist traces those values as
symbolic scalars for that model's compiled call only, and the region stays one reused
subgraph; a region that branches on such a value is compiled inline instead, named in a
warning. Both train as eager does, over several steps, blocks with different weights."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import aotdist

DIM, DEPTH, STEPS = 8, 3, 3


class Routed(nn.Module):
    """Each token to one of two experts by its router's choice: the split sizes are the
    token counts, read on the host."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, 2, bias=False)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))

    def forward(self, x):
        tokens = x.reshape(-1, DIM)
        choice = self.router(tokens).argmax(-1)
        order = choice.argsort(stable=True)
        counts = F.one_hot(choice, 2).sum(0).tolist()
        parts = tokens[order].split(counts)
        y = torch.cat([F.gelu(e(p)) for e, p in zip(self.experts, parts, strict=True)])
        out = torch.empty_like(y)
        out[order] = y
        return x + out.view_as(x)


class Branching(nn.Module):
    """Takes a branch by a tensor's value: no single graph holds both sides."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x):
        y = self.fc(x)
        if (y > 0).sum().view(1).tolist()[0] > y.numel() // 2:
            return x + y
        return x - y


class Net(nn.Module):
    def __init__(self, block: type[nn.Module]):
        super().__init__()
        torch.manual_seed(0)  # every block's weights differ
        self.stem = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(block() for _ in range(DEPTH))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _train(model: nn.Module) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        x = torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _compiled_run(block: type[nn.Module]):
    torch._dynamo.reset()
    eager = Net(block)
    model = aotdist.compile_regions(copy.deepcopy(eager), backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with aotdist.metrics.track(model) as m:
            losses = _train(model)
    assert losses == pytest.approx(_train(eager), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
    messages = [
        str(w.message) for w in caught if issubclass(w.category, aotdist.RegionCompileWarning)
    ]
    return m, messages


def test_split_sizes_read_on_the_host_keep_the_region_one_reused_subgraph():
    import torch._dynamo.config as dynamo_config

    m, messages = _compiled_run(Routed)
    assert m.regions["Routed"].call_sites == DEPTH and m.regions["Routed"].subgraphs == 1
    assert m.fixes == {"Routed": "capture_scalar_outputs"}
    assert len(messages) == 1 and "reads a tensor's value on the host" in messages[0]
    assert dynamo_config.capture_scalar_outputs is False  # this model's call only


def test_a_branch_on_a_host_value_is_named_with_its_cause():
    """Traced with its values captured, a region that branches on one is no subgraph:
    torch 2.14 runs the frame around it eagerly, 2.11 fails it and the region compiles
    inline. Either is said in one warning and in ``metrics`` (not "fixed"); the result is
    eager's."""
    m, messages = _compiled_run(Branching)
    assert "Branching" in {**m.eager, **m.demoted} and not m.fixes, (m.eager, m.demoted)
    assert len(messages) == 1 and "'Branching'" in messages[0], messages
    assert "symbolic scalars" in messages[0]


def test_capturing_for_one_model_leaves_the_next_one_s_compile_as_it_was():
    """The region that branches, compiled after a model whose scalars were captured: the
    same outcome and the same warnings as compiled first."""
    alone = _compiled_run(Branching)
    _compiled_run(Routed)
    after = _compiled_run(Branching)
    assert {**after[0].eager, **after[0].demoted}.keys() == {"Branching"}
    assert after[0].eager.keys() == alone[0].eager.keys()
    assert after[1] == alone[1]
