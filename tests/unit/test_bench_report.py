"""Bench planning, strategy registry and report arithmetic, without running a benchmark."""

from __future__ import annotations

import pytest

from aotdist.bench import MAIN_JOB, Case, plan_cases
from aotdist.bench.report import compute_ratios, evaluate_targets
from aotdist.bench.strategies import STRATEGIES, get_strategy, register_strategy
from aotdist.errors import ConfigError


def test_default_plan_is_the_main_job():
    cases = plan_cases()
    assert len(cases) == sum(len(sb.depths) * len(sb.strategies) for sb in MAIN_JOB)
    assert {(c.model, c.nproc) for c in cases} == {("gpt", 1), ("vit", 1), ("gpt", 2)}
    assert {c.strategy for c in cases} == {"eager", "full", "accelerate", "aotdist",
                                           "aotdist-graph"}
    assert {c.nproc for c in cases if c.strategy == "aotdist-graph"} == {2}
    only = plan_cases(strategies=["aotdist"])
    assert {c.strategy for c in only} == {"aotdist"}
    assert len(only) == sum(c.strategy == "aotdist" for c in cases)


def test_explicit_options_give_a_grid():
    cases = plan_cases(models=["vit"], depths=[1, 2], nprocs=[1, 2], strategies=["eager"])
    assert cases == [Case("vit", d, "eager", n) for n in (1, 2) for d in (1, 2)]
    with pytest.raises(ConfigError, match="unknown bench strategy 'nope'"):
        plan_cases(strategies=["nope"])
    with pytest.raises(ConfigError, match="unknown bench model"):
        plan_cases(models=["bert"])


def test_strategy_registry_refuses_duplicates():
    assert list(STRATEGIES)[:4] == ["eager", "full", "accelerate", "aotdist"]
    assert not get_strategy("eager").compiles
    with pytest.raises(ConfigError, match="registered twice"):
        register_strategy("eager", description="again")(lambda model, setup: model)


def _result(strategy, depth, compile_s, step_s, mem, nproc=1):
    return {"strategy": strategy, "model": "gpt", "depth": depth, "nproc": nproc,
            "compile_s": compile_s, "steady_step_s": step_s, "peak_mem_mib": mem}


def test_ratios_and_targets_come_from_the_results():
    results = [_result("eager", 2, 0.0, 0.010, 100), _result("eager", 32, 0.0, 0.020, 120),
               _result("full", 2, 10.0, 0.008, 150), _result("full", 32, 30.0, 0.015, 160),
               _result("aotdist", 2, 10.0, 0.009, 140), _result("aotdist", 32, 11.0, 0.016, 110),
               _result("aotdist", 32, 99.0, 0.5, 999, nproc=2)]
    ratios = compute_ratios(results)
    r = ratios["gpt: compile aotdist/full @depth32"]
    assert (r["numerator"], r["denominator"], r["value"]) == (11.0, 30.0, pytest.approx(11 / 30))
    assert ratios["gpt: compile growth aotdist depth32/depth2"]["value"] == pytest.approx(1.1)
    assert "gpt: compile growth eager depth32/depth2" not in ratios  # 0 / 0
    assert not any(k.startswith("gpt fsdp2x2") for k in ratios)  # no peer in its group
    targets = {t["target"]: t for t in evaluate_targets(results, ratios)}
    assert targets["cold compile: aotdist <= 0.4x full"]["met"] is True
    assert targets["steady step: aotdist <= 1.0x full"]["met"] is False
    assert targets["peak memory: aotdist <= eager"]["met"] is True
    assert targets["compile growth smallest -> largest depth: aotdist <= 1.2x"]["met"] is True
    assert "cold compile: aotdist <= 1.1x accelerate" not in targets  # not measured
