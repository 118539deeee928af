"""What ``aotdist bench`` runs: the main, full and quick jobs, explicit grids, and the
round-robin order of repeats."""

from __future__ import annotations

import pytest

from aotdist.bench import MAIN_JOB, MAIN_SETTINGS, QUICK_SETTINGS, Case, interleave, plan_cases
from aotdist.bench.cells import FULL_JOB
from aotdist.errors import ConfigError


def test_default_plan_is_the_main_job():
    cases = plan_cases()
    assert len(cases) == sum(len(sb.depths) * len(sb.strategies) for sb in MAIN_JOB)
    assert {(c.model, c.depth, c.nproc) for c in cases} == {
        *(("gpt", d, 1) for d in (8, 32, 64)),
        ("llama", 32, 1),
        ("dictgpt", 8, 1),
    }
    gpt = {(c.depth, c.strategy) for c in cases if c.model == "gpt"}
    assert {s for d, s in gpt if d == 32} == {
        "full",
        "accelerate",
        "per_block",
        "aotdist",
        "aotdist+lowered",  # a long run's compile, against full's step
        "aotdist+frames",  # a short run's, against the best peer's start
    }
    # no minutes-long full at 64; every model has aotdist, its short-run choice and peers
    assert {s for d, s in gpt if d == 64} == {
        "accelerate",
        "per_block",
        "aotdist",
        "aotdist+frames",
    }
    assert all(
        {"aotdist", "aotdist+frames", "accelerate", "per_block"}
        <= {c.strategy for c in cases if c.model == m}
        for m in ("gpt", "llama", "dictgpt")
    )
    assert MAIN_SETTINGS.repeats >= 2  # every figure with a spread
    only = plan_cases(strategies=["aotdist"])
    assert {c.strategy for c in only} == {"aotdist"} and len(only) == 5


def test_full_plan_reads_every_target_cell_with_each_run_length():
    """--full: GPT and Llama at 8, 32 and 64 and the ModuleDict model, each against every
    peer and with what a short run (frames) and a long run (lowered) compile."""
    cases = plan_cases(full=True)
    assert len(cases) == sum(len(sb.depths) * len(sb.strategies) for sb in FULL_JOB)
    runs = {}
    for c in cases:
        runs.setdefault((c.model, c.depth), set()).add(c.strategy)
    targets = [(m, d) for m in ("gpt", "llama") for d in (8, 32, 64)] + [("dictgpt", 8)]
    for cell in targets:
        assert {"aotdist", "aotdist+frames", "aotdist+lowered", "accelerate", "per_block"} <= (
            runs[cell]
        ), cell
        # the long run's compile is judged against whole-model compile's step
        assert cell[0] == "dictgpt" or "full" in runs[cell], cell
    warm = {(c.model, c.depth) for c in cases if c.warm}
    assert warm == {("gpt", 8), ("llama", 8)}
    assert len(set(cases)) == len(cases)  # no cell twice


def test_quick_plan_is_one_depth_one_repeat():
    cases = plan_cases(quick=True)
    assert cases == [Case("gpt", 2, s) for s in ("full", "accelerate", "per_block", "aotdist")]
    assert QUICK_SETTINGS.repeats == 1 and QUICK_SETTINGS.steps < MAIN_SETTINGS.steps
    assert plan_cases(depths=[4], quick=True) == [
        Case("gpt", 4, s) for s in ("eager", "full", "accelerate", "per_block", "aotdist")
    ]


def test_interleave_is_round_robin_over_repeats():
    cases = [Case("gpt", 2, "full"), Case("gpt", 2, "aotdist"), Case("gpt", 8, "full")]
    order = interleave(cases, 3)
    assert order == [(r, c) for r in range(3) for c in cases]
    # never two runs of one cell in a row: each repeat visits every cell once
    assert all(a[1] != b[1] for a, b in zip(order, order[1:], strict=False))
    assert interleave(cases, 1) == [(0, c) for c in cases]
    with pytest.raises(ConfigError, match="--repeats must be >= 1"):
        interleave(cases, 0)


def test_explicit_options_give_a_grid():
    cases = plan_cases(models=["vit"], depths=[1, 2], nprocs=[1, 2], strategies=["eager"])
    assert cases == [Case("vit", d, "eager", n) for n in (1, 2) for d in (1, 2)]
    with pytest.raises(ConfigError, match="unknown bench strategy 'nope'"):
        plan_cases(strategies=["nope"])
    with pytest.raises(ConfigError, match="unknown bench model"):
        plan_cases(models=["bert"])
