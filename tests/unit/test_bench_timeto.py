"""Time to the first N steps (T(N)), crossovers, warm restarts, the per-block peer and
the strategies a build may lack, without running a benchmark (aot_eager where a step
runs)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import pytest
import torch

import aotdist.bench as bench
from aotdist.bench import Case, plan_cases
from aotdist.bench.cells import MAIN_JOB
from aotdist.bench.report import write_report
from aotdist.bench.stats import TARGETS, verdict
from aotdist.bench.strategies import STRATEGIES, Setup, get_strategy
from aotdist.bench.timeto import crossover_steps, time_to_steps

SPLIT = {
    **dict.fromkeys(
        (
            "dynamo",
            "aot_autograd",
            "inductor",
            "inductor_codegen",
            "inductor_kernel_load_wait",
            "outside_compiler",
        ),
        0.1,
    ),
    "cpp_compiles": 0,
}


def _run(strategy, depth, cold, step, *, repeat=0, model="gpt", **extra):
    return {
        "strategy": strategy,
        "model": model,
        "depth": depth,
        "nproc": 1,
        "compile_s": cold,
        "steady_step_s": step,
        "first_step_s": cold + step,
        "peak_mem_mib": 10.0,
        "saved_activation_bytes": 1024,
        "repeat": repeat,
        "frames_compiled": 1,
        "graph_breaks": 0,
        "recompiles_after_first_step": 0,
        "memory_metric": "RSS",
        "regions": {},
        "compile_split_s": SPLIT,
        **extra,
    }


def _two_repeats():
    """Depth 32, 2 repeats: aotdist compiles slower than accelerate and per_block, steps
    faster than both; full compiles slowest and steps fastest. Repeat 1 is slower for
    aotdist's compile only (12 -> 16 s)."""
    runs = []
    for rep, cold_a in ((0, 12.0), (1, 16.0)):
        runs += [
            _run("full", 32, 40.0, 0.015, repeat=rep),
            _run("accelerate", 32, 10.0, 0.022, repeat=rep),
            _run("per_block", 32, 10.0, 0.020, repeat=rep),
            _run("aotdist", 32, cold_a, 0.016, repeat=rep),
        ]
    return runs


def test_crossover_is_the_step_from_which_aotdist_stays_ahead():
    assert crossover_steps(12.0, 0.016, 10.0, 0.022) == 334  # 2 s / 6 ms = 333.3
    assert 12.0 + 334 * 0.016 <= 10.0 + 334 * 0.022 and 12.0 + 333 * 0.016 > 10.0 + 333 * 0.022
    assert crossover_steps(9.0, 0.010, 10.0, 0.020) == 0  # ahead from the start, and stays
    assert crossover_steps(10.0, 0.010, 10.0, 0.010) == 0
    assert crossover_steps(12.0, 0.016, 40.0, 0.015) == math.inf  # slower step: never
    assert crossover_steps(9.0, 0.030, 10.0, 0.020) == math.inf  # ahead first, then behind
    assert crossover_steps(12.0, 0.02, 10.0, 0.02) == math.inf
    assert crossover_steps(1.0, 0.5, 0.5, 1.0) == 1  # exactly level at n = 1 counts


