"""`aotdist bench` on a tiny setting: files written, every ratio computed from measurements."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_bench_writes_report_with_measured_ratios(tmp_path):
    from aotdist.bench import Case, run_bench

    cases = [Case("gpt", d, s) for d in (1, 2) for s in ("eager", "full", "aotdist")]
    cases += [Case("gpt", 2, s, nproc=2) for s in ("eager", "aotdist")]
    lines: list[str] = []
    out = tmp_path / "bench"
    run_bench(cases, backend="aot_eager", steps=2, warmup=0, out=out, timeout=300,
              progress=lines.append)
    assert any(ln.startswith("[8/8] aotdist gpt depth=2 x2 ranks") for ln in lines)
    assert any("cold step (compile)" in ln for ln in lines)  # phase lines from the child

    report = json.loads((out / "bench.json").read_text())
    md = (out / "bench.md").read_text()
    assert md.startswith("Machine: ") and "### gpt fsdp2x2" in md and "Targets" in md
    assert (out / "bench.png").stat().st_size > 1000
    assert report["settings"]["backend"] == "aot_eager" and len(report["settings"]["cases"]) == 8

    results = {(r["strategy"], r["depth"], r["nproc"]): r for r in report["results"]}
    assert set(results) == {(c.strategy, c.depth, c.nproc) for c in cases}
    for r in results.values():
        assert r["steady_step_s"] > 0 and len(r["step_times_s"]) == 2
        assert r["peak_mem_mib"] >= 0 and r["memory_metric"]
        assert set(r["compile_split_s"]) >= {"dynamo", "aot_autograd", "inductor"}
        assert r["recompiles_after_first_step"] == 0
    assert results[("eager", 2, 1)]["compile_s"] == 0.0
    single = results[("aotdist", 2, 1)]
    assert single["regions"]["GPTBlock"] == {**single["regions"]["GPTBlock"],
                                            "call_sites": 2, "subgraphs": 1}
    sharded = results[("aotdist", 2, 2)]
    assert sharded["mode"] == "frames" and len(sharded["ranks"]) == 2
    assert sharded["steady_step_s"] == max(r["steady_step_s"] for r in sharded["ranks"])

    ratios = report["ratios"]
    expected = {
        "gpt: compile aotdist/full @depth2": (single["compile_s"],
                                              results[("full", 2, 1)]["compile_s"]),
        "gpt: step aotdist/full @depth1": (results[("aotdist", 1, 1)]["steady_step_s"],
                                           results[("full", 1, 1)]["steady_step_s"]),
        "gpt: compile growth full depth2/depth1": (results[("full", 2, 1)]["compile_s"],
                                                   results[("full", 1, 1)]["compile_s"]),
        "gpt fsdp2x2: memory aotdist/eager @depth2": (sharded["peak_mem_mib"],
                                                      results[("eager", 2, 2)]["peak_mem_mib"]),
    }
    for key, (num, den) in expected.items():
        assert ratios[key]["numerator"] == num and ratios[key]["denominator"] == den
    measured = {v for r in results.values()
                for v in (r["compile_s"], r["steady_step_s"], r["peak_mem_mib"])}
    for ratio in ratios.values():
        assert ratio["numerator"] in measured and ratio["denominator"] in measured
        assert ratio["value"] == pytest.approx(ratio["numerator"] / ratio["denominator"])
    for target in report["targets"]:
        assert target["value"] == ratios[target["ratio"]]["value"]


def test_bench_rejects_unknown_strategy(tmp_path):
    from aotdist.cli import main

    assert main(["bench", "--strategies", "eager,nope", "--out", str(tmp_path)]) == 2


def test_inspect_prints_plan_and_metrics(capsys):
    from aotdist.cli import main

    assert main(["inspect", "--model", "vit", "--depth", "3"]) == 0
    out = capsys.readouterr().out
    assert "EncoderBlock" in out and "3 instances, 3 call sites, 1 distinct subgraph(s)" in out
