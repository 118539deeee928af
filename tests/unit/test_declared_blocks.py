"""A model that declares its repeated blocks (diffusers' ``_repeated_blocks``, the class
names its ``compile_repeated_blocks()`` compiles) has those blocks as its regions; no
region holds one; elsewhere discovery is as before; the user's include and exclude win."""

from __future__ import annotations

import copy

import torch
from torch import nn

import aotdist
from aotdist import metrics
from aotdist.testing import assert_training_parity
from aotdist.testing.models import GPTBlock


class Stage(nn.Module):
    """A repeated unit around a block: discovery's outermost choice when nothing is declared."""

    def __init__(self):
        super().__init__()
        self.block = GPTBlock(16, 2)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(self.block(x))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.act = nn.GELU()

    def forward(self, x):
        return self.act(self.proj(x))


class Declaring(nn.Module):
    _repeated_blocks = ["GPTBlock"]

    def __init__(self, stages: int = 3):
        super().__init__()
        self.embed = nn.Linear(16, 16)  # the first block's input needs a gradient, as the rest's
        self.stages = nn.ModuleList(Stage() for _ in range(stages))
        self.heads = nn.ModuleList(Head() for _ in range(2))

    def forward(self, x):
        x = self.embed(x)
        for stage in self.stages:
            x = stage(x)
        for head in self.heads:
            x = x + head(x)
        return x


class Silent(Declaring):
    _repeated_blocks: list[str] = []  # diffusers' ModelMixin default: nothing declared


def _plan(model, **kwargs):
    return [(r.module_type.__name__, r.fqns) for r in aotdist.find_regions(model, **kwargs)]


def test_declared_blocks_are_the_regions_and_no_region_holds_one():
    assert _plan(Declaring()) == [
        ("GPTBlock", ("stages.0.block", "stages.1.block", "stages.2.block")),
        ("Head", ("heads.0", "heads.1")),
    ]


def test_without_a_declaration_the_outermost_unit_wins():
    assert _plan(Silent())[0] == ("Stage", ("stages.0", "stages.1", "stages.2"))


def test_include_and_exclude_win_over_the_declaration():
    assert _plan(Declaring(), include="Stage") == [("Stage", ("stages.0", "stages.1", "stages.2"))]
    assert _plan(Declaring(), exclude="GPTBlock")[0] == (
        "Stage",
        ("stages.0", "stages.1", "stages.2"),
    )


class Pipeline(nn.Module):
    """A declaring model beside modules of the same classes outside it."""

    def __init__(self):
        super().__init__()
        self.denoiser = Declaring()
        self.refiner = nn.ModuleList(Stage() for _ in range(2))

    def forward(self, x):
        x = self.denoiser(x)
        for stage in self.refiner:
            x = stage(x)
        return x


def test_a_declaration_holds_inside_the_declaring_model_only():
    plan = dict((fqns[0], (name, fqns)) for name, fqns in _plan(Pipeline()))
    assert plan["denoiser.stages.0.block"][0] == "GPTBlock"
    assert plan["refiner.0"] == ("Stage", ("refiner.0", "refiner.1"))


def test_a_declaring_model_trains_as_eager_with_one_subgraph_per_declared_class():
    torch.manual_seed(0)
    model = Declaring()
    for p in model.parameters():  # blocks whose weights differ
        p.data.add_(torch.randn_like(p) * 0.01)
    ref = copy.deepcopy(model)
    aotdist.compile_regions(model, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 5, 16, generator=g),) for _ in range(3)]
    with metrics.track(model) as tracked:
        assert_training_parity(model, ref, batches)
    st = tracked.regions["GPTBlock"]
    assert (st.instances, st.call_sites, st.subgraphs) == (3, 3, 1), tracked.summary()
