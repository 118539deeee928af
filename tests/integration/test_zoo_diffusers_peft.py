"""Models nobody here wrote, from two more libraries: diffusers' denoisers (DiT, MMDiT, UNet,
video transformers) built tiny from their constructor arguments, and peft's LoRA adapters
on frozen tiny transformers causal LMs. Each listed one builds and trains a step eagerly
(fast); a few train 3 SGD steps with aotdist against eager, and diffusers' own
``compile_repeated_blocks`` beside it (slow)."""

from __future__ import annotations

import pytest
import torch

from aotdist.check import CheckResult, check_family, render, resolve
from aotdist.check.families import without_randomness
from aotdist.check.families_diffusers import DIFFUSERS_MODELS
from aotdist.check.families_peft import PEFT_MODELS
from aotdist.check.zoo import SOURCES, source_specs
from aotdist.compile.verify import tolerance

pytestmark = pytest.mark.filterwarnings("ignore")


def _one_step(family) -> tuple[torch.nn.Module, torch.Tensor]:
    model, inputs = family.build(0)
    without_randomness(model)
    loss = family.loss_of(model(**inputs))
    loss.backward()
    return model, loss


@pytest.mark.parametrize("family", DIFFUSERS_MODELS, ids=lambda f: f.name)
def test_every_listed_diffusers_model_builds_tiny_and_trains_a_step_eagerly(family):
    pytest.importorskip("diffusers")
    model, loss = _one_step(family)
    assert model.training and torch.isfinite(loss) and loss.ndim == 0
    assert sum(p.numel() for p in model.parameters()) < 500_000  # tiny: 2-3 blocks of 32
    grads = [p.grad for p in model.parameters()]
    # an output the loss does not use (the last MMDiT block's text stream) leaves a few None
    assert sum(g is not None and bool(g.abs().sum()) for g in grads) >= 0.9 * len(grads)


@pytest.mark.parametrize("family", PEFT_MODELS, ids=lambda f: f.name)
def test_every_listed_peft_adapter_trains_only_its_lora_weights_with_dropout_off(family):
    pytest.importorskip("peft")
    model, inputs = family.build(0)
    dropouts = [m for n, m in model.named_modules() if n.endswith("lora_dropout.default")]
    assert dropouts and all(m.p == 0.05 for m in dropouts)
    model, loss = _one_step(family)
    # the checker's without_randomness reaches peft's own dropout modules
    assert all(m.p == 0.0 for n, m in model.named_modules() if n.endswith("lora_dropout.default"))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    # lora_B starts non-zero, so lora_A's gradients are not zeros either
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable.values())
    assert torch.isfinite(loss)


def test_diffusers_and_peft_specs_resolve_to_the_listed_tiny_builds():
    assert {"diffusers", "peft"} <= set(SOURCES)
    assert len(source_specs("diffusers")) >= 12 and len(source_specs("peft")) >= 4
    for spec in source_specs("diffusers") + source_specs("peft"):
        assert resolve(spec).source == spec.split(":")[0]
    assert resolve("diffusers:FluxTransformer2DModel") in DIFFUSERS_MODELS
    assert resolve("peft:llama") in PEFT_MODELS
    assert resolve("peft:olmo2").source == "peft"  # an unlisted type: peft's own targets
    with pytest.raises(ValueError, match="FluxTransformer2DModel.*module:factory"):
        resolve("diffusers:NoSuchModel")


def test_the_page_has_a_compile_repeated_blocks_column_for_diffusers_rows():
    stride = (
        "2 distinct subgraphs for 2 instances: its call sites pass inputs that differ (torch: "
        "reuse failed -- input 1 tensor metadata mismatch: stride (512, 32, 1) vs (704, 32, 1))"
    )
    rows = [
        CheckResult(
            "WanTransformer3DModel", "video", "diffusers", "reused", repeated_blocks="trains"
        ),
        CheckResult("DiTTransformer2DModel", "DiT", "diffusers", "reused"),
        CheckResult("llama", "LoRA", "peft", "reused"),
    ]
    page = render(rows, source=["diffusers", "peft"])
    header = next(line for line in page.splitlines() if line.startswith("| Family"))
    assert "compile_repeated_blocks" in header
    table = [line for line in page.splitlines() if line.startswith("| ")]
    assert all(line.count("|") == header.count("|") for line in table)
    assert "| trains |" in table[1] and "none declared" in table[2] and "| - |" in table[3]
    assert "compile_repeated_blocks" not in render(rows[2:], source="families")
    rows[0].notes["FluxSingleTransformerBlock"] = stride  # a layout's parens stay whole
    assert "(stride (512, 32, 1) vs (704, 32, 1))" in render(rows, source="diffusers")


def _trains_with_parity(result) -> None:
    assert result.ok and result.steps == 3, result.line() + "\n" + result.error
    assert result.status in ("reused", "partly reused"), result.line()
    rtol = tolerance("aot_eager")
    assert result.max_grad_diff <= rtol and result.max_buffer_diff <= rtol, result.line()
    assert result.max_loss_diff <= rtol * max(1.0, abs(result.loss_eager)), result.line()
    # every region compiled to fewer subgraphs than it has instances
    assert all(r["subgraphs"] < r["instances"] for r in result.regions.values()), result.line()
    if result.status == "partly reused":  # what is not kept is named
        assert set(result.notes) - {"gradients", "later steps"} <= set(result.regions), (
            result.line()
        )


@pytest.mark.slow
@pytest.mark.zoo
@pytest.mark.timeout(900)
@pytest.mark.parametrize("cls", ["WanTransformer3DModel", "UNet2DConditionModel"])
def test_diffusers_denoisers_train_with_parity_and_so_does_their_own_regional_compile(cls):
    pytest.importorskip("diffusers")
    result = check_family(f"diffusers:{cls}", whole_model=False)
    _trains_with_parity(result)
    assert result.repeated_blocks == "trains", result.line()  # both declare _repeated_blocks


@pytest.mark.slow
@pytest.mark.zoo
@pytest.mark.timeout(900)
def test_a_lora_adapter_on_a_frozen_causal_lm_trains_with_parity():
    pytest.importorskip("peft")
    result = check_family("peft:llama", whole_model=False)
    _trains_with_parity(result)
    assert result.regions["LlamaDecoderLayer"]["instances"] == 3, result.line()
