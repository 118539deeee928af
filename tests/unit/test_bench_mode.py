"""``aotdist bench --mode``: the torch.compile mode reaches every compiling strategy, the
runner and the report, and is checked before any run."""

from __future__ import annotations

import pytest
import torch

import aotdist
import aotdist.bench as bench
from aotdist.bench import Case, runner
from aotdist.bench.strategies import Setup, get_strategy
from aotdist.errors import BenchError, ConfigError
from aotdist.testing import TinyGPT

MODE = "max-autotune-no-cudagraphs"
SPLIT = dict.fromkeys(
    (
        "dynamo",
        "aot_autograd",
        "inductor",
        "inductor_codegen",
        "inductor_kernel_load_wait",
        "outside_compiler",
    ),
    0.1,
)


@pytest.mark.parametrize(
    ("mode", "kwargs", "match"),
    [
        ("fast", {}, "unknown torch.compile mode"),
        (MODE, {"backend": "aot_eager"}, "applies to the inductor backend"),
        ("reduce-overhead", {"device": "cpu"}, "need --device cuda"),
        ("max-autotune", {"device": "cpu"}, "need --device cuda"),
    ],
)
def test_a_bad_mode_is_refused_before_any_run(tmp_path, monkeypatch, mode, kwargs, match):
    monkeypatch.setattr(bench, "_measure_once", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(ConfigError, match=match):
        bench.run_bench([Case("gpt", 2, "aotdist")], mode=mode, out=tmp_path, **kwargs)


def test_the_mode_reaches_every_compiling_strategy(monkeypatch, tmp_path):
    import accelerate.utils

    from aotdist.bench.strategies import ARTIFACTS_ENV

    seen = []  # (what compiled, its compile arguments), in call order

    def record(what, kw, model=None):
        seen.append((what, kw))
        return model

    monkeypatch.setenv(ARTIFACTS_ENV, str(tmp_path))
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: record("full", kw))
    monkeypatch.setattr(
        accelerate.utils, "compile_regions", lambda model, **kw: record("accelerate", kw, model)
    )
    monkeypatch.setattr(
        aotdist,
        "parallelize",
        lambda model, config: record("parallelize", config["compile"], model),
    )
    names = (
        "full",
        "accelerate",
        "aotdist",
        "aotdist-graph",
        "aotdist+cache",
        "aotdist-graph+cache",
    )
    for name in names:
        get_strategy(name).apply(TinyGPT(depth=2), Setup(mode=MODE))
    want = {"backend": "inductor", "mode": MODE}
    assert seen == [
        ("full", want),
        ("accelerate", want),
        ("parallelize", want),
        ("parallelize", want),
        ("parallelize", want),
        ("parallelize", want),
    ]  # one call per strategy
    assert Setup().compile_kwargs() == {"backend": "inductor"}  # no mode: torch's default


def test_the_mode_goes_to_each_run_and_into_the_report(tmp_path, monkeypatch):
    calls = []

    def fake_measure_once(case, *, mode=None, paired_rounds=0, **kwargs):
        calls.append(mode)
        if paired_rounds:  # the mode reached it; the report stands without it
            raise BenchError("paired run not measured here")
        return {
            "strategy": case.strategy,
            "model": case.model,
            "depth": case.depth,
            "nproc": 1,
            "compile_s": 1.0,
            "steady_step_s": 0.01,
            "first_step_s": 1.01,
            "saved_activation_bytes": 1024,
            "peak_mem_mib": 5.0,
            "frames_compiled": 1,
            "graph_breaks": 0,
            "recompiles_after_first_step": 0,
            "memory_metric": "RSS",
            "regions": {},
            "compile_split_s": {**SPLIT, "cpp_compiles": 0},
        }

    monkeypatch.setattr(bench, "_measure_once", fake_measure_once)
    report = bench.run_bench(
        [Case("gpt", 2, s) for s in ("full", "aotdist")],
        mode=MODE,
        repeats=1,
        out=tmp_path,
        progress=lambda line: None,
    )
    assert calls == [MODE] * 3  # the round robin's two runs and the paired run
    assert report["settings"]["compile_mode"] == MODE
    assert (
        f"torch.compile mode {MODE} in every compiling strategy"
        in (tmp_path / "bench.md").read_text()
    )


def test_the_runner_passes_the_mode_and_marks_cuda_graph_steps(monkeypatch):
    specs = []
    monkeypatch.setattr(runner, "run", lambda spec, **kw: specs.append(spec) or {})
    runner.main(["--strategy", "full", "--depth", "2", "--mode", "reduce-overhead"])
    assert specs[0]["mode"] == "reduce-overhead"
    assert runner._cuda_graphs({"mode": "reduce-overhead", "device": "cuda:0"})
    assert not runner._cuda_graphs({"mode": "reduce-overhead", "device": "cpu"})
    assert not runner._cuda_graphs({"mode": MODE, "device": "cuda"})
    assert not runner._cuda_graphs({"device": "cuda"})
