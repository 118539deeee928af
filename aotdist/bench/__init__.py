"""``aotdist bench``: compile time, step time and memory of the strategies, side by side.

Every measurement runs in a fresh process with its own empty compiler cache directory
(:mod:`aotdist.bench.runner`), so compile times are cold. Ratios in the report are
computed from values measured in the same run (:mod:`aotdist.bench.report`).

The main job (``aotdist bench`` with no arguments) is :data:`MAIN_JOB`: a depth sweep of
the GPT model with every strategy in one process, torchvision's ViT at one depth, and
the GPT model on 2 ranks with FSDP2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from aotdist.bench.report import write_report
from aotdist.bench.runner import PHASE_PREFIX, RESULT_PREFIX
from aotdist.errors import BenchError, ConfigError

__all__ = ["MAIN_JOB", "Case", "SubBench", "plan_cases", "run_bench"]

ALL_STRATEGIES = ("eager", "full", "accelerate", "aotdist")


@dataclass(frozen=True)
class Case:
    """One measurement: a model at a depth, compiled one way, on ``nproc`` ranks."""

    model: str
    depth: int
    strategy: str
    nproc: int = 1


@dataclass(frozen=True)
class SubBench:
    """A group of measurements the report compares with each other."""

    model: str
    depths: tuple[int, ...]
    nproc: int = 1
    strategies: tuple[str, ...] = ALL_STRATEGIES


# About 8 minutes on a contended 2-core CPU machine (inductor).
MAIN_JOB = (
    SubBench("gpt", (2, 8, 32)),  # compile time vs depth: the main claim
    SubBench("vit", (8,)),  # torchvision's model, blocks in an nn.Sequential
    # FSDP2 on 2 ranks (gloo on CPU, NCCL on GPUs), and aotdist's graph-mode FSDP beside it
    SubBench("gpt", (8,), nproc=2, strategies=(*ALL_STRATEGIES, "aotdist-graph")),
)


def plan_cases(*, models: Sequence[str] | None = None, depths: Sequence[int] | None = None,
               nprocs: Sequence[int] | None = None,
               strategies: Sequence[str] | None = None) -> list[Case]:
    """The measurements to run, in order.

    With ``models``, ``depths`` and ``nprocs`` all ``None``: the main job
    (:data:`MAIN_JOB`), restricted to ``strategies`` when given. Otherwise the grid of
    the given values, defaulting to GPT, depths 2, 8, 32, one process.

    Raises:
        ConfigError: An unknown strategy or model, or a depth or rank count below 1.
    """
    from aotdist.bench.models import MODELS
    from aotdist.bench.strategies import get_strategy

    for s in strategies or ():
        get_strategy(s)
    bad = [m for m in models or () if m not in MODELS]
    if bad:
        raise ConfigError(f"unknown bench model(s) {bad}; choose from {', '.join(MODELS)}")
    if any(d < 1 for d in depths or ()) or any(n < 1 for n in nprocs or ()):
        raise ConfigError(f"depths and --nproc must be >= 1; got depths={depths}, "
                          f"nproc={nprocs}")
    if models is None and depths is None and nprocs is None:
        subs = MAIN_JOB
    else:
        subs = tuple(SubBench(m, tuple(depths or (2, 8, 32)), nproc=n)
                     for m in (models or ("gpt",)) for n in (nprocs or (1,)))
    return [Case(sb.model, d, s, sb.nproc) for sb in subs for d in sb.depths
            for s in (strategies or sb.strategies)]


def _measure_in_fresh_process(case: Case, **kwargs) -> dict:
    """One measurement; ``aotdist+cache``: a cold run that saves the artifact bundle, then
    a warm run (fresh process, empty Inductor cache) that starts from it."""
    if case.strategy != "aotdist+cache":
        return _measure_once(case, **kwargs)
    from aotdist.bench.strategies import ARTIFACTS_ENV

    with tempfile.TemporaryDirectory(prefix="aotdist-bench-artifacts-") as artifacts:
        cold = _measure_once(case, env={ARTIFACTS_ENV: artifacts}, **kwargs)
        kwargs["progress"]("        warm start from the saved artifacts (fresh process)")
        warm = _measure_once(case, env={ARTIFACTS_ENV: artifacts}, **kwargs)
    return {**cold, "warm_first_step_s": warm["first_step_s"],
            "warm_compile_s": warm["compile_s"], "warm_cache_load": warm["cache_load"]}


def _measure_once(case: Case, *, backend: str, steps: int, warmup: int,
                  device: str, float8: bool, timeout: float,
                  profile_dir: str | None,
                  progress: Callable[[str], None], env: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="aotdist-bench-cache-") as cache, \
            tempfile.TemporaryFile(mode="w+") as stderr:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache,
                   TRITON_CACHE_DIR=os.path.join(cache, "triton"), PYTHONWARNINGS="ignore",
                   **(env or {}))
        cmd = [sys.executable, "-m", "aotdist.bench.runner", "--strategy", case.strategy,
               "--model", case.model, "--depth", str(case.depth), "--backend", backend,
               "--steps", str(steps), "--warmup", str(warmup), "--device", device,
               "--nproc", str(case.nproc), "--timeout", str(timeout)]
        cmd += ["--float8"] if float8 else []
        cmd += ["--profile-dir", profile_dir] if profile_dir else []
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
        # The child enforces the ranks' timeout; this one covers a child that hangs itself
        # (its ranks die with it: run_distributed sets PR_SET_PDEATHSIG).
        killer = threading.Timer(timeout + 60, proc.kill)
        killer.start()
        result, lines = None, []
        try:
            for line in proc.stdout:
                if line.startswith(RESULT_PREFIX):
                    result = json.loads(line[len(RESULT_PREFIX):])
                elif line.startswith(PHASE_PREFIX):
                    progress(f"        {line[len(PHASE_PREFIX):].rstrip()}")
                else:
                    lines.append(line)
            proc.wait()
        finally:
            killer.cancel()
        if result is not None and proc.returncode == 0:
            return result
        stderr.seek(0)
        tail = "\n".join((stderr.read() + "".join(lines)).splitlines()[-25:])
    why = "timed out and was killed" if proc.returncode == -9 else f"exit {proc.returncode}"
    raise BenchError(f"measurement {_label(case)} failed ({why}); its last output:\n{tail}\n"
                     "Fix: run it alone with `python -m aotdist.bench.runner --strategy "
                     f"{case.strategy} --model {case.model} --depth {case.depth} --nproc "
                     f"{case.nproc} --backend {backend}` to see the whole error.")


def _label(case: Case) -> str:
    ranks = f" x{case.nproc} ranks FSDP2" if case.nproc > 1 else ""
    return f"{case.strategy} {case.model} depth={case.depth}{ranks}"


def _median_of(runs: list[dict]) -> dict:
    """Repeated runs of one case: the run with the median cold compile, with the medians
    of step time and memory and every run's figures under ``repeats``."""
    import statistics

    if len(runs) == 1:
        return runs[0]
    by_compile = sorted(runs, key=lambda r: r["compile_s"])
    result = dict(by_compile[len(runs) // 2])
    for key in ("steady_step_s", "peak_mem_mib"):
        result[key] = statistics.median(r[key] for r in runs)
    result["repeats"] = [{k: r[k] for k in ("compile_s", "steady_step_s", "peak_mem_mib")}
                         for r in runs]
    return result


def run_bench(cases: Sequence[Case] | None = None, *, backend: str = "inductor",
              steps: int = 20, warmup: int = 3, device: str = "cpu", float8: bool = False,
              repeats: int = 1, out: str | Path = "bench-out", timeout: float = 1200.0,
              profile: bool = False, progress: Callable[[str], None] = print) -> dict:
    """Runs every measurement and writes bench.json/.md/.png to ``out``.

    Args:
        cases: What to measure; :func:`plan_cases` ``()`` (the main job) when ``None``.
        backend: The ``torch.compile`` backend of every compiling strategy.
        steps: Steady steps timed per measurement (the median is reported).
        warmup: Untimed steps between the cold step and the timed ones.
        device: ``cpu`` or ``cuda``.
        float8: Convert eligible Linear layers to torchao Float8 in every strategy.
        repeats: Fresh processes per case; the report takes medians.
        out: Output directory.
        timeout: Seconds one measurement may take before its processes are killed.
        profile: Write cProfile / torch.profiler / compile-phase files per measurement
            under ``out/profile`` (their timings are inflated by profiling).
        progress: Receives one line per measurement and phase.

    Returns:
        The report dict written to ``bench.json``.

    Raises:
        BenchError: A measurement failed or timed out (its output tail is in the message).
        ConfigError: Bad arguments.
    """
    if steps < 1 or warmup < 0 or repeats < 1:
        raise ConfigError(f"need steps >= 1, warmup >= 0, repeats >= 1; got steps={steps}, "
                          f"warmup={warmup}, repeats={repeats}")
    cases = plan_cases() if cases is None else list(cases)
    out = Path(out)
    profile_dir = str(out / "profile") if profile else None
    results, started = [], time.perf_counter()
    total = len(cases) * repeats
    progress(f"aotdist bench: {len(cases)} measurements x {repeats} run(s), backend={backend}, "
             f"device={device}, each a fresh process with an empty compiler cache")
    for i, case in enumerate(cases):
        runs = []
        for k in range(repeats):
            n = i * repeats + k + 1
            progress(f"[{n}/{total}] {_label(case)}: cold step + {warmup} warm-up + {steps} "
                     f"timed steps ({time.perf_counter() - started:.0f}s elapsed)")
            r = _measure_in_fresh_process(case, backend=backend, steps=steps, warmup=warmup,
                                          device=device, float8=float8, timeout=timeout,
                                          profile_dir=profile_dir, progress=progress)
            progress(f"        compile {r['compile_s']:.2f}s  step {r['steady_step_s']*1e3:.2f}ms"
                     f"  peak +{r['peak_mem_mib']:.0f}MiB  frames {r['frames_compiled']}"
                     f"  graph breaks {r['graph_breaks']}")
            runs.append(r)
        results.append(_median_of(runs))
    settings = {"backend": backend, "steps": steps, "warmup": warmup, "device": device,
                "float8": float8, "repeats": repeats, "profiled": profile,
                "cases": [asdict(c) for c in cases],
                "duration_s": time.perf_counter() - started}
    return write_report(results, out, settings=settings)