def test_time_to_n_steps_per_repeat_against_the_best_peer():
    tts = time_to_steps(_two_repeats())
    cells = {c["strategy"]: c for c in tts["cells"]}
    assert cells["aotdist"]["T"]["100"] == {
        "median": pytest.approx(15.6),
        "min": pytest.approx(13.6),
        "max": pytest.approx(17.6),
        "n": 2,
    }
    assert cells["full"]["T"]["10000"]["median"] == pytest.approx(190.0)
    assert cells["aotdist"]["step_source"] == "cell"
    r = tts["ratios"]
    # T(100): per_block 12.0 s is the best peer; aotdist 13.6 and 17.6 s per repeat
    t100 = r["gpt: T(100) aotdist/best peer @depth32"]
    assert [x["value"] for x in t100["per_repeat"]] == pytest.approx([13.6 / 12.0, 17.6 / 12.0])
    assert [x["peer"] for x in t100["per_repeat"]] == ["per_block", "per_block"]
    assert t100["best_peer"] == "per_block" and t100["repeats"] == 2
    assert (t100["min"], t100["max"]) == pytest.approx((13.6 / 12.0, 17.6 / 12.0))
    # T(10000): full (190 s) is the best peer there; aotdist 172 and 176 s
    t10k = r["gpt: T(10000) aotdist/best peer @depth32"]
    assert t10k["best_peer"] == "full"
    assert t10k["value"] == pytest.approx((172 / 190 + 176 / 190) / 2)
    assert r["gpt: T(10000) aotdist/full @depth32"]["value"] == pytest.approx(t10k["value"])
    assert r["gpt: T(1000) aotdist/accelerate @depth32"]["numerator"] == pytest.approx(30.0)
    cross = tts["crossovers"]
    acc = cross["gpt: crossover aotdist/accelerate @depth32"]
    assert [x["steps"] for x in acc["per_repeat"]] == [334, 1000]  # 2 s and 6 s / 6 ms
    assert (acc["value"], acc["min"], acc["max"], acc["unit"]) == (667, 334, 1000, "steps")
    never = cross["gpt: crossover aotdist/full @depth32"]
    assert never["value"] is None and never["min"] is None and never["max"] is None
    assert cross["gpt: crossover aotdist/per_block @depth32"]["per_repeat"][0]["steps"] == 500
    json.dumps(tts, allow_nan=False)  # no infinity in the JSON


def test_a_short_runs_frames_are_judged_at_time_to_100_steps():
    """aotdist+frames (what compile.expected_steps < 1,000 compiles) gets its own T(N)
    ratios against the best peer, and the short-run target judges its T(100)."""
    runs = _two_repeats() + [
        _run("aotdist+frames", 32, cold, 0.021, repeat=rep) for rep, cold in ((0, 9.5), (1, 10.5))
    ]
    tts = time_to_steps(runs)
    t100 = tts["ratios"]["gpt: T(100) aotdist+frames/best peer @depth32"]
    # per_block's 12.0 s is the best peer's T(100); frames 11.6 and 12.6 s
    assert [x["value"] for x in t100["per_repeat"]] == pytest.approx([11.6 / 12.0, 12.6 / 12.0])
    assert tts["ratios"]["gpt: T(100) aotdist/best peer @depth32"]["value"] > t100["value"]
    short = [t for t in TARGETS if "aotdist+frames" in t[1]]
    assert [t[1] for t in short] == ["T(100) aotdist+frames/best peer @depth{d}"]


def test_paired_rounds_give_each_repeat_its_steady_steps():
    """Round k of a paired run goes to the k-th repeat modulo the repeats, and each
    (repeat, round) gives one T(N) ratio; a strategy the paired run did not time keeps its
    run's own step."""
    runs = _two_repeats()
    paired = [
        {
            "model": "gpt",
            "depth": 32,
            "nproc": 1,
            "slices": 4,
            "steps_per_slice": 20,
            "slice_step_s": {
                "aotdist": [0.010, 0.030, 0.012, 0.034],
                "accelerate": [0.02, 0.02, 0.02, 0.02],
            },
        }
    ]
    tts = time_to_steps(runs, paired)
    cells = {c["strategy"]: c for c in tts["cells"]}
    assert cells["aotdist"]["step_source"] == "paired"
    assert cells["per_block"]["step_source"] == "cell"
    t = tts["ratios"]["gpt: T(1000) aotdist/accelerate @depth32"]
    # repeat 0 (cold 12 s): rounds 0 and 2 (10, 12 ms); repeat 1 (16 s): rounds 1 and 3
    assert [(x["repeat"], x["round"]) for x in t["per_repeat"]] == [(0, 0), (0, 2), (1, 1), (1, 3)]
    assert [x["numerator"] for x in t["per_repeat"]] == pytest.approx([22.0, 24.0, 46.0, 50.0])
    assert [x["denominator"] for x in t["per_repeat"]] == pytest.approx([30.0] * 4)
    assert (t["min"], t["max"], t["repeats"]) == pytest.approx((22 / 30, 50 / 30, 4))
    assert cells["aotdist"]["T"]["1000"]["n"] == 4 and cells["per_block"]["T"]["1000"]["n"] == 4
    # one repeat, no paired run: one figure per repeat
    assert (
        time_to_steps(_two_repeats()[:4])["ratios"]["gpt: T(100) aotdist/best peer @depth32"][
            "repeats"
        ]
        == 1
    )


