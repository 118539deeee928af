"""Region discovery: where blocks live, signatures, outermost selection, include/exclude."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import aotdist
from aotdist.regions import abbreviate_fqns, structural_signature
from aotdist.testing import AliasingNet, TinyGPT, TinyResNet, TinyViT
from aotdist.testing.models import BasicBlock, EncoderBlock, GPTBlock


def test_finds_blocks_in_module_list():
    plan = aotdist.find_regions(TinyGPT(depth=5))
    assert [r.name for r in plan] == ["GPTBlock"]
    assert plan[0].module_type is GPTBlock
    assert plan[0].fqns == tuple(f"blocks.{i}" for i in range(5))


def test_finds_blocks_in_sequential():
    plan = aotdist.find_regions(TinyViT(depth=3))
    assert len(plan) == 1 and plan[0].module_type is EncoderBlock
    assert plan[0].fqns == ("encoder.0", "encoder.1", "encoder.2")


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({"a": GPTBlock(16, 2), "b": GPTBlock(16, 2)})
        self.first = GPTBlock(16, 2)  # plain attributes
        self.second = GPTBlock(16, 2)
        self.other = GPTBlock(32, 2)  # same class, other shapes: not the same region


def test_finds_blocks_in_module_dict_and_plain_attributes():
    plan = aotdist.find_regions(_Holder())
    assert len(plan) == 1
    assert set(plan[0].fqns) == {"blocks.a", "blocks.b", "first", "second"}


def test_same_class_different_shapes_gives_separate_regions():
    plan = aotdist.find_regions(TinyResNet(widths=(8, 16, 32), blocks_per_stage=3))
    assert [r.fqns for r in plan] == [
        ("stages.0.0", "stages.0.1", "stages.0.2"),
        ("stages.1.1", "stages.1.2"),
        ("stages.2.1", "stages.2.2"),
    ]
    assert all(r.module_type is BasicBlock for r in plan)
    assert len({r.signature for r in plan}) == 3
    assert len({r.name for r in plan}) == 3


def test_outermost_wins_over_nested_repeats():
    plan = aotdist.find_regions(TinyGPT(depth=3))
    # Attention and MLP repeat 3 times too, but inside the blocks.
    assert [r.module_type for r in plan] == [GPTBlock]
    # Excluding the blocks exposes the nested repeats.
    nested = aotdist.find_regions(TinyGPT(depth=3), exclude="GPTBlock")
    assert {r.module_type.__name__ for r in nested} == {"Attention", "MLP"}
    assert nested.by_name("MLP").fqns == tuple(f"blocks.{i}.mlp" for i in range(3))


def test_signature_covers_config_attributes_and_dtypes():
    a, b = nn.Sequential(nn.Conv2d(4, 4, 3)), nn.Sequential(nn.Conv2d(4, 4, 3, stride=2))
    assert structural_signature(a) != structural_signature(b)
    c = GPTBlock(16, 2)
    d = GPTBlock(16, 2).to(torch.float64)
    assert structural_signature(c) != structural_signature(d)
    assert structural_signature(c) == structural_signature(GPTBlock(16, 2))


def test_include_by_class_and_by_glob():
    model = TinyGPT(depth=4)
    assert aotdist.find_regions(model, include="MLP")[0].fqns == tuple(
        f"blocks.{i}.mlp" for i in range(4)
    )
    plan = aotdist.find_regions(model, include=["blocks.[0-2]"])
    assert plan[0].fqns == ("blocks.0", "blocks.1", "blocks.2")
    # include can name leaves, which are skipped by default
    leaf = aotdist.find_regions(model, include="blocks.*.ln1")
    assert leaf[0].module_type is nn.LayerNorm and leaf[0].count == 4


def test_exclude_by_glob_drops_instances():
    plan = aotdist.find_regions(TinyGPT(depth=4), exclude="blocks.3")
    assert plan[0].fqns == ("blocks.0", "blocks.1", "blocks.2")


def test_min_repeats():
    model = TinyResNet(widths=(8, 16), blocks_per_stage=2)
    assert [r.count for r in aotdist.find_regions(model)] == [2]
    singles = aotdist.find_regions(model, include="BasicBlock", min_repeats=1)
    assert sum(r.count for r in singles) == 4
    with pytest.raises(aotdist.ConfigError, match="min_repeats"):
        aotdist.find_regions(model, min_repeats=0)


def test_unknown_pattern_is_config_error_listing_classes():
    with pytest.raises(aotdist.ConfigError) as info:
        aotdist.find_regions(TinyGPT(depth=2), include=["GPTBlok"])
    msg = str(info.value)
    assert "GPTBlok" in msg and "GPTBlock (x2)" in msg and "blocks.0" in msg
    with pytest.raises(aotdist.ConfigError, match="exclude"):
        aotdist.find_regions(TinyGPT(depth=2), exclude="nothing.*")
    with pytest.raises(aotdist.ConfigError, match="non-empty strings"):
        aotdist.find_regions(TinyGPT(depth=2), include=[3])


def test_no_regions_in_a_model_without_repeats():
    assert len(aotdist.find_regions(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))) == 0


def test_plan_table_and_dict():
    plan = aotdist.find_regions(TinyGPT(depth=32))
    text = str(plan)
    assert "GPTBlock" in text and "blocks.{0..31}" in text and "32" in text
    params = sum(p.numel() for p in GPTBlock(32, 2).parameters())
    assert f"{params:,}" in text
    assert plan.to_dict()["regions"][0]["fqns"][31] == "blocks.31"
    assert plan.region_of("blocks.7").name == "GPTBlock" and plan.region_of("ln_f") is None


def test_abbreviation():
    assert abbreviate_fqns(["a.1", "a.2", "a.3"]) == "a.{1..3}"
    assert abbreviate_fqns(["a.1", "a.3"]) == "a.{1,3}"
    assert abbreviate_fqns(["x", "y", "z", "w"]) == "x, y, z, ... (+1)"


def test_aliasing_net_regions():
    plan = aotdist.find_regions(AliasingNet(depth=3))
    assert plan[0].fqns == ("blocks.0", "blocks.1", "blocks.2")


class _Scaled(nn.Module):
    def __init__(self, scale: float, layer_idx: int):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = scale  # used in forward
        self.layer_idx = layer_idx  # bookkeeping, as in transformers' attention

    def forward(self, x):
        return x + self.scale * self.fc(x)


class _ScaledNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([_Scaled(1.0, 0), _Scaled(1.0, 1), _Scaled(3.0, 2)])

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return x


def test_user_attributes_do_not_split_regions_and_stay_correct():
    import copy

    from aotdist import metrics
    from aotdist.testing.parity import assert_parity

    model = _ScaledNet()
    plan = aotdist.find_regions(model)
    assert plan[0].fqns == ("blocks.0", "blocks.1", "blocks.2")
    reference = copy.deepcopy(model)
    aotdist.compile_regions(model, backend="aot_eager")
    with metrics.track(model) as m:
        assert_parity(model, reference, (torch.randn(2, 8),))
    # blocks.2 computes with another scale: Dynamo's reuse check traces it separately.
    # torch 2.15 inlines that single-use trace (2 call sites, 1 subgraph, 1 inlined);
    # torch 2.11 keeps it a subgraph (3 call sites, 2 subgraphs). Either way: two
    # distinct computations, blocks.0 and blocks.1 share one subgraph, parity above.
    stats = m.regions["_Scaled"]
    assert stats.call_sites + stats.inlined == 3, m.summary()
    assert stats.subgraphs + stats.inlined == 2 and stats.subgraphs >= 1, m.summary()


def test_include_matching_only_distinct_modules_is_config_error():
    with pytest.raises(aotdist.ConfigError, match="min_repeats=1"):
        aotdist.find_regions(
            TinyResNet(widths=(8, 16), blocks_per_stage=2), include=["stages.0.0", "stages.1.0"]
        )
