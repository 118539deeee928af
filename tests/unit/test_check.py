"""``aotdist check``: the classification of one training step, and the command's exits."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import aotdist
from aotdist.check import FAMILIES, CheckResult, check_family, check_fsdp, family, render, resolve
from aotdist.check.families import Family
from aotdist.check.runner import _classify, _region_warnings, _verdict
from aotdist.check.steps import Diff
from aotdist.check.steps import grad_diff as _grad_diff
from aotdist.cli import main
from aotdist.compile.verify import tolerance
from aotdist.errors import RegionCompileWarning
from aotdist.metrics import CompileMetrics, RegionStats
from aotdist.testing.models import TinyGPT


def toy():
    """A ``module:factory`` for ``aotdist check``: three blocks whose weights differ."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, depth=3, heads=4, seq_len=16)
    return model, (torch.randint(0, 64, (2, 16)),)


def not_a_pair():
    return nn.Linear(2, 2)


def _metrics(**kw) -> CompileMetrics:
    m = CompileMetrics()
    m.regions = {
        "Block": RegionStats(instances=3, call_sites=3, subgraphs=1),
        "Other": RegionStats(instances=2, call_sites=2, subgraphs=1),
    }
    for k, v in kw.items():
        setattr(m, k, v)
    return m


@pytest.mark.parametrize(
    "fields, warned, status",
    [
        ({}, [], "reused"),
        ({"reuse": {"Block": "differs in scale (float)"}}, [], "partly reused"),
        ({"demoted": {"Block": "torch: aliasing"}}, [], "partly reused"),
        ({"demoted": {"Block": "x", "Other": "y"}}, [], "demoted"),
        ({"eager": {"Block": "FSDP class"}}, ["aotdist region 'Block' ran eager"], "partly reused"),
        ({"eager": {"Block": "FSDP class"}}, [], "eager!"),
        ({"regions": {}}, [], "no regions"),
    ],
)
def test_classification(fields, warned, status):
    result = CheckResult("m")
    _classify(result, _metrics(**fields), warned)
    assert result.status == status
    assert result.ok == (status != "eager!")
    for source in ("reuse", "demoted", "eager"):
        for name in fields.get(source, {}):
            assert name in result.notes


def test_every_family_has_a_unique_name_and_resolves():
    names = [f.name for f in FAMILIES]
    assert len(names) == len(set(names)) and len(names) >= 12
    assert resolve("llama") is family("llama")
    assert resolve("hf:llama") is family("llama")
    assert resolve("hf:cohere").name == "cohere"
    with pytest.raises(ValueError, match="hf:TYPE"):
        resolve("nonexistent")
    with pytest.raises(KeyError, match="llama"):
        family("nonexistent")


@pytest.mark.timeout(120)
def test_a_user_factory_is_checked_against_eager_and_torch_compile():
    result = check_family(f"{__name__}:toy")
    assert result.status == "reused", result
    assert result.regions["GPTBlock"]["instances"] == 3
    assert result.regions["GPTBlock"]["subgraphs"] == 1
    assert result.whole_model == "trains"
    assert result.loss_aotdist == pytest.approx(result.loss_eager, abs=1e-5)
    assert result.max_grad_diff < 1e-4


@pytest.mark.timeout(120)
def test_a_crash_where_torch_compile_trains_fails_the_check(monkeypatch, capsys):
    def broken(model, **kwargs):
        raise RuntimeError("an aotdist bug")

    monkeypatch.setattr(aotdist, "compile_regions", broken)
    assert main(["check", f"{__name__}:toy"]) == 1
    out = capsys.readouterr()
    assert "crash" in out.out and "an aotdist bug" in out.err


def _perturbing_first(model: nn.Module) -> nn.Module:
    """Adds noise to the head's weights: a stand-in for a compiler that gets them wrong."""
    with torch.no_grad():
        head = list(model.parameters())[-1]
        head.add_(torch.randn_like(head))
    return model


