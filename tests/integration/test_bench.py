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
    run_bench(
        cases,
        backend="aot_eager",
        steps=2,
        warmup=0,
        repeats=1,
        out=out,
        timeout=300,
        progress=lines.append,
    )
    assert any(ln.startswith("[8/8] repeat 1/1 aotdist gpt depth=2 x2 ranks") for ln in lines)
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
        assert r["saved_activation_bytes"] > 0 and r["repeats"] == 1
        assert set(r["compile_split_s"]) >= {"dynamo", "aot_autograd", "inductor"}
        assert r["recompiles_after_first_step"] == 0
    assert results[("eager", 2, 1)]["compile_s"] == 0.0
    single = results[("aotdist", 2, 1)]
    assert single["regions"]["GPTBlock"] == {
        **single["regions"]["GPTBlock"],
        "call_sites": 2,
        "subgraphs": 1,
    }
    sharded = results[("aotdist", 2, 2)]
    assert sharded["mode"] == "frames" and len(sharded["ranks"]) == 2
    assert sharded["steady_step_s"] == max(r["steady_step_s"] for r in sharded["ranks"])

    ratios = dict(report["ratios"])
    expected = {
        "gpt: compile aotdist/full @depth2": (
            single["compile_s"],
            results[("full", 2, 1)]["compile_s"],
        ),
        "gpt: compile growth full depth2/depth1": (
            results[("full", 2, 1)]["compile_s"],
            results[("full", 1, 1)]["compile_s"],
        ),
        "gpt fsdp2x2: memory aotdist/eager @depth2": (
            sharded["peak_mem_mib"],
            results[("eager", 2, 2)]["peak_mem_mib"],
        ),
    }
    for key, (num, den) in expected.items():
        assert ratios[key]["numerator"] == num and ratios[key]["denominator"] == den
    measured = {
        v for r in results.values() for v in (r["compile_s"], r["steady_step_s"], r["peak_mem_mib"])
    }
    measured |= {r["saved_activation_bytes"] for r in results.values()}
    # Steady-step ratios: from the paired runs (one process per single-process depth, the
    # strategies side by side in 4 rounds), one ratio per round.
    paired = {p["depth"]: p for p in report["paired"]}
    assert sorted(paired) == [1, 2] and all(p["slices"] == 4 for p in paired.values())
    assert paired[1]["slice_step_s"].keys() == {"eager", "full", "aotdist"}
    step = ratios.pop("gpt: step aotdist/full @depth1")
    rounds = paired[1]["slice_step_s"]
    assert step["source"] == "paired" and step["repeats"] == 4
    assert [r["value"] for r in step["per_round"]] == pytest.approx(
        [a / f for a, f in zip(rounds["aotdist"], rounds["full"], strict=True)]
    )
    assert "### Steady step side by side (paired runs)" in md
    ratios.pop("gpt: step aotdist/full @depth2")
    # T(N): each paired round with the cell's cold compile
    tts = {k: ratios.pop(k) for k in list(ratios) if ratios[k].get("source") == "time to steps"}
    t100 = tts["gpt: T(100) aotdist/full @depth1"]
    cold = {s: results[(s, 1, 1)]["compile_s"] for s in ("aotdist", "full")}
    assert t100["repeats"] == 4 and [r["numerator"] for r in t100["per_repeat"]] == pytest.approx(
        [cold["aotdist"] + 100 * rounds["aotdist"][r["round"]] for r in t100["per_repeat"]]
    )
    assert [r["denominator"] for r in t100["per_repeat"]] == pytest.approx(
        [cold["full"] + 100 * rounds["full"][r["round"]] for r in t100["per_repeat"]]
    )
    # Tracing per extra block: ms of Dynamo + AOTAutograd added over the blocks added.
    tracing = {k: ratios.pop(k) for k in list(ratios) if ": tracing ms per extra block " in k}
    assert "gpt: tracing ms per extra block aotdist depth2/depth1" in tracing

    def traced(r):
        return r["compile_split_s"]["dynamo"] + r["compile_split_s"]["aot_autograd"]

    for key, ratio in tracing.items():
        strategy, depths = key.split(" per extra block ")[1].split(" depth", 1)
        hi, lo = (int(d) for d in depths.replace("depth", "").split("/"))
        nproc = 2 if key.startswith("gpt fsdp2x2") else 1
        top, low = results[(strategy, hi, nproc)], results[(strategy, lo, nproc)]
        assert ratio["unit"] == "ms" and ratio["denominator"] == hi - lo
        assert ratio["numerator"] == pytest.approx(1000 * (traced(top) - traced(low)))
    for ratio in ratios.values():
        assert ratio.get("source") != "paired"
        assert ratio["numerator"] in measured and ratio["denominator"] in measured
        assert ratio["value"] == pytest.approx(ratio["numerator"] / ratio["denominator"])
        assert ratio["min"] == ratio["max"] == ratio["value"]  # one repeat: no spread
    for target in report["targets"]:
        assert target["value"] == report["ratios"][target["ratio"]]["value"]


