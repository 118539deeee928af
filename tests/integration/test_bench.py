"""`aotdist bench` on a tiny setting: files written, every ratio computed from measurements."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_bench_cli_writes_report_with_measured_ratios(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "aotdist.cli", "bench", "--depths", "1,3",
         "--strategies", "eager,full,aotdist", "--backend", "aot_eager", "--steps", "2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[6/6] aotdist" in proc.stdout  # a progress line per measurement
    report = json.loads((out / "bench.json").read_text())
    assert (out / "bench.md").read_text().startswith("Machine: ")
    assert (out / "bench.png").stat().st_size > 1000
    results = {(r["strategy"], r["depth"]): r for r in report["results"]}
    assert set(results) == {(s, d) for s in ("eager", "full", "aotdist") for d in (1, 3)}
    for r in results.values():
        assert r["steady_step_s"] > 0 and r["first_step_s"] >= r["steady_step_s"] * 0.5
        assert r["peak_mem_mib"] > 0
    assert results[("aotdist", 3)]["regions"]["GPTBlock"]["call_sites"] == 3
    assert results[("aotdist", 3)]["regions"]["GPTBlock"]["subgraphs"] == 1
    ratios = report["ratios"]
    expected = {
        "compile aotdist/full @depth3": (results[("aotdist", 3)]["compile_s"],
                                         results[("full", 3)]["compile_s"]),
        "step aotdist/full @depth1": (results[("aotdist", 1)]["steady_step_s"],
                                      results[("full", 1)]["steady_step_s"]),
        "memory aotdist/eager @depth3": (results[("aotdist", 3)]["peak_mem_mib"],
                                         results[("eager", 3)]["peak_mem_mib"]),
        "compile growth full depth3/depth1": (results[("full", 3)]["compile_s"],
                                              results[("full", 1)]["compile_s"]),
    }
    for key, (num, den) in expected.items():
        assert ratios[key]["numerator"] == num and ratios[key]["denominator"] == den
        assert ratios[key]["value"] == pytest.approx(num / den)
    for ratio in ratios.values():
        assert ratio["value"] == pytest.approx(ratio["numerator"] / ratio["denominator"])


def test_bench_rejects_unknown_strategy(tmp_path):
    from aotdist.cli import main

    assert main(["bench", "--strategies", "eager,nope", "--out", str(tmp_path)]) == 2


def test_inspect_prints_plan_and_metrics(capsys):
    from aotdist.cli import main

    assert main(["inspect", "--model", "vit", "--depth", "3"]) == 0
    out = capsys.readouterr().out
    assert "EncoderBlock" in out and "3 instances, 3 call sites, 1 distinct subgraph(s)" in out