def test_time_to_steps_targets_met_missed_and_noisy_with_spreads(tmp_path):
    runs = _two_repeats()
    report = write_report(runs, tmp_path, settings={"repeats": 2})
    targets = {(t["target"], t["depth"]): t for t in report["targets"]}
    t100 = targets["cold T(100): aotdist <= 1.0x the best peer", 32]
    assert (t100["verdict"], t100["met"]) == ("missed", False)  # 1.13x and 1.47x
    t1k = targets["cold T(1000): aotdist <= 0.85x the best peer", 32]
    assert t1k["verdict"] == "missed"  # 28 and 32 s against per_block's 30 s
    assert t1k["ratio"] == "gpt: T(1000) aotdist/best peer @depth32"
    cross = targets["aotdist overtakes accelerate within 300 steps", 32]
    assert (cross["verdict"], cross["unit"], cross["min"], cross["max"]) == (
        "missed",
        "steps",
        334,
        1000,
    )
    assert targets["T(10000): aotdist <= 1.0x full", 32]["verdict"] == "met"
    # repeat 0 compiles in 8 s: T(1000) 24 s (0.80x, meets 0.85x), ahead of accelerate
    # from step 0; repeat 1 as before: the spreads straddle both bounds
    runs[3] = _run("aotdist", 32, 8.0, 0.016, repeat=0)
    noisy = write_report(runs, tmp_path / "noisy", settings={"repeats": 2})
    noisy = {(t["target"], t["depth"]): t for t in noisy["targets"]}
    assert noisy["cold T(1000): aotdist <= 0.85x the best peer", 32]["verdict"] == "noisy"
    cross = noisy["aotdist overtakes accelerate within 300 steps", 32]
    assert (cross["verdict"], cross["min"], cross["max"]) == ("noisy", 0, 1000)
    assert verdict({"min": 200, "max": None}, "<=", 300) == "noisy"  # one repeat never
    assert verdict({"min": None, "max": None}, "<=", 300) == "missed"
    assert not any("0.2x full" in text for text, *_ in TARGETS)  # withdrawn
    md = (tmp_path / "bench.md").read_text()
    lead = md.index("### Time to the first N steps")
    assert lead < md.index("### Diagnostics") < md.index("\n### gpt\n")
    assert "| depth | strategy | T(100) | T(1,000) | T(10,000) |" in md
    assert "| 32 | aotdist | 15.6 [13.6-17.6] | 30.0 [28.0-32.0] | 174.0 [172.0-176.0] |" in md
    assert "| 32 | **aotdist / best peer** | 1.30x [1.13-1.47] (per_block) |" in md
    assert "| 32 | aotdist/accelerate: 667 [334-1000] steps |" in md
    assert "| 32 | aotdist/full: never [never-never] steps |" in md
    assert (
        "| gpt | aotdist overtakes accelerate within 300 steps | 32 | 667 [334-1000] "
        "steps | **missed** |"
    ) in md
    md = (tmp_path / "noisy" / "bench.md").read_text()
    assert "| 32 | aotdist/accelerate: 500 [0-1000] steps |" in md
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert (
        saved["time_to_steps"]["crossovers"].keys() == report["time_to_steps"]["crossovers"].keys()
    )


