"""``aotdist check`` over several optimizer steps: a wrong buffer update or a gradient that
goes wrong after the first step fails the check; timm and torchtitan models are specs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import aotdist
from aotdist.check import check_family, resolve
from aotdist.check.families import Family, stochastic_depth, without_randomness
from aotdist.check.families_timm import timm_family
from aotdist.check.families_titan import titan_unavailable
from aotdist.check.runner import STEPS

pytestmark = pytest.mark.filterwarnings("ignore")


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return x + torch.relu(self.bn(self.conv(x)))


class _Net(nn.Module):
    """Three BatchNorm blocks with different weights."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 1)  # every block's input requires grad
        self.blocks = nn.Sequential(*(_Block() for _ in range(3)))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def _family() -> Family:
    def build(seed):
        torch.manual_seed(seed)
        return _Net(), {"x": torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))}

    return Family("bn", "CNN", build, "user")


def _wrapped(monkeypatch, after):
    """``compile_regions`` that then runs ``after(model)``: a stand-in for a fix that gets
    something wrong."""
    real = aotdist.compile_regions

    def compile_regions(model, **kwargs):
        real(model, **kwargs)
        after(model)
        return model

    monkeypatch.setattr(aotdist, "compile_regions", compile_regions)


@pytest.mark.timeout(120)
def test_three_steps_with_eager_s_losses_gradients_and_buffers_is_parity():
    result = check_family(_family(), whole_model=False)
    assert result.steps == STEPS == 3
    assert result.status == "reused", result.line()
    assert result.max_loss_diff < 1e-6 and result.max_buffer_diff < 1e-4, result.line()
    assert "buffer diff" in result.line() and "over 3 steps" in result.line()


@pytest.mark.timeout(120)
def test_a_wrong_running_statistic_fails_the_check(monkeypatch):
    # In training BatchNorm normalizes with the batch's statistics: a wrong running mean
    # changes no loss or gradient, only the buffer (and eval after training).
    def perturb(model):
        with torch.no_grad():
            model.blocks[1].bn.running_mean.add_(0.5)

    _wrapped(monkeypatch, perturb)
    result = check_family(_family(), whole_model=False)
    assert result.status == "parity" and not result.ok, result.line()
    assert result.max_loss_diff < 1e-6 and result.max_grad_diff < 1e-4, result.line()
    assert result.max_buffer_diff > 0.1, result.line()
    assert result.notes["parity"] == (
        "differs from eager from step 1: buffer blocks.1.bn.running_mean"
    ), result.notes


@pytest.mark.timeout(120)
def test_a_gradient_that_goes_wrong_after_the_first_step_fails_the_check(monkeypatch):
    calls = []

    def perturb(model):
        def hook(grad):
            calls.append(1)
            return grad * 2 if len(calls) == 2 else grad

        model.blocks[2].conv.weight.register_hook(hook)

    _wrapped(monkeypatch, perturb)
    result = check_family(_family(), whole_model=False)
    assert result.status == "parity", result.line()
    assert result.notes["parity"].startswith("differs from eager from step 2: "), result.notes
    assert "gradient of blocks.2.conv.weight" in result.notes["parity"], result.notes


def test_randomness_is_off_for_the_comparison_and_named_when_on():
    timm = pytest.importorskip("timm")
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        num_classes=10,
        drop_path_rate=0.1,
        img_size=32,
        depth=2,
    )
    assert stochastic_depth(model)
    without_randomness(model)
    assert not stochastic_depth(model)
    assert all(m.drop_prob == 0.0 for m in model.modules() if type(m).__name__ == "DropPath")


@pytest.mark.timeout(180)
def test_a_timm_spec_trains_with_parity_and_judges_reuse_with_stochastic_depth_on():
    pytest.importorskip("timm")
    assert resolve("timm:vit_tiny_patch16_224").source == "timm"
    result = check_family(
        timm_family("vit_tiny_patch16_224", "ViT", size=32, depth=2), whole_model=False
    )
    assert result.status == "reused", result.line() + result.error
    assert result.stochastic_depth == "reused", result.line()  # drop rates 0.0 and 0.1
    assert result.max_loss_diff == 0.0 and result.max_grad_diff < 1e-4, result.line()


def _titan_importable() -> None:
    pytest.importorskip("torchtitan")
    missing = titan_unavailable("llama3")
    if missing:
        pytest.skip(missing)


@pytest.mark.timeout(180)
def test_a_torchtitan_spec_is_built_from_its_model_code_and_trains_with_parity():
    _titan_importable()
    result = check_family("titan:llama3", whole_model=False)
    assert result.source == "torchtitan", result.line()
    assert result.status == "reused", result.line() + result.error
    assert result.regions == {
        "Llama3TransformerBlock": {"instances": 3, "call_sites": 3, "subgraphs": 1, "inlined": 0}
    }, result.regions
    assert result.max_loss_diff == 0.0 and result.max_grad_diff < 1e-4, result.line()


def test_a_torchtitan_model_on_a_torch_its_code_does_not_import_on_is_not_built():
    pytest.importorskip("torchtitan")
    if titan_unavailable("llama3") is None:
        pytest.skip("torchtitan's model code imports on this torch")
    result = check_family("titan:llama3", whole_model=False)
    assert result.status == "not built", result.line()
    assert "needs torch >= 2.12 " in result.error, result.error
