"""Which partitioner splits a graph: the graph around regions saves what its backward
needs (``default_partition``; its pointwise glue and aotdist's index-derived ops
recomputed), while region bodies and graphs with a user's recompute policy
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
from aotdist.backends import partition, recompute
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


def _around_region(*, policy: CheckpointPolicy, aotdists: bool, impure: bool = False):
    """A graph around a region whose input op carries ``policy``, set by aotdist's
    index-derived pass (``aotdists``) or by a user; ``impure``: it also writes an input."""
    g = torch.fx.Graph()
    x = g.placeholder("primals_1")
    y = g.call_function(torch.ops.aten.relu.default, (x,))
    y.meta["recompute"] = policy
    if aotdists:
        y.meta[recompute.AOTDIST_POLICY] = True
    if impure:
        g.call_function(torch.ops.aten.copy_.default, (x, y))
    z = g.call_function(torch.ops.higher_order.invoke_subgraph, (None, "id", y))
    g.output((z,))
    return torch.fx.GraphModule(nn.Module(), g)


def test_aotdists_own_recompute_tags_keep_the_graph_around_regions_off_min_cut():
    prefer, must = CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE
    assert partition.saves_what_backward_needs(_around_region(policy=prefer, aotdists=True))
    # a user's policy, or a policy other than aotdist's, needs min-cut
    assert not partition.saves_what_backward_needs(_around_region(policy=prefer, aotdists=False))
    assert not partition.saves_what_backward_needs(_around_region(policy=must, aotdists=True))
    # default_partition refuses recompute tags beside an impure op
    impure = _around_region(policy=prefer, aotdists=True, impure=True)
    assert not partition.saves_what_backward_needs(impure)


def _joint_with_glue(*, impure: bool = False) -> torch.fx.GraphModule:
    """Forward: a norm-like statistic, pointwise glue and a random mask; backward: a
    pointwise op of the tangent."""
    aten = torch.ops.aten
    g = torch.fx.Graph()
    x = g.placeholder("primals_1")
    tangent = g.placeholder("tangents_1")
    mean = g.call_function(aten.mean.dim, (x, [-1], True))
    centred = g.call_function(aten.sub.Tensor, (x, mean))
    noise = g.call_function(aten.rand_like.default, (x,))
    kept = g.call_function(aten.mul.Tensor, (centred, noise))
    user = g.call_function(aten.relu.default, (kept,))
    user.meta["recompute"] = CheckpointPolicy.MUST_SAVE  # a user's policy stays
    if impure:
        g.call_function(aten.copy_.default, (x, centred))
    grad = g.call_function(aten.mul.Tensor, (tangent, centred))
    g.output((user, grad))
    return torch.fx.GraphModule(nn.Module(), g)


def test_the_glue_s_forward_pointwise_ops_are_recomputed_unless_random_or_impure():
    joint = _joint_with_glue()
    # not the reduction, the random op, a user's tag or the backward's op
    assert partition.recompute_pointwise_glue(joint) == ["sub_tensor", "mul_tensor"]
    nodes = {n.name: n for n in joint.graph.nodes}
    assert nodes["sub_tensor"].meta["recompute"] is CheckpointPolicy.PREFER_RECOMPUTE
    assert nodes["relu_default"].meta["recompute"] is CheckpointPolicy.MUST_SAVE
    assert "recompute" not in nodes["mul_tensor_1"].meta
    assert partition.recompute_pointwise_glue(_joint_with_glue(impure=True)) == []


def test_the_inductor_partitioner_is_a_custom_partitioner_named_by_version():
    fn = partition.inductor_partitioner()
    assert isinstance(fn, _compat.custom_partitioner_base())
    assert fn.uuid() == f"aotdist.region_partition.{aotdist.__version__}.{partition._RULE}"


def test_the_inductor_partitioner_pickles_by_reference_for_inductor_s_cache_key():
    """Inductor pickles its config, this option included, into each FX graph's cache key:
    a class pickle cannot find by module and name makes every graph bypass that cache."""
    import pickle

    fn = partition.inductor_partitioner()
    assert type(partition.inductor_partitioner()) is type(fn)  # one class, built once
    back = pickle.loads(pickle.dumps(fn))
    assert type(back) is type(fn) and back.uuid() == fn.uuid()


@pytest.mark.inductor
def test_a_second_inductor_compile_of_the_regions_loads_every_graph_from_inductor_s_cache(
    tmp_path, monkeypatch
):
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = TinyGPT(depth=2)
    (x,), _ = example_inputs(model)
    seen = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        compiled = aotdist.compile_regions(copy.deepcopy(model), backend="inductor")
        compiled(x).float().sum().backward()
        seen.append(dict(counters["inductor"]))
    first, second = seen
    assert first.get("fxgraph_cache_bypass", 0) == 0, first
    assert first.get("fxgraph_cache_miss", 0) > 0, first
    assert second.get("fxgraph_cache_bypass", 0) == 0, second
    assert second.get("fxgraph_cache_miss", 0) == 0, second
    assert second.get("fxgraph_cache_hit", 0) == first["fxgraph_cache_miss"], second


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