def test_warm_restart_time_to_100_steps_against_the_best_warm_peer(tmp_path):
    runs = [
        _run(s, 8, cold, 0.01, warm_restart_s=warm)
        for s, cold, warm in (
            ("full", 20.0, 6.0),
            ("accelerate", 10.0, 5.0),
            ("per_block", 10.0, 4.0),
            ("aotdist", 10.0, 4.5),
            ("aotdist+cache", 11.0, 1.5),
        )
    ]
    tts = time_to_steps(runs)
    cells = {c["strategy"]: c for c in tts["cells"]}
    assert cells["per_block"]["warm_T"]["100"]["median"] == pytest.approx(5.0)
    w = tts["ratios"]["gpt: warm T(100) aotdist+cache/best peer @depth8"]
    assert (w["numerator"], w["denominator"], w["best_peer"]) == (
        pytest.approx(2.5),
        pytest.approx(5.0),
        "per_block",
    )
    assert tts["ratios"]["gpt: warm T(100) aotdist/best peer @depth8"]["value"] == pytest.approx(
        5.5 / 5.0
    )
    assert "gpt: T(100) aotdist+cache/best peer @depth8" not in tts["ratios"]  # warm only
    report = write_report(runs, tmp_path, settings={"repeats": 1})
    t = {x["target"]: x for x in report["targets"]}
    warm = t["warm restart T(100): aotdist (artifact cache) <= 0.4x the best peer's"]
    assert (warm["value"], warm["verdict"]) == (pytest.approx(0.5), "missed")  # 2.5 / 5.0 s
    md = (tmp_path / "bench.md").read_text()
    assert "| warm T(100) |" in md and "| 8 | aotdist+cache | " in md


def test_plan_warm_cells_per_block_and_the_main_job():
    cases = plan_cases()
    warm = [c for c in cases if c.warm]
    assert {(c.model, c.depth) for c in warm} == {("gpt", 8)}  # one depth keeps the time
    assert {c.strategy for c in warm} == {
        "full",
        "accelerate",
        "per_block",
        "aotdist",
        "aotdist+cache",
    }
    for model in ("gpt", "llama", "dictgpt"):
        mine = {c.strategy for c in cases if c.model == model}
        assert {"accelerate", "per_block", "aotdist"} <= mine, model
    assert {(c.model, c.depth) for c in cases} == {
        ("gpt", 8),
        ("gpt", 32),
        ("gpt", 64),
        ("llama", 32),
        ("dictgpt", 8),
    }
    # a short run's compile everywhere, against the best peer's start
    assert {(c.model, c.depth) for c in cases if c.strategy == "aotdist+frames"} == {
        (c.model, c.depth) for c in cases
    }
    # a long run's compile, where a whole-model compile has the fastest step
    assert {(c.model, c.depth) for c in cases if c.strategy == "aotdist+lowered"} == {
        ("gpt", 8),
        ("gpt", 32),
        ("dictgpt", 8),
    }
    assert len(cases) == sum(len(sb.depths) * len(sb.strategies) for sb in MAIN_JOB)
    full = plan_cases(full=True)
    assert {(c.model, c.depth) for c in full} >= {
        (m, d) for m in ("gpt", "llama") for d in (8, 32, 64)
    }
    assert {c.strategy for c in full if c.model == "llama" and c.depth == 64} >= {
        "full",
        "accelerate",
        "per_block",
        "aotdist",
    }
    grid = plan_cases(models=["gpt"], depths=[4], strategies=["aotdist+warm", "full"])
    assert grid == [Case("gpt", 4, "aotdist", warm=True), Case("gpt", 4, "full")]


