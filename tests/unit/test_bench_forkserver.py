"""Bench measurements forked from a server that imported the compiler stack: the same
result a spawned ``python -m aotdist.bench.runner`` gives, the measurement's own
environment, failures and time-outs reported as a spawned run's are."""

from __future__ import annotations

import json
import os
import sys

import pytest

from aotdist.bench.forkserver import START_ENV, ForkServer, fork_available, spawned
from aotdist.bench.runner import RESULT_PREFIX

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="forks")

ARGV = ["--strategy", "aotdist", "--model", "gpt", "--depth", "2", "--backend", "aot_eager"]
ARGV += ["--steps", "2", "--warmup", "0"]


def _result(lines: list[str]) -> dict:
    (line,) = [ln for ln in lines if ln.startswith(RESULT_PREFIX)]
    return json.loads(line[len(RESULT_PREFIX) :])


def test_a_forked_measurement_matches_a_spawned_one(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    forked, fresh = [], []
    with ForkServer() as server:
        status, err = server.run(
            ARGV, env=env, workdir=str(tmp_path), timeout=300, on_line=forked.append
        )
        assert status == 0, err
        # a second child starts as fresh as the first: nothing compiled before it
        again: list[str] = []
        assert (
            server.run(ARGV, env=env, workdir=str(tmp_path), timeout=300, on_line=again.append)[0]
            == 0
        )
    assert spawned(ARGV, env=env, timeout=300, on_line=fresh.append)[0] == 0
    a, b, c = _result(forked), _result(again), _result(fresh)
    assert a.keys() == c.keys()
    for r in (a, b, c):
        assert r["regions"]["GPTBlock"]["call_sites"] == 2
        assert r["regions"]["GPTBlock"]["subgraphs"] == 1
        assert r["frames_compiled"] == c["frames_compiled"] > 0
        assert r["recompiles_after_first_step"] == 0
    assert any("cold step (compile)" in ln for ln in forked)  # progress lines stream


def test_each_child_runs_in_its_request_environment_and_reports_failures(tmp_path):
    """aotdist+cache refuses to run without its bundle directory in the environment: one
    server, the variable in one request and not in the next."""
    from aotdist.bench.strategies import ARTIFACTS_ENV

    assert ARTIFACTS_ENV not in os.environ  # the server starts without it
    argv = [*ARGV[:1], "aotdist+cache", *ARGV[2:]]
    with_dir = {**os.environ, ARTIFACTS_ENV: str(tmp_path / "artifacts")}
    with ForkServer() as server:
        status, err = server.run(
            argv, env=with_dir, workdir=str(tmp_path), timeout=300, on_line=lambda line: None
        )
        assert status == 0, err
        status, err = server.run(
            argv, env=dict(os.environ), workdir=str(tmp_path), timeout=300, on_line=lambda ln: None
        )
    assert status != 0 and f"needs ${ARTIFACTS_ENV}" in err  # the child's traceback


def test_a_child_past_its_time_is_killed(tmp_path):
    with ForkServer() as server:
        status, _ = server.run(
            ["--strategy", "aotdist", "--model", "gpt", "--depth", "64", "--steps", "100000"],
            env=dict(os.environ),
            workdir=str(tmp_path),
            timeout=3,
            on_line=lambda line: None,
        )
    assert status == -9


def test_spawn_is_one_variable_away(monkeypatch):
    monkeypatch.setenv(START_ENV, "spawn")
    assert not fork_available()
    monkeypatch.setenv(START_ENV, "fork")
    assert fork_available()


@pytest.mark.parametrize(("device", "forked"), [("cpu", True), ("cuda", False)])
def test_cpu_measurements_fork_cuda_ones_are_spawned(tmp_path, monkeypatch, device, forked):
    """A CUDA runtime touched before a fork fails in the child: with --device cuda no
    server starts and every measurement is its own process."""
    import aotdist.bench as bench
    from aotdist.bench import Case

    started, servers = [], []

    class Server:
        def __enter__(self):
            started.append(self)
            return self

        def __exit__(self, *exc):
            return None

    def fake_measure_once(case, *, server=None, **kwargs):
        servers.append(server)
        return {
            "strategy": case.strategy,
            "model": case.model,
            "depth": case.depth,
            "nproc": 1,
            "compile_s": 0.0,
            "first_step_s": 0.01,
            "steady_step_s": 0.01,
            "saved_activation_bytes": 1,
            "peak_mem_mib": 1.0,
            "frames_compiled": 0,
            "graph_breaks": 0,
            "recompiles_after_first_step": 0,
            "memory_metric": "RSS",
            "regions": {},
            "compile_split_s": {},
        }

    monkeypatch.setattr(bench, "ForkServer", Server)
    monkeypatch.setattr(bench, "_measure_once", fake_measure_once)
    monkeypatch.setenv(START_ENV, "fork")
    report = bench.run_bench(
        [Case("gpt", 2, "eager")],
        backend="aot_eager",
        device=device,
        repeats=1,
        out=tmp_path,
        progress=lambda line: None,
    )
    assert servers == ([started[0]] if forked else [None]) and len(started) == int(forked)
    assert report["settings"]["start"] == ("forked" if forked else "spawned")
