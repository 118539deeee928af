"""The per-block tracing target: what one more block adds to Dynamo + AOTAutograd, from
each run's phase split, per repeat, between a strategy's smallest depth and each deeper
one."""

from __future__ import annotations

import pytest

from aotdist.bench.report import compute_ratios, evaluate_targets, write_report

TARGET = "tracing per extra block (Dynamo + AOTAutograd): aotdist <= 10 ms"


def _run(strategy, depth, dynamo, aot, repeat, model="gpt"):
    split = {
        "dynamo": dynamo,
        "aot_autograd": aot,
        "inductor": 5.0,
        "inductor_codegen": 0.7,
        "inductor_kernel_load_wait": 4.0,
        "outside_compiler": 0.05,
        "cpp_compiles": 12,
    }
    compile_s = sum(v for k, v in split.items() if k in ("dynamo", "aot_autograd", "inductor"))
    return {
        "strategy": strategy,
        "model": model,
        "depth": depth,
        "nproc": 1,
        "repeat": repeat,
        "compile_s": compile_s,
        "first_step_s": compile_s + 0.02,
        "steady_step_s": 0.02,
        "peak_mem_mib": 100,
        "compile_split_s": split,
        "frames_compiled": 1,
        "graph_breaks": 0,
        "recompiles_after_first_step": 0,
        "memory_metric": "RSS",
        "regions": {},
    }


def _runs():
    """GPT at 8, 32, 64: aotdist's tracing grows (repeat 1 a little more), per-block
    compile's stays flat; Llama at one depth only (no growth to read)."""
    runs = []
    for rep, extra in ((0, 0.0), (1, 0.112)):
        runs += [
            _run("aotdist", 8, 0.5, 1.6, rep),
            _run("aotdist", 32, 0.5 + 0.024 * 24, 1.6 + 0.040 * 24, rep),
            _run("aotdist", 64, 0.5 + 0.024 * 56, 1.6 + 0.040 * 56 + extra, rep),
            _run("per_block", 8, 0.5, 1.1, rep),
            _run("per_block", 64, 0.25, 1.2, rep),
            _run("aotdist", 32, 1.0, 2.0, rep, model="llama"),
        ]
    return runs


def test_the_tracing_cost_of_one_more_block_is_read_per_repeat_in_milliseconds():
    ratios = compute_ratios(_runs())
    r = ratios["gpt: tracing ms per extra block aotdist depth64/depth8"]
    # repeat 0: (24 + 40) ms per block; repeat 1 adds 112 ms over 56 blocks: 66 ms
    assert [x["value"] for x in r["per_repeat"]] == pytest.approx([64.0, 66.0])
    assert r["unit"] == "ms" and r["denominator"] == 56
    assert ratios["gpt: tracing ms per extra block aotdist depth32/depth8"][
        "value"
    ] == pytest.approx(64.0)
    flat = ratios["gpt: tracing ms per extra block per_block depth64/depth8"]
    assert flat["value"] == pytest.approx((0.25 + 1.2 - 0.5 - 1.1) * 1000 / 56)  # -2.7 ms
    assert not any(k.startswith("llama: tracing") for k in ratios)  # one depth: no growth
    # other ratios keep their unit (a quotient)
    assert "unit" not in ratios["gpt: compile growth aotdist depth64/depth8"]

    targets = {
        (t["target"], t["depth"]): t
        for t in evaluate_targets(_runs(), ratios)
        if t["group"] == "gpt"
    }
    t64 = targets[TARGET, 64]
    assert (t64["verdict"], t64["unit"], t64["bound"]) == ("missed", "ms", 10.0)
    assert (t64["min"], t64["max"]) == pytest.approx((64.0, 66.0))
    assert targets[TARGET, 32]["verdict"] == "missed"
    assert (TARGET, 8) not in targets  # the smallest depth is the reference


def test_a_run_without_a_phase_split_gives_no_tracing_figure():
    runs = _runs()
    for r in runs:
        if r["strategy"] == "aotdist" and r["depth"] == 64:
            r["compile_split_s"] = {**r["compile_split_s"], "dynamo": None}
    ratios = compute_ratios(runs)
    assert "gpt: tracing ms per extra block aotdist depth64/depth8" not in ratios
    assert "gpt: tracing ms per extra block aotdist depth32/depth8" in ratios


def test_the_report_prints_the_tracing_target_in_milliseconds(tmp_path):
    settings = {
        "backend": "inductor",
        "device": "cpu",
        "steps": 20,
        "warmup": 3,
        "repeats": 2,
        "duration_s": 60.0,
    }
    write_report(_runs(), tmp_path, settings=settings)
    md = (tmp_path / "bench.md").read_text()
    assert f"| gpt | {TARGET} | 64 | 65 ms [64 to 66] | **missed** |" in md
    assert "| gpt: tracing ms per extra block aotdist depth64/depth8 | 65 ms [64 to 66] | 2 |" in md
    # per-block compile's tracing shrinks a little with depth: signed, never "-0"
    assert (
        "| gpt: tracing ms per extra block per_block depth64/depth8 | -3 ms [-3 to -3] | 2 |" in md
    )