@pytest.mark.timeout(120)
def test_a_crash_where_torch_compile_trains_wrong_is_torch_s(monkeypatch):
    def broken(model, **kwargs):
        raise RuntimeError("an aotdist bug")

    monkeypatch.setattr(aotdist, "compile_regions", broken)
    monkeypatch.setattr(
        "aotdist.check.runner._compile_whole", lambda model, backend: _perturbing_first(model)
    )
    result = check_family(f"{__name__}:toy")
    assert result.status == "torch.compile fails too", result
    assert result.whole_model.startswith("wrong gradients (grad diff "), result.whole_model
    assert result.ok


@pytest.mark.timeout(120)
def test_a_parity_failure_says_whether_whole_model_compile_is_wrong_too(monkeypatch):
    real = aotdist.compile_regions
    monkeypatch.setattr(
        aotdist, "compile_regions", lambda model, **kwargs: real(_perturbing_first(model), **kwargs)
    )
    monkeypatch.setattr(
        "aotdist.check.runner._compile_whole", lambda model, backend: _perturbing_first(model)
    )
    result = check_family(f"{__name__}:toy")
    assert result.status == "parity" and not result.ok
    assert "whole-model torch.compile's gradients are off eager's too" in result.notes["gradients"]


def _grads_off(model, by: float):
    """Scales the head's gradient by ``1 + by``: the loss stays eager's, the gradient not."""
    head = list(model.parameters())[-1]
    head.register_hook(lambda g: g * (1 + by))
    return model


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("regions", "whole", "status"),
    [
        (1e-3, 1e-3, "torch.compile fails too"),  # as far off as whole-model compile: torch's
        (1e-2, 1e-3, "parity"),  # ten times further off: the regions'
    ],
)
def test_gradients_off_as_much_as_whole_model_compile_s_are_torch_s(
    monkeypatch, regions, whole, status
):
    real = aotdist.compile_regions
    monkeypatch.setattr(
        aotdist,
        "compile_regions",
        lambda model, **kwargs: real(_grads_off(model, regions), **kwargs),
    )
    monkeypatch.setattr(
        "aotdist.check.runner._compile_whole", lambda model, backend: _grads_off(model, whole)
    )
    result = check_family(f"{__name__}:toy")
    assert result.status == status, result.line()
    assert "whole-model torch.compile's gradients are off eager's too" in result.notes["gradients"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rounding", [True, False])
def test_gradients_as_close_to_float64_eager_as_eager_is_are_rounding(monkeypatch, rounding):
    real = aotdist.compile_regions
    monkeypatch.setattr(
        aotdist, "compile_regions", lambda model, **kwargs: real(_grads_off(model, 1e-3), **kwargs)
    )
    monkeypatch.setattr(
        "aotdist.check.runner._compile_whole", lambda model, backend: _grads_off(model, 1e-3)
    )
    seen = {}

    def errors(exact, runs):  # the float64 run is real; the errors as a rounding case has
        seen["exact"] = exact()
        off = 1e-3 if rounding else 1e-1
        return {"eager": 1e-3, "aotdist": off, "whole-model compile": off}

    monkeypatch.setattr("aotdist.check.runner.rounding_errors", errors)
    result = check_family(f"{__name__}:toy")
    assert all(g.dtype == torch.float64 for g in seen["exact"][0].values() if g is not None)
    if rounding:
        assert result.status == "reused" and result.ok, result.line()
        assert "fp32 rounding" in result.notes["gradients"] and "parity" not in result.notes
        assert result.whole_model == "trains", result.whole_model
    else:  # off as whole-model compile is: torch's, as without the float64 run
        assert result.status == "torch.compile fails too", result.line()
        assert result.whole_model.startswith("wrong gradients"), result.whole_model
        assert "fp32 rounding" not in str(result.notes)


@pytest.mark.timeout(120)
def test_a_wrong_result_fails_the_check(monkeypatch, capsys, tmp_path):
    real = aotdist.compile_regions
    monkeypatch.setattr(
        aotdist, "compile_regions", lambda model, **kwargs: real(_perturbing_first(model), **kwargs)
    )
    out = tmp_path / "r.json"
    assert main(["check", f"{__name__}:toy", "--json", str(out)]) == 1
    assert "parity" in capsys.readouterr().out
    assert '"status": "parity"' in out.read_text()


def test_bad_input_is_named(capsys):
    assert main(["check"]) == 2
    assert "give one model" in capsys.readouterr().err
    assert main(["check", "nonexistent"]) == 2
    assert "unknown model 'nonexistent'" in capsys.readouterr().err
    with pytest.raises(TypeError, match=r"must return \(model, inputs\)"):
        check_family(f"{__name__}:not_a_pair")
    with pytest.raises(ValueError, match="FSDP modes are 'hooks'"):
        check_fsdp("llama", 2, mode="graphs")


def test_the_table_counts_and_explains():
    results = [
        CheckResult(
            "a",
            "dense",
            status="reused",
            loss_eager=1.0,
            loss_aotdist=1.0,
            regions={"A": {"instances": 3}},
            whole_model="trains",
        ),
        CheckResult(
            "b",
            "MoE",
            status="partly reused",
            notes={"B": "demoted: aliasing"},
            whole_model="trains",
        ),
        CheckResult("a", "dense", status="crash", fsdp=2, error="Traceback\nRuntimeError: x"),
        CheckResult("a", "dense", status="reused", fsdp=2, fsdp_mode="graph"),
    ]
    text = render(results)
    assert "| a (FSDP2 graph mode, 2 ranks) |" in text
    assert "1 of 2 families keep every region" in text and "1 check(s) fail" in text
    assert "| a (FSDP2, 2 ranks) |" in text and "RuntimeError: x" in text
    assert "B: demoted: aliasing" in text


class _Pooled(nn.Module):
    """TinyGPT plus a pooler whose output the loss does not use, as in BERT-style heads."""

    def __init__(self):
        super().__init__()
        self.gpt = TinyGPT(vocab=64, dim=32, depth=3, heads=4, seq_len=16)
        self.pooler = nn.Linear(64, 8)

    def forward(self, idx):
        logits = self.gpt(idx)
        return logits, self.pooler(logits[:, 0])


@pytest.mark.timeout(120)
def test_zero_gradients_where_eager_has_none_are_parity_and_named():
    def build(seed):
        torch.manual_seed(seed)
        return _Pooled(), {"*": (torch.randint(0, 64, (2, 16)),)}

    fam = Family("pooled", "dense", build, "user", loss=lambda out: out[0].square().mean())
    result = check_family(fam)
    assert result.status == "reused", result
    assert result.max_grad_diff < 1e-4
    assert "pooler.weight" in result.notes["gradients"], result.notes
    assert result.notes["gradients"].endswith("(whole-model compile too)"), result.notes


def _one_step(model, reference) -> Diff:
    """One step's comparison of ``model``'s gradients with ``reference``'s, losses equal."""
    diff = Diff()
    grads = [{n: p.grad for n, p in m.named_parameters()} for m in (model, reference)]
    diff.add(1, 1.0, 1.0, *grads, None, None, tolerance("aot_eager"))
    return diff


def test_zero_gradients_that_whole_model_compile_leaves_none_are_named_as_aotdist_s_own():
    model, reference = _Pooled(), _Pooled()
    model.pooler.weight.grad = torch.zeros_like(model.pooler.weight)  # reference: None
    result = CheckResult("pooled", "dense", loss_eager=1.0)
    _verdict(result, CompileMetrics(), _one_step(model, reference), whole_zeros=[])
    assert (
        "whole-model compile leaves 1 of them None (pooler.weight...)" in result.notes["gradients"]
    ), result.notes


def test_under_fsdp_hooks_instances_the_batch_never_ran_are_not_counted_as_eager():
    # Gemma 3 trained on text alone never calls its vision tower: "0 of 3 instances ran
    # compiled" read eager! though no instance ran at all. An instance that ran uncompiled
    # still is eager!.
    def judged(ran: dict[str, int]) -> CheckResult:
        model = _Pooled()
        result = CheckResult("pooled", "dense", loss_eager=1.0)
        m = CompileMetrics(
            regions={
                "Vision": RegionStats(instances=3, call_sites=0),
                "Text": RegionStats(instances=3, call_sites=2),
            }
        )
        _verdict(result, m, _one_step(model, model), frames=True, ran=ran)
        return result

    quiet = judged({"Vision": 0, "Text": 2})
    assert quiet.status != "eager!", quiet
    assert quiet.notes["Vision"] == "not run by this batch: not checked", quiet.notes
    loud = judged({"Vision": 0, "Text": 3})
    assert loud.status == "eager!" and "2 of the 3 instances" in loud.notes["Text"], loud


def hungry():
    """A factory that reserves 8 GiB (not touched: it succeeds without a cap)."""
    hungry.reserved = torch.empty(8 * 2**30, dtype=torch.uint8)
    return toy()


@pytest.mark.timeout(180)
def test_a_build_past_the_memory_cap_fails_in_its_own_process_and_says_so(monkeypatch):
    from aotdist.check.zoo import _one

    # The check's process imports this module by name, as `aotdist check` would.
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    capped = _one(f"{__name__}:hungry", backend="aot_eager", fsdp=0, timeout=150, memory_gb=7)
    assert capped.status == "crash" and "out of memory (capped at 7.0 GiB" in capped.error, (
        capped.error
    )
    free = _one(f"{__name__}:hungry", backend="aot_eager", fsdp=0, timeout=150, memory_gb=0)
    assert free.status == "reused", free.error


def test_tiny_configs_shrink_nested_configs_and_turn_their_dropout_off():
    # A multimodal config holds its text and vision towers as configs of their own: left at
    # full size they made the "tiny" Gemma 3 too big to build, and Emu3's text config kept
    # its attention dropout (a parity failure in eager against eager).
    pytest.importorskip("transformers")
    from aotdist.check.tiny_config import hf_config

    gemma3 = hf_config("gemma3")
    assert gemma3.text_config.hidden_size == 64 and gemma3.vision_config.hidden_size == 64
    assert gemma3.text_config.num_hidden_layers == 3
    assert gemma3.vision_config.num_hidden_layers == 3
    emu3 = hf_config("emu3")
    assert emu3.text_config.attention_dropout == 0.0
    assert emu3.get_text_config().vocab_size == 256


def test_a_gradient_that_is_rounding_noise_is_scaled_by_the_model_s_largest_gradient():
    """A parameter whose exact gradient is 0 (eager and compile each give rounding noise)
    does not fail the check; a wrong gradient of the same parameter still does."""

    def model_with(grads):
        m = nn.Linear(2, 2)
        for p, g in zip(m.parameters(), grads, strict=True):
            p.grad = torch.as_tensor(g, dtype=torch.float32)
        return m

    ref = model_with([[[10.0, 1.0], [2.0, 3.0]], [1e-7, -1e-7]])
    noise = model_with([[[10.0, 1.0], [2.0, 3.0]], [-2e-7, 3e-7]])
    worst, ok, _ = _grad_diff(noise, ref, rtol=1e-4)
    assert ok and worst < 1e-4, worst
    wrong = model_with([[[10.0, 1.0], [2.0, 3.0]], [0.5, 0.0]])
    worst, ok, _ = _grad_diff(wrong, ref, rtol=2e-2)
    assert not ok and worst > 1e-2, worst


def test_a_check_keeps_each_region_warning_whole_with_its_fix():
    # `aotdist check --json` once cut warnings at 300 characters, before their fix
    text = "aotdist region 'Block' is compiled 2 times, not once: " + "a cause " * 60
    text += "Fix: the fix."
    caught = [warnings.WarningMessage(RegionCompileWarning(text), RegionCompileWarning, "f", 1)]
    assert _region_warnings(caught) == [text]
