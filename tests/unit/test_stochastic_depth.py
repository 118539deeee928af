"""Stochastic depth in a region: a per-block drop rate no longer costs the shared subgraph.

torchvision's ``StochasticDepth``, timm's ``DropPath`` and transformers' ``*DropPath`` hold a drop rate that
grows with depth, a float Dynamo used to specialize each block's subgraph on. Parity
needs masks eager draws the same way: transformers' draw is ``torch.rand`` as eager's
(any rate); torchvision's and timm's are ``bernoulli_`` draws of another stream, so its rates here
are 0 and 1 (all-ones and all-zero masks, mixed across the blocks of one region).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import aotdist
from aotdist import metrics


def _train_step(model, reference, x, seed=3):
    torch.manual_seed(seed)
    got = model(x)
    got.float().square().mean().backward()
    torch.manual_seed(seed)
    want = reference(x)
    want.float().square().mean().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def _compiled_once(model, reference, x, backend="aot_eager"):
    keys = list(model.state_dict())
    aotdist.compile_regions(model, backend=backend)
    assert list(model.state_dict()) == keys  # the rate buffer is not persistent
    with warnings.catch_warnings(record=True) as caught, metrics.track(model) as m:
        warnings.simplefilter("always")
        _train_step(model, reference, x)
    lost = [str(w.message) for w in caught if issubclass(w.category, aotdist.RegionCompileWarning)]
    assert not lost and not m.reuse and m.regions, (lost, m.summary())
    for name, st in m.regions.items():
        assert (st.call_sites, st.subgraphs) == (st.instances, 1), (name, m.summary())


def test_torchvision_stochastic_depth_rates_are_data_and_every_block_shares_its_subgraph():
    torchvision = pytest.importorskip("torchvision")
    from torchvision.ops import StochasticDepth

    torch.manual_seed(0)
    model = torchvision.models.convnext_tiny(num_classes=10)
    drops = [m for m in model.modules() if isinstance(m, StochasticDepth)]
    for i, m in enumerate(drops):
        m.p = float(i % 2)  # 0, 1, 0, ...: a block kept whole, one whose branch is dropped
    reference = copy.deepcopy(model)
    _compiled_once(model, reference, torch.randn(2, 3, 32, 32))
    sd = drops[1]
    assert type(sd) is not StochasticDepth and isinstance(sd.p, float) and sd.p == 1.0
    sd.p = 0.25  # the attribute writes through to the compiled graph's tensor
    assert sd._aotdist_keep.item() == 0.75 and sd.p == 0.25
    aotdist.restore(model)
    assert type(sd) is StochasticDepth and sd.p == 0.25 and "_aotdist_keep" not in sd._buffers


@pytest.mark.inductor
@pytest.mark.timeout(300)
def test_convnext_blocks_with_stochastic_depth_share_one_subgraph_with_inductor():
    """The combination that used to crash (reused ConvNeXt blocks after a stem convolution,
    with Inductor): each block's rate differs, one subgraph, eager's step."""
    pytest.importorskip("torchvision")
    from torchvision.models.convnext import CNBlock

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, kernel_size=4, stride=4),
        *[CNBlock(16, 1.0, float(i % 2)) for i in range(3)],
    )
    reference = copy.deepcopy(model)
    _compiled_once(model, reference, torch.randn(2, 3, 16, 16), backend="inductor")


def test_transformers_drop_path_rates_are_data_and_training_matches_eager():
    transformers = pytest.importorskip("transformers")

    config = transformers.ConvNextConfig(
        num_channels=3,
        hidden_sizes=[16, 32],
        depths=[3, 3],
        num_stages=2,
        num_labels=4,
        drop_path_rate=0.3,
    )
    torch.manual_seed(0)
    model = transformers.ConvNextForImageClassification(config)
    drops = [m for m in model.modules() if type(m).__name__.endswith("DropPath")]
    assert len(drops) == 5  # the first block, at rate 0, holds nn.Identity
    for i, m in enumerate(drops):  # distinct, nonzero: eager draws a mask for each block
        m.drop_prob = 0.1 + 0.1 * i
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 32, 32)
    _compiled_once(_Logits(model), _Logits(reference), x)


@pytest.mark.parametrize("scale_by_keep", [True, False])
def test_timm_drop_path_rates_are_data_and_every_block_shares_its_subgraph(scale_by_keep):
    pytest.importorskip("timm")
    from timm.layers import DropPath
    from timm.models.vision_transformer import Block

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 16),  # a stem: the first block's input needs grad
        *[Block(16, num_heads=2, drop_path=0.5) for _ in range(4)],
    )
    drops = [m for m in model.modules() if isinstance(m, DropPath)]
    for i, m in enumerate(drops):  # 0, 1, 0, ...: kept whole, dropped, across one region
        m.drop_prob, m.scale_by_keep = float(i % 2), scale_by_keep
    reference = copy.deepcopy(model)
    _compiled_once(model, reference, torch.randn(2, 5, 16))
    assert type(drops[1]) is not DropPath and drops[1].drop_prob == 1.0
    aotdist.restore(model)
    assert type(drops[1]) is DropPath and drops[1].drop_prob == 1.0


class _Logits(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(pixel_values=x).logits


def test_a_swapped_stochastic_depth_pickles_as_made_again_while_saving():
    torchvision = pytest.importorskip("torchvision")
    import pickle

    from torchvision.ops import StochasticDepth

    from aotdist import per_process
    from aotdist.compile import mark_regions

    class Block(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.fc, self.drop = nn.Linear(4, 4), StochasticDepth(p, "row")

        def forward(self, x):
            return x + self.drop(self.fc(x))

    model = nn.Sequential(Block(0.1), Block(0.2))
    mark_regions(model)
    drop = model[1].drop
    with per_process.pickled_with_region_depth(model):
        copy_ = pickle.loads(pickle.dumps(drop))
    assert type(copy_) is type(drop) and copy_.p == 0.2
    assert copy_._aotdist_keep.item() == pytest.approx(0.8)
    assert torchvision.ops.StochasticDepth in type(drop).__mro__
