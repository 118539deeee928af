"""Which partitioner splits a graph: the graph around regions saves what its backward
needs (``default_partition``), while region bodies and graphs with a recompute policy
(checkpointing, graph-mode FSDP's gathers) keep min-cut; either way training equals eager."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

import aotdist
from aotdist import _compat, metrics
from aotdist.backends import partition
from aotdist.testing import TinyGPT, TinyResNet, example_inputs
from aotdist.testing.models import GPTBlock
from aotdist.testing.parity import assert_training_parity


def _graph(*, calls_region: bool, tag: CheckpointPolicy | None = None) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    x = g.placeholder("primals_1")
    y = g.call_function(torch.ops.aten.relu.default, (x,))
    if tag is not None:
        y.meta["recompute"] = tag
    if calls_region:
        y = g.call_function(torch.ops.higher_order.invoke_subgraph, (None, "id", y))
    g.output((y,))
    return torch.fx.GraphModule(nn.Module(), g)


def test_only_a_graph_calling_regions_without_a_recompute_policy_saves_what_backward_needs():
    assert partition.saves_what_backward_needs(_graph(calls_region=True))
    assert not partition.saves_what_backward_needs(_graph(calls_region=False))
    for tag in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE):
        assert not partition.saves_what_backward_needs(_graph(calls_region=True, tag=tag))


def test_the_inductor_partitioner_is_a_custom_partitioner_named_by_version():
    fn = partition.inductor_partitioner()
    assert isinstance(fn, _compat.custom_partitioner_base())
    assert fn.uuid() == f"aotdist.region_partition.{aotdist.__version__}"


@pytest.fixture
def decisions(monkeypatch):
    """Every partition decision of aotdist's partitioner: True for default_partition."""
    seen: list[bool] = []
    original = partition.saves_what_backward_needs

    def spy(joint):
        seen.append(original(joint))
        return seen[-1]

    monkeypatch.setattr(partition, "saves_what_backward_needs", spy)
    return seen


def _pair(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("build", [lambda: TinyGPT(depth=3), lambda: TinyResNet()])
def test_the_graph_around_regions_saves_what_backward_needs_and_trains_as_eager(build, decisions):
    model, reference = _pair(build())
    aotdist.compile_regions(model, backend="aot_eager")
    batches = [example_inputs(reference)[0] for _ in range(3)]
    with warnings.catch_warnings(), metrics.track(model) as m:
        warnings.simplefilter("error", aotdist.RegionCompileWarning)
        assert_training_parity(model, reference, batches)  # buffers compared every step
    # one outer graph by default_partition, every region body by min-cut
    assert decisions.count(True) == 1 and decisions.count(False) >= 1, decisions
    assert all(r.subgraphs == 1 for r in m.regions.values()), m.summary()


class CheckpointedStack(nn.Module):
    def __init__(self, depth: int = 3, dim: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)  # the blocks' input needs a gradient in each
        self.blocks = nn.ModuleList(GPTBlock(dim, heads=2) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


def test_a_checkpointed_graph_around_regions_keeps_min_cut(decisions):
    model, reference = _pair(CheckpointedStack())
    aotdist.compile_regions(model, backend="aot_eager")
    batches = [(torch.randn(2, 5, 16),) for _ in range(3)]
    with metrics.track(model) as m:
        assert_training_parity(model, reference, batches)
    assert m.regions["GPTBlock"].subgraphs == 1, m.summary()
    assert not any(decisions), decisions  # min-cut recomputes the checkpointed calls
