"""aotdist's region fixes hold for modules whose ``forward`` is not the library's.

Where aotdist changes what runs inside a region (BatchNorm's running statistics,
stochastic depth's drop rate), it does so only where the module's ``forward`` is exactly
the function the fix reproduces. A subclass that overrides ``forward`` (an activation
after the norm, as timm's ``BatchNormAct2d``; a SyncBatchNorm-style variant; a custom
DropPath) runs as written: its losses, gradients and running statistics stay eager's over
several optimizer steps. A BatchNorm subclass's region stays one reused subgraph (its
running statistics are written back by the caller, aotdist.fixes.hoist); a custom
DropPath's rate specializes the graph as written.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import aotdist
from aotdist import metrics
from aotdist.testing import assert_training_parity
from aotdist.testing.models import BatchNormRelu, ConvNormBlock


class _ScaledBatchNorm(nn.BatchNorm2d):
    """A variant computing its own normalization from the running-statistics functional
    (as SyncBatchNorm does), then scaling it."""

    def forward(self, x):
        self.num_batches_tracked.add_(1)
        out = F.batch_norm(
            x,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            self.training,
            self.momentum,
            self.eps,
        )
        return 2.0 * out


def _net(norm: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *[ConvNormBlock(8, norm) for _ in range(3)])
    for block in net[1:]:  # blocks whose norms differ too
        nn.init.uniform_(block.norm.weight, 0.5, 1.5)
        nn.init.uniform_(block.norm.bias, -0.5, 0.5)
    return net


def _batches(steps: int = 3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 8, 8, generator=g),) for _ in range(steps)]


def _train_compiled(model, reference, *, backend="aot_eager"):
    aotdist.compile_regions(model, backend=backend)
    with warnings.catch_warnings(record=True) as caught, metrics.track(model) as m:
        warnings.simplefilter("always")
        assert_training_parity(model, reference, _batches())
    return m, [
        str(w.message) for w in caught if issubclass(w.category, aotdist.RegionCompileWarning)
    ]


def _reused(m, warned) -> None:
    assert not warned and not m.demoted, (warned, m.summary())
    assert (m.regions["ConvNormBlock"].call_sites, m.regions["ConvNormBlock"].subgraphs) == (3, 1)


@pytest.mark.parametrize("norm", [BatchNormRelu, _ScaledBatchNorm], ids=["act", "own_bn"])
def test_a_batchnorm_subclass_with_its_own_forward_trains_as_eager_in_one_subgraph(norm):
    model = _net(norm)
    reference = copy.deepcopy(model)
    m, warned = _train_compiled(model, reference)  # buffers compared after every step
    _reused(m, warned)
    assert type(model[1].norm) is norm  # never swapped
    assert model[1].norm.num_batches_tracked.item() == 3


def test_torch_s_own_batchnorm_still_shares_one_subgraph_in_the_same_model():
    model = _net(nn.BatchNorm2d)
    reference = copy.deepcopy(model)
    m, warned = _train_compiled(model, reference)
    _reused(m, warned)


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_batchnorm_subclass_with_its_own_forward_trains_as_eager_with_inductor():
    model = _net(BatchNormRelu)
    reference = copy.deepcopy(model)
    m, warned = _train_compiled(model, reference, backend="inductor")
    _reused(m, warned)


def test_timm_batchnorm_act_keeps_its_activation():
    timm_layers = pytest.importorskip("timm.layers")
    model = _net(timm_layers.BatchNormAct2d)
    reference = copy.deepcopy(model)
    m, warned = _train_compiled(model, reference)
    _reused(m, warned)
    assert (
        isinstance(model[1].norm.act, nn.ReLU) and type(model[1].norm) is timm_layers.BatchNormAct2d
    )


class _HalfDropPath(nn.Module):
    """A stochastic depth of the user's own: its rate specializes the graph, as written."""

    def __init__(self, drop_prob: float):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        return x * (1.0 - self.drop_prob) if self.training else x


def _drop_path_subclasses():
    """Subclasses of each library's stochastic depth whose forward is their own."""
    found = []
    if (tv := pytest.importorskip("torchvision")) is not None:
        found.append(
            type("MyStochasticDepth", (tv.ops.StochasticDepth,), {"forward": _HalfDropPath.forward})
        )
    timm_layers = pytest.importorskip("timm.layers")
    found.append(type("MyDropPath", (timm_layers.DropPath,), {"forward": _HalfDropPath.forward}))
    return found


class _DropBlock(nn.Module):
    def __init__(self, drop: nn.Module):
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), drop

    def forward(self, x):
        return x + self.drop(self.fc(x))


def test_a_drop_path_subclass_with_its_own_forward_runs_as_written():
    for cls in _drop_path_subclasses():
        torch.manual_seed(0)
        blocks = [
            _DropBlock(
                cls(0.1 * (i + 1), "row") if "Stochastic" in cls.__name__ else cls(0.1 * (i + 1))
            )
            for i in range(3)
        ]
        for i, b in enumerate(blocks):
            b.drop.drop_prob = 0.1 * (i + 1)
        model = nn.Sequential(*blocks)
        reference = copy.deepcopy(model)
        aotdist.compile_regions(model, backend="aot_eager")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", aotdist.RegionCompileWarning)  # one graph a rate
            assert_training_parity(model, reference, [(torch.randn(4, 8),) for _ in range(3)])
        assert type(model[0].drop) is cls, cls  # never swapped