def _fake_measure(calls):
    def fake(
        case,
        *,
        cache_dir=None,
        seed=None,
        env=None,
        steps=20,
        paired_rounds=0,
        keep_cache=None,
        **kwargs,
    ):
        calls.append(
            {
                "case": case,
                "cache_dir": cache_dir,
                "seed": seed,
                "env": env,
                "steps": steps,
                "paired": paired_rounds,
            }
        )
        if paired_rounds:
            return {
                "model": case.model,
                "depth": case.depth,
                "nproc": 1,
                "slices": 2,
                "steps_per_slice": steps,
                "slice_step_s": {s: [0.01, 0.01] for s in case.strategy.split(",")},
            }
        if cache_dir:  # what a run leaves in its cache dir
            assert Path(cache_dir).is_dir()
            (Path(cache_dir) / f"run{len(calls)}").write_text("compiled")
        restart = sum(1 for c in calls if c["case"] == case and not c["paired"]) % 2 == 0
        first = 1.0 if restart else 10.0
        return _run(
            case.strategy,
            case.depth,
            first - 0.01,
            0.01,
            apply_s=0.5,
            isa_probe_s=0.25,
            first_step_s=first,
            cache_load="loaded",
            precompiled=False,
            precompile_reason="",
        )

    return fake


def test_a_warm_cell_restarts_on_the_cache_dir_its_cold_run_left(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "_measure_once", _fake_measure(calls))
    cases = [Case("gpt", 2, "full", warm=True), Case("gpt", 2, "aotdist")]
    report = bench.run_bench(
        cases, backend="aot_eager", repeats=1, out=tmp_path, progress=lambda line: None
    )
    cold, restart, plain, _paired = calls
    assert cold["case"] == restart["case"] == cases[0]
    assert cold["cache_dir"] and restart["cache_dir"] == cold["cache_dir"]  # same dir
    assert cold["seed"] is None and restart["seed"] is None  # not a copy: the dir itself
    assert (cold["steps"], restart["steps"]) == (20, 2)
    assert plain["cache_dir"] is None  # an ordinary cell: a fresh empty dir of its own
    assert not Path(cold["cache_dir"]).exists()  # removed after the restart
    cell = {r["strategy"]: r for r in report["results"]}["full"]
    # the restart's apply (0.5) + ISA probes (0.25) + first step (1.0)
    assert cell["warm_restart_s"] == pytest.approx(1.75)
    assert cell["warm_restart_apply_s"] == 0.5 and cell["first_step_s"] == 10.0


def test_a_warm_cache_cell_restarts_with_its_bundle_and_kept_caches(tmp_path, monkeypatch):
    from aotdist.bench.strategies import ARTIFACTS_ENV

    calls = []
    monkeypatch.setattr(bench, "_measure_once", _fake_measure(calls))
    bench.run_bench(
        [Case("gpt", 2, "aotdist+cache", warm=True)],
        backend="aot_eager",
        repeats=1,
        out=tmp_path,
        progress=lambda line: None,
    )
    cold, restart = calls  # no fresh-dir warm start: the restart keeps the caches
    assert restart["env"][ARTIFACTS_ENV] == cold["env"][ARTIFACTS_ENV]  # the bundle
    assert restart["cache_dir"] == cold["cache_dir"] and cold["seed"] is None
    calls.clear()
    bench.run_bench(
        [Case("gpt", 2, "aotdist+cache")],
        backend="aot_eager",
        repeats=1,
        out=tmp_path / "fresh",
        progress=lambda line: None,
    )
    cold, fresh = calls  # not a warm cell: the fresh start from the bundle, as before
    assert fresh["env"] == cold["env"] and fresh["cache_dir"] is None


def test_the_per_block_strategy_compiles_each_block_in_place():
    from aotdist.bench.models import build_bench_model, synthetic_batch, training_loss

    for name in ("gpt", "dictgpt"):
        torch.manual_seed(0)
        model = build_bench_model(name, depth=2)
        keys = list(model.state_dict())
        out = get_strategy("per_block").apply(model, Setup(backend="aot_eager"))
        assert out is model and list(model.state_dict()) == keys  # no wrapper, no prefix
        blocks = list(model.blocks.values() if name == "dictgpt" else model.blocks)
        assert all(b._compiled_call_impl is not None for b in blocks), name
        assert model._compiled_call_impl is None and model.head._compiled_call_impl is None
        x, y = synthetic_batch(name, model, batch=2, generator=torch.Generator().manual_seed(0))
        training_loss(model(x), y).backward()
        assert all(p.grad is not None for p in blocks[1].parameters())
    assert "per_block" in bench.ALL_STRATEGIES


