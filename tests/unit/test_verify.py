"""The first-step check (``compile.verify``): the first training call compiled and eager
from the same state; a mismatch stops training and names the region.

The wrong result is made as aotdist once made it: BatchNorm's training fix applied to a
subclass whose forward adds an activation (timm's ``BatchNormAct2d``), which dropped it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import aotdist
from aotdist.fixes import batchnorm
from aotdist.testing import assert_training_parity, record_logs
from aotdist.testing.models import BatchNormRelu, ConvNormBlock

VERIFY = {"compile": {"backend": "aot_eager", "verify": True}}


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 1), *[ConvNormBlock(4, BatchNormRelu) for _ in range(3)], nn.Flatten()
    )


def _x():
    return torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))


def test_a_region_that_computes_wrong_is_named_before_any_step(monkeypatch):
    # the isinstance swap aotdist once had: it replaced BatchNormRelu's forward
    monkeypatch.setattr(batchnorm, "_reproduced", lambda cls: True)
    model = _cnn()
    before = copy.deepcopy(model.state_dict())
    aotdist.compile_regions(model, backend="aot_eager", verify=True)
    with pytest.raises(
        aotdist.RegionMismatchError, match=r"region\(s\) \['ConvNormBlock'\]"
    ) as err:
        model(_x())
    assert err.value.regions == ["ConvNormBlock"]
    assert err.value.comparison.grad_diff > 1e-2
    for key, value in model.state_dict().items():  # buffers put back: nothing trained
        torch.testing.assert_close(value, before[key], msg=key)


def test_the_check_passes_and_training_goes_on_as_eager():
    model = _cnn()
    reference = copy.deepcopy(model)
    aotdist.compile_regions(model, backend="aot_eager", verify=True)
    # the check's own runs leave buffers, RNG and .grad as they were: 3 steps stay eager's
    with record_logs() as logs:
        assert_training_parity(model, reference, [(_x(),)] * 3)
    assert model[1].norm.num_batches_tracked.item() == 3
    checks = [r.getMessage() for r in logs if "first-step check" in r.getMessage()]
    assert len(checks) == 1 and "first-step check: passed" in checks[0], checks  # once


class _DropBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(0.5)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.fc(x)))


def test_dropout_is_off_for_the_check_and_on_for_training():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _DropBlock(), _DropBlock(), _DropBlock())
    reference = copy.deepcopy(model)
    aotdist.compile_regions(model, backend="aot_eager", verify=True)
    x = torch.randn(4, 8)
    with record_logs() as logs:
        assert_training_parity(model, reference, [(x,)] * 2)  # masks as eager's: same RNG
    assert any("first-step check: passed" in r.getMessage() for r in logs)
    assert all(m.training for m in model.modules())


def test_a_whole_model_difference_is_said_to_be_the_compiler_s(monkeypatch):
    class Twice(nn.Module):  # computes otherwise under compile, in a region or not
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) * (2 if torch.compiler.is_compiling() else 1)

    torch.manual_seed(0)
    model = nn.Sequential(Twice(), Twice(), Twice())
    aotdist.compile_regions(model, backend="aot_eager", verify=True)
    with pytest.raises(aotdist.RegionMismatchError, match="compiler's own") as err:
        model(torch.randn(2, 4))
    assert err.value.regions == []


def test_graph_mode_fsdp_refuses_the_check_with_the_fix():
    from aotdist.fsdp.graph import check_graph_config

    config = aotdist.AOTDistConfig.from_dict(
        {"fsdp": {"enabled": True, "mode": "graph"}, "compile": {"verify": True}}
    )
    with pytest.raises(aotdist.ConfigError, match="fsdp.mode: hooks"):
        check_graph_config(config)


def test_the_accelerate_hook_runs_the_check(monkeypatch):
    pytest.importorskip("accelerate")
    from accelerate.hooks import add_hook_to_module
    from aotdist.callbacks import RegionalCompileHook

    monkeypatch.setattr(batchnorm, "_reproduced", lambda cls: True)
    model = _cnn()
    add_hook_to_module(model, RegionalCompileHook(VERIFY))
    with pytest.raises(aotdist.RegionMismatchError) as err:  # training stops either way
        model(_x())
    # named on torch 2.11 too, where a bound method compiles through a wrapper code that
    # every compile shares (the trials once ran the first graph again: "the compiler's own")
    assert err.value.regions == ["ConvNormBlock"], str(err.value)


def test_the_lightning_callback_runs_the_check(monkeypatch, tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from aotdist.callbacks import RegionalCompile

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _cnn()

        def training_step(self, batch, batch_idx):
            return self.model(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    monkeypatch.setattr(batchnorm, "_reproduced", lambda cls: True)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        callbacks=[RegionalCompile(VERIFY)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_x()), batch_size=2)
    with pytest.raises(aotdist.RegionMismatchError, match="ConvNormBlock"):
        trainer.fit(Module(), data)


def test_stochastic_depth_is_off_for_the_check_and_keeps_its_rate():
    tv = pytest.importorskip("torchvision")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.drop = nn.Linear(8, 8), tv.ops.StochasticDepth(0.5, "row")

        def forward(self, x):
            return x + self.drop(torch.tanh(self.fc(x)))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Block(), Block(), Block())
    aotdist.compile_regions(model, backend="aot_eager", verify=True)
    with record_logs() as logs:  # the compiled draw is another stream: compared at rate 0
        model(torch.randn(4, 8)).sum().backward()
    assert any("first-step check: passed" in r.getMessage() for r in logs)
    assert model[1].drop.p == 0.5 and model[1].drop._aotdist_keep.item() == 0.5
