"""``aotdist bench``: compile time, step time and memory of the strategies, side by side.

Every measurement runs in a fresh process with its own empty compiler cache directory
(:mod:`aotdist.bench.runner`), so compile times are cold. Ratios in the report are
computed from values measured in the same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from aotdist.bench.report import write_report

__all__ = ["run_bench"]


def _measure_in_fresh_process(strategy: str, model: str, depth: int, *, backend: str,
                              steps: int, device: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="aotdist-bench-cache-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=cache,
                   PYTHONWARNINGS="ignore")
        cmd = [sys.executable, "-m", "aotdist.bench.runner", "--strategy", strategy,
               "--model", model, "--depth", str(depth), "--backend", backend,
               "--steps", str(steps), "--device", device]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("AOTDIST_RESULT "):
            return json.loads(line[len("AOTDIST_RESULT "):])
    tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-15:])
    raise RuntimeError(f"benchmark of {strategy} at depth {depth} failed "
                       f"(exit {proc.returncode}):\n{tail}")


def run_bench(*, model: str = "gpt", depths: Sequence[int] = (2, 8, 32),
              strategies: Sequence[str] = ("eager", "full", "accelerate", "aotdist"),
              backend: str = "inductor", steps: int = 5, device: str = "cpu",
              out: str | Path = "bench-out", timeout: float = 1800.0,
              progress: Callable[[str], None] = print) -> dict:
    """Runs every (strategy, depth) measurement and writes bench.json/.md/.png to ``out``.

    Returns:
        The report dict written to ``bench.json``.
    """
    results = []
    total = len(depths) * len(strategies)
    for i, depth in enumerate(depths):
        for j, strategy in enumerate(strategies):
            n = i * len(strategies) + j + 1
            progress(f"[{n}/{total}] {strategy:<10} {model} depth={depth} "
                     f"backend={backend}: cold compile + {steps} steady steps ...")
            r = _measure_in_fresh_process(strategy, model, depth, backend=backend,
                                          steps=steps, device=device, timeout=timeout)
            progress(f"        compile {r['compile_s']:.2f}s  step {r['steady_step_s']*1e3:.1f}ms"
                     f"  peak {r['peak_mem_mib']:.0f}MiB")
            results.append(r)
    return write_report(results, Path(out))
