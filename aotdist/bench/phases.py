"""Where compile time goes, and the ``--profile`` output of one measurement.

The split of a cold compile comes from two records PyTorch keeps without any setting:

* ``CompilationMetrics`` (through :func:`aotdist.metrics.track`): cumulative Dynamo,
  AOTAutograd and Inductor time per compiled frame and lazily compiled backward.
* ``torch._dynamo.utils.compilation_time_metrics``: wall time of every
  ``dynamo_timed`` section. Inside Inductor, ``GraphLowering.codegen`` is lowering,
  scheduling (fusion) and writing the code; ``PyCodeCache.load_by_key_path`` is loading
  the generated module, which waits for its kernels' C++ (or Triton) compiles
  (``async_compile.wait`` inside it); ``compile_file`` is one C++ compiler run, summed
  over parallel workers, and their count is the number of C++ compiles.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from aotdist import _compat

PROFILED_STEPS = 5  # steady steps under torch.profiler (every rank runs them)

# dynamo_timed sections the split reports (name in the report -> section)
_SECTIONS = {
    "inductor_codegen": "GraphLowering.codegen",
    "inductor_kernel_load_wait": "PyCodeCache.load_by_key_path",
    "cpp_compile_summed": "compile_file",
}


def _snapshot() -> dict[str, int]:
    return {k: len(v) for k, v in (_compat.compilation_time_metrics() or {}).items()}


class PhaseTimer:
    """Context manager recording the ``dynamo_timed`` sections that ran inside it."""

    def __enter__(self) -> PhaseTimer:
        self._before = _snapshot()
        self.sections: dict[str, tuple[float, int]] = {}  # name -> (seconds, calls)
        return self

    def __exit__(self, *exc) -> None:
        for name, times in (_compat.compilation_time_metrics() or {}).items():
            new = times[self._before.get(name, 0) :]
            if new:
                self.sections[name] = (float(sum(new)), len(new))

    def split(self, m, *, compile_s: float) -> dict:
        """Seconds by phase of the cold compile measured by ``m`` (a ``CompileMetrics``).

        ``dynamo`` (bytecode tracing, guards), ``aot_autograd`` (joint graph, partition),
        ``inductor`` (everything in the backend), of which ``inductor_codegen`` and
        ``inductor_kernel_load_wait``; ``cpp_compile_summed`` / ``cpp_compiles``: the C++
        compiler runs; ``outside_compiler``: the cold step's extra time not spent in the
        compiler (first-run allocation, lazy imports, guard setup).
        """
        out = {
            "dynamo": m.dynamo_seconds,
            "aot_autograd": m.aot_autograd_seconds,
            "inductor": m.backend_seconds,
        }
        for key, section in _SECTIONS.items():
            out[key] = self.sections.get(section, (0.0, 0))[0]
        out["cpp_compiles"] = self.sections.get("compile_file", (0.0, 0))[1]
        out["outside_compiler"] = max(compile_s - m.compile_seconds, 0.0)
        return out

    def table(self, top: int = 40) -> str:
        """Every section that ran, longest first (sections nest: times overlap)."""
        rows = sorted(self.sections.items(), key=lambda kv: -kv[1][0])[:top]
        lines = [f"{'seconds':>9} {'calls':>5}  section (dynamo_timed; nested sections overlap)"]
        lines += [f"{s:9.3f} {n:5d}  {name}" for name, (s, n) in rows]
        return "\n".join(lines) + "\n"


def profile_first_step(step: Callable[[], float], out_dir: str, label: str) -> float:
    """Runs the cold step under cProfile; writes ``<label>.compile.pstats`` and a top list."""
    import cProfile
    import io
    import pstats

    os.makedirs(out_dir, exist_ok=True)
    prof = cProfile.Profile()
    prof.enable()
    try:
        seconds = step()
    finally:
        prof.disable()
    path = os.path.join(out_dir, f"{label}.compile.pstats")
    prof.dump_stats(path)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(60)
    with open(os.path.join(out_dir, f"{label}.compile.txt"), "w") as f:
        f.write(f"cold step {seconds:.2f}s under cProfile (inflated by profiling)\n")
        f.write(text.getvalue())
    return seconds


def profile_steady_steps(
    step: Callable[[], float],
    out_dir: str,
    label: str,
    phases: PhaseTimer,
    *,
    steps: int = PROFILED_STEPS,
) -> None:
    """Profiles ``steps`` steady steps with ``torch.profiler``; writes the op table, a
    Chrome trace and the compile phase table of the cold step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    import torch

    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=False) as prof:
        for _ in range(steps):
            step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    with open(os.path.join(out_dir, f"{label}.step.txt"), "w") as f:
        f.write(f"{steps} steady steps under torch.profiler, by self CPU time\n{table}\n")
    prof.export_chrome_trace(os.path.join(out_dir, f"{label}.step.trace.json"))
    with open(os.path.join(out_dir, f"{label}.phases.txt"), "w") as f:
        f.write(phases.table())