def test_the_runner_times_the_strategy_apply_and_a_per_block_step():
    from aotdist.bench import runner

    spec = {
        "strategy": "per_block",
        "model": "gpt",
        "depth": 2,
        "backend": "aot_eager",
        "steps": 1,
        "warmup": 0,
        "batch": 2,
        "device": "cpu",
        "float8": False,
    }
    r = runner.measure(spec)
    assert r["apply_s"] > 0 and r["frames_compiled"] >= 1 and r["steady_step_s"] > 0
    assert r["recompiles_after_first_step"] == 0


def test_aotdist_lowered_passes_compile_outer_or_is_skipped_with_a_note(tmp_path, monkeypatch):
    import aotdist

    seen = []
    monkeypatch.setattr(
        aotdist, "parallelize", lambda model, config: seen.append(config["compile"]) or model
    )
    get_strategy("aotdist+lowered").apply(torch.nn.Linear(2, 2), Setup(backend="aot_eager"))
    get_strategy("aotdist+frames").apply(torch.nn.Linear(2, 2), Setup(backend="aot_eager"))
    assert seen == [
        {"backend": "aot_eager", "outer": "inductor"},  # a long run's choice
        {"backend": "aot_eager", "outer": "eager"},  # a short run's
    ]
    gone = dataclasses.replace(
        STRATEGIES["aotdist+lowered"], unavailable=lambda: "no compile.outer key in this build"
    )
    monkeypatch.setitem(STRATEGIES, "aotdist+lowered", gone)
    calls = []
    monkeypatch.setattr(bench, "_measure_once", _fake_measure(calls))
    lines = []
    report = bench.run_bench(
        [Case("gpt", 2, s) for s in ("accelerate", "aotdist+lowered")],
        backend="aot_eager",
        repeats=1,
        out=tmp_path,
        progress=lines.append,
    )
    assert [c["case"].strategy for c in calls] == ["accelerate"]
    assert report["settings"]["skipped"] == ["no compile.outer key in this build"]
    assert "skipped: no compile.outer key in this build" in lines
    assert "- skipped: no compile.outer key in this build" in (tmp_path / "bench.md").read_text()


def test_the_full_flag_runs_the_whole_matrix(tmp_path, monkeypatch):
    from aotdist.cli import main

    seen = []

    @functools.wraps(bench.run_bench)  # the parser reads its defaults from the signature
    def fake(cases, **kwargs):
        seen.append(cases)
        return {}

    monkeypatch.setattr(bench, "run_bench", fake)
    assert main(["bench", "--full", "--out", str(tmp_path)]) == 0
    assert seen == [plan_cases(full=True)]


def test_the_plot_draws_time_to_step_n_with_the_crossovers(tmp_path):
    """The picture shows the lead table: one panel per model and depth, each strategy's
    T(N) from its cold compile and step medians, and the step where aotdist overtakes
    a peer (667 here against accelerate; never against full)."""
    pytest.importorskip("matplotlib")
    from aotdist.bench.report import _crossings

    report = write_report(_two_repeats(), tmp_path, settings={"repeats": 2})
    assert report["plot"] and (tmp_path / "bench.png").stat().st_size > 1000
    tts = report["time_to_steps"]
    cells = {c["strategy"]: c for c in tts["cells"]}
    assert cells["aotdist"]["cold_s"]["n"] == 2 and cells["aotdist"]["step_s"]["median"] > 0
    crossings = {(s, p): n for s, p, n in _crossings(tts, "gpt", 32)}
    assert crossings[("aotdist", "accelerate")] == 667 and crossings[("aotdist", "full")] is None
    assert _crossings(tts, "gpt", 8) == []
    assert tts["horizons"] == [100, 1_000, 10_000, 100_000]