def test_bench_quick_runs_end_to_end(tmp_path, capsys):
    from aotdist.cli import main

    out = tmp_path / "quick"
    assert main(["bench", "--quick", "--backend", "aot_eager", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    s = report["settings"]
    assert (s["repeats"], s["steps"], s["warmup"]) == (1, 5, 1)
    assert {(r["strategy"], r["depth"]) for r in report["results"]} == {
        (st, 2) for st in ("full", "accelerate", "per_block", "aotdist")
    }
    assert "gpt: T(1000) aotdist/best peer @depth2" in report["ratios"]
    assert "### Time to the first N steps" in (out / "bench.md").read_text()
    assert len(s["load_start"]["loadavg"]) == 3 and s["load_end"]["cpus"] >= 1
    assert all(len(r["step_times_s"]) == 5 for r in report["results"])
    assert "gpt: saved aotdist/full @depth2" in report["ratios"]
    assert "Load average (1/5/15 min)" in (out / "bench.md").read_text()


def test_bench_repeats_profile_and_float8(tmp_path):
    """The options issue 15 found untested, each in a tiny configuration."""
    from aotdist.cli import main

    out = tmp_path / "opts"
    lines = [
        "bench",
        "--model",
        "gpt",
        "--depths",
        "1",
        "--strategies",
        "eager,aotdist",
        "--repeats",
        "2",
        "--steps",
        "2",
        "--warmup",
        "0",
        "--profile",
        "--float8",
        "--backend",
        "aot_eager",
        "--out",
        str(out),
    ]
    assert main(lines) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["settings"]["float8"] and report["settings"]["profiled"]
    # round robin: repeat 0 of both cells, then repeat 1 of both
    assert [(rep, c["strategy"]) for rep, c in report["settings"]["order"]] == [
        (0, "eager"),
        (0, "aotdist"),
        (1, "eager"),
        (1, "aotdist"),
    ]
    assert sorted((r["repeat"], r["strategy"]) for r in report["runs"]) == [
        (0, "aotdist"),
        (0, "eager"),
        (1, "aotdist"),
        (1, "eager"),
    ]
    assert all(r["float8"] for r in report["runs"])
    cells = {r["strategy"]: r for r in report["results"]}
    assert cells["aotdist"]["repeats"] == 2 and cells["aotdist"]["spread"]["compile_s"]["n"] == 2
    ratio = report["ratios"]["gpt: memory aotdist/eager @depth1"]
    assert ratio["repeats"] == 2 and [r["repeat"] for r in ratio["per_repeat"]] == [0, 1]
    for rep in (0, 1):
        files = {p.name for p in (out / "profile" / f"repeat{rep}").iterdir()}
        assert {
            "gpt-d1-aotdist-np1.compile.pstats",
            "gpt-d1-aotdist-np1.step.txt",
            "gpt-d1-aotdist-np1.phases.txt",
        } <= files


def test_bench_rejects_unknown_strategy(tmp_path):
    from aotdist.cli import main

    assert main(["bench", "--strategies", "eager,nope", "--out", str(tmp_path)]) == 2


def test_inspect_prints_plan_and_metrics(capsys):
    from aotdist.cli import main

    assert main(["inspect", "--model", "vit", "--depth", "3"]) == 0
    out = capsys.readouterr().out
    assert "EncoderBlock" in out and "3 instances, 3 call sites, 1 distinct subgraph(s)" in out


def test_bench_hsdp_mesh_cells_in_both_fsdp_modes(tmp_path):
    from aotdist.bench import Case, run_bench

    cases = [Case("gpt", 2, s, nproc=4) for s in ("aotdist", "aotdist-graph")]
    out = tmp_path / "bench"
    report = run_bench(
        cases,
        backend="aot_eager",
        steps=2,
        warmup=0,
        repeats=1,
        out=out,
        timeout=400,
        mesh=(2, 2),
        progress=lambda _: None,
    )
    assert report["settings"]["mesh"] == [2, 2]
    assert "HSDP mesh 2x2 (replicate x shard)" in (out / "bench.md").read_text()
    results = {r["strategy"]: r for r in report["results"]}
    for name in ("aotdist", "aotdist-graph"):  # every rank sharded on the 2-D mesh
        assert [r["fsdp_mesh"] for r in results[name]["ranks"]] == [[2, 2]] * 4, name
        assert results[name]["steady_step_s"] > 0
