"""``aotdist bench``: time to the first N steps, compile time, step time and memory of the
strategies, side by side.

Every measurement runs in a fresh process with its own empty compiler cache directory
(:mod:`aotdist.bench.runner`), so compile times are cold; a ``warm`` cell then restarts on
the caches its run left. Cells repeat round robin and every ratio is computed within one
repeat, then reported as a median with its spread (:mod:`aotdist.bench.stats`,
:mod:`aotdist.bench.timeto`); steady steps come from strategies timed side by side in one
process (*paired* runs, :func:`aotdist.bench.runner.measure_paired`).

Entry point: :func:`run_bench`. The main job (``aotdist bench`` with no arguments) is
:data:`MAIN_JOB` with :data:`~aotdist.bench.cells.MAIN_SETTINGS`; ``--quick`` is
:data:`QUICK_JOB` with :data:`~aotdist.bench.cells.QUICK_SETTINGS`. The method:
docs/internals.md and docs/bench/.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from aotdist.bench.busy import OthersMeter
from aotdist.bench.cells import (
    ALL_STRATEGIES,
    FULL_JOB,
    MAIN_JOB,
    MAIN_SETTINGS,
    QUICK_JOB,
    QUICK_SETTINGS,
    Case,
    SubBench,
    interleave,
    plan_cases,
)
from aotdist.bench.forkserver import ForkServer, fork_available, spawned
from aotdist.bench.machine import load_snapshot
from aotdist.bench.report import write_report
from aotdist.bench.runner import PHASE_PREFIX, RESULT_PREFIX
from aotdist.bench.stats import PEERS, fresh_start_s, restart_s
from aotdist.errors import BenchError, ConfigError, MissingDependencyError

__all__ = [
    "ALL_STRATEGIES",
    "BenchError",
    "FULL_JOB",
    "MAIN_JOB",
    "MAIN_SETTINGS",
    "QUICK_JOB",
    "QUICK_SETTINGS",
    "Case",
    "SubBench",
    "interleave",
    "plan_cases",
    "run_bench",
]


def _measure_in_fresh_process(case: Case, **kwargs) -> dict:
    """One measurement; ``*+cache``: a cold run that saves the artifact bundle, then
    a warm run (fresh process, empty Inductor cache) that starts from it. A ``warm`` cell
    restarts instead (:func:`_restart`; a ``+cache`` one with its bundle)."""
    if not case.strategy.endswith("+cache"):
        return _restart(case, _measure_once, **kwargs)
    from aotdist.bench.strategies import ARTIFACTS_ENV

    if not case.warm:  # a fresh start: the probes in both runs, as in a new cache dir
        kwargs.pop("seed", None)
    kwargs.pop("keep_cache", None)
    with tempfile.TemporaryDirectory(prefix="aotdist-bench-artifacts-") as artifacts:
        if case.warm:
            return _restart(case, _measure_once, env={ARTIFACTS_ENV: artifacts}, **kwargs)
        cold = _measure_once(case, env={ARTIFACTS_ENV: artifacts}, **kwargs)
        kwargs["progress"]("        warm start from the saved artifacts (fresh process)")
        if kwargs.get("profile_dir"):  # the warm run's profiles beside the cold run's
            kwargs["profile_dir"] = os.path.join(kwargs["profile_dir"], "warm")
        warm = _measure_once(case, env={ARTIFACTS_ENV: artifacts}, **kwargs)
    return {
        **cold,
        "warm_first_step_s": fresh_start_s(warm),
        "warm_compile_s": warm["compile_s"],
        "warm_cache_load": warm["cache_load"],
        "warm_precompiled": warm.get("precompiled"),
        "warm_precompile_reason": warm.get("precompile_reason"),
    }


def _restart(case: Case, measure: Callable[..., dict], **kwargs) -> dict:
    """``measure`` once; for a ``warm`` cell in a cache dir of its own, then a restart: a
    second fresh process on the same ``TORCHINDUCTOR_CACHE_DIR``, as a user restarting on
    the same machine (a ``+cache`` strategy also finds its artifact bundle). Its set-up
    and first step (:func:`~aotdist.bench.stats.restart_s`) go into ``warm_restart_s``."""
    if not case.warm:
        return measure(case, **kwargs)
    seed, keep = kwargs.pop("seed", None), kwargs.pop("keep_cache", None)
    with tempfile.TemporaryDirectory(prefix="aotdist-bench-kept-") as kept:
        if seed:
            shutil.copytree(seed, kept, dirs_exist_ok=True)
        cold = measure(case, cache_dir=kept, keep_cache=keep, **kwargs)
        kwargs["progress"]("        warm restart on the kept compiler caches (fresh process)")
        kwargs.update(steps=2, warmup=0, profile_dir=None)  # its first step is the figure
        warm = measure(case, cache_dir=kept, **kwargs)
    return {
        **cold,
        "warm_restart_s": restart_s(warm),
        "warm_restart_apply_s": warm["apply_s"],
        "warm_restart_first_step_s": warm["first_step_s"],
        "warm_restart_cache_load": warm.get("cache_load"),
    }


def _measure_once(
    case: Case,
    *,
    backend: str,
    steps: int,
    warmup: int,
    device: str,
    float8: bool,
    timeout: float,
    replicate: int = 1,
    mode: str | None = None,
    profile_dir: str | None,
    progress: Callable[[str], None],
    env: dict | None = None,
    seed: str | None = None,
    keep_cache: str | None = None,
    paired_rounds: int = 0,
    cache_dir: str | None = None,
    server: ForkServer | None = None,
) -> dict:
    """One run in a fresh process (forked from ``server``, else spawned) whose Inductor cache dir starts as a copy of ``seed``
    (empty without one), or is ``cache_dir`` itself, kept as the run leaves it;
    ``keep_cache``: merge that dir into this folder after a run that succeeded
    (compiled artifacts are content-addressed, so runs can share one)."""
    with (
        tempfile.TemporaryDirectory(prefix="aotdist-bench-cache-") as temp,
        tempfile.TemporaryDirectory(prefix="aotdist-bench-out-") as outdir,
    ):
        cache = cache_dir or temp
        if seed:
            shutil.copytree(seed, cache, dirs_exist_ok=True)
        env = dict(
            os.environ,
            TORCHINDUCTOR_CACHE_DIR=cache,
            TRITON_CACHE_DIR=os.path.join(cache, "triton"),
            PYTHONWARNINGS="ignore",
            **(env or {}),
        )
        argv = [
            "--strategy",
            case.strategy,
            "--model",
            case.model,
            "--depth",
            str(case.depth),
            "--backend",
            backend,
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
            "--device",
            device,
            "--nproc",
            str(case.nproc),
            "--timeout",
            str(timeout),
        ]
        argv += ["--float8"] if float8 else []
        argv += ["--mode", mode] if mode else []
        argv += ["--replicate", str(replicate)] if replicate > 1 and case.nproc > 1 else []
        argv += ["--profile-dir", profile_dir] if profile_dir else []
        argv += ["--paired", str(paired_rounds)] if paired_rounds else []
        result, lines = None, []

        def on_line(line: str) -> None:
            nonlocal result
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX) :])
            elif line.startswith(PHASE_PREFIX):
                progress(f"        {line[len(PHASE_PREFIX) :].rstrip()}")
            else:
                lines.append(line)

        # The child enforces the ranks' timeout; this one covers a child that hangs itself
        # (its ranks die with it: run_distributed sets PR_SET_PDEATHSIG).
        if server is not None:
            returncode, err = server.run(
                argv, env=env, workdir=outdir, timeout=timeout + 60, on_line=on_line
            )
        else:
            returncode, err = spawned(argv, env=env, timeout=timeout + 60, on_line=on_line)
        if result is not None and returncode == 0:
            if keep_cache:
                shutil.copytree(cache, keep_cache, dirs_exist_ok=True)
            return result
        tail = "\n".join((err + "".join(lines)).splitlines()[-25:])
    why = "timed out and was killed" if returncode == -9 else f"exit {returncode}"
    again = f" --paired {paired_rounds}" if paired_rounds else ""
    raise BenchError(
        f"measurement {_label(case)} failed ({why}); its last output:\n{tail}\n"
        "Fix: run it alone with `python -m aotdist.bench.runner --strategy "
        f"{case.strategy} --model {case.model} --depth {case.depth} --nproc "
        f"{case.nproc} --backend {backend}{again}"
        f"{f' --mode {mode}' if mode else ''}` to see the whole error."
    )


def _seed_isa_probes(
    where: str, *, backend: str, device: str, progress: Callable[[str], None]
) -> str | None:
    """Inductor's CPU vector-ISA probes, built once into ``where`` (a fresh process), or
    ``None`` where they do not apply or fail.

    Every run's empty Inductor cache dir starts from a copy of them (the ``+cache``
    cells excepted: their cold and warm runs measure a fresh start), so that no run spends
    the C++ compiles again: they are a one-time cost of a cache dir, not of a strategy,
    and the runner times them apart from the cold step anyway.
    """
    if device != "cpu" or backend != "inductor":
        return None
    progress("building Inductor's CPU ISA probes once, for every run's cache dir")
    code = "from aotdist import _compat; _compat.probe_cpu_isa()"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=where),
        timeout=600,
    )
    if proc.returncode != 0:
        progress(f"        ISA probes failed (each run builds its own): {proc.stderr[-300:]}")
        return None
    return where


# strategies the paired runs time
PAIRED = (
    "aotdist",
    "aotdist+lowered",
    "aotdist+frames",
    "full",
    "accelerate",
    "per_block",
    "repeated_blocks",
    "eager",
)


def _paired_cells(cases: Sequence[Case]) -> list[Case]:
    """One cell per single-process (model, depth) that has aotdist and a peer: its
    strategy field lists them all, for :func:`aotdist.bench.runner.measure_paired`."""
    found: dict[tuple[str, int], list[str]] = {}
    for c in cases:
        if c.nproc == 1 and c.strategy in PAIRED:
            names = found.setdefault((c.model, c.depth), [])
            names += [] if c.strategy in names else [c.strategy]
    return [
        Case(model, depth, ",".join(names))
        for (model, depth), names in found.items()
        if "aotdist" in names and (set(PEERS) & set(names))
    ]


def _skip_unavailable(cases: list[Case], progress: Callable[[str], None]) -> tuple[list, list]:
    """The cells this build can run, and a note per strategy whose cells were left out."""
    from aotdist.bench.strategies import get_strategy

    why = {
        s: get_strategy(s).unavailable()
        for s in dict.fromkeys(c.strategy for c in cases)
        if get_strategy(s).unavailable
    }
    why = {s: text for s, text in why.items() if text}
    for text in why.values():
        progress(f"skipped: {text}")
    return [c for c in cases if c.strategy not in why], list(why.values())


def _warm_dir(root: str, case: Case, rep: int, pairs: set[tuple[str, int]]) -> str | None:
    """Where the first repeat of a cell that a paired run times keeps its compiled
    artifacts (one folder per model and depth), else ``None``."""
    if (
        rep
        or case.nproc != 1
        or case.strategy not in PAIRED
        or (case.model, case.depth) not in pairs
    ):
        return None
    return os.path.join(root, f"{case.model}-{case.depth}")


def _check_model_dependencies(cases: Sequence[Case]) -> None:
    """Refuses, before any run, a model whose package is missing (not 20 minutes in).

    Raises:
        MissingDependencyError: transformers is missing and a cell builds ``llama``, or
            diffusers and a cell builds ``flux``.
    """
    if any(c.model == "llama" for c in cases) and importlib.util.find_spec("transformers") is None:
        raise MissingDependencyError(
            "the bench model 'llama' (in the main job) needs transformers, which is not "
            "installed. Fix: pip install 'aotdist[bench]' (or pip install transformers), or "
            "leave the model out: aotdist bench --model gpt,dictgpt.",
            extra="bench",
        )
    if any(c.model == "flux" for c in cases) and importlib.util.find_spec("diffusers") is None:
        raise MissingDependencyError(
            "the bench model 'flux' needs diffusers, which is not installed. Fix: pip "
            "install 'aotdist[zoo]' (or pip install diffusers), or leave the model out.",
            extra="zoo",
        )


def _check_mode(mode: str | None, *, backend: str, device: str) -> None:
    """``--mode`` names an Inductor mode, with Inductor, and CUDA graphs only on CUDA.

    Raises:
        ConfigError: It does not.
    """
    from aotdist.bench.strategies import CUDA_GRAPH_MODES
    from aotdist.config import COMPILE_MODES

    if mode is None:
        return
    if mode not in COMPILE_MODES:
        raise ConfigError(
            f"--mode {mode!r}: unknown torch.compile mode; use one of {', '.join(COMPILE_MODES)}"
        )
    if backend != "inductor":
        raise ConfigError(
            f"--mode {mode} applies to the inductor backend; got --backend "
            f"{backend}. Fix: drop --mode or use --backend inductor."
        )
    if mode in CUDA_GRAPH_MODES and not device.startswith("cuda"):
        raise ConfigError(
            f"--mode {mode} records CUDA graphs, which need --device cuda; got "
            f"--device {device}. Fix: use --device cuda, or on CPU "
            "--mode max-autotune-no-cudagraphs or no --mode."
        )


def _check_mesh(mesh: tuple[int, int] | None, cases: Sequence[Case]) -> int:
    """The HSDP replicate degree ``mesh`` asks for (1 without one).

    Raises:
        ConfigError: A multi-rank cell's ``nproc`` is not ``replicas * shards``.
    """
    if mesh is None:
        return 1
    size = mesh[0] * mesh[1]
    wrong = sorted({c.nproc for c in cases if c.nproc > 1 and c.nproc != size})
    if wrong or not any(c.nproc > 1 for c in cases):
        raise ConfigError(
            f"--mesh {mesh[0]}x{mesh[1]} needs --nproc {size}; got "
            f"{sorted({c.nproc for c in cases})}. Fix: --nproc {size}."
        )
    return mesh[0]


def _label(case: Case) -> str:
    ranks = f" x{case.nproc} ranks FSDP2" if case.nproc > 1 else ""
    warm = " (+ warm restart)" if case.warm else ""
    return f"{case.strategy} {case.model} depth={case.depth}{ranks}{warm}"


def run_bench(
    cases: Sequence[Case] | None = None,
    *,
    backend: str = "inductor",
    steps: int = MAIN_SETTINGS.steps,
    warmup: int = MAIN_SETTINGS.warmup,
    device: str = "cpu",
    float8: bool = False,
    repeats: int = MAIN_SETTINGS.repeats,
    out: str | Path = "bench-out",
    timeout: float = 1200.0,
    profile: bool = False,
    mesh: tuple[int, int] | None = None,
    mode: str | None = None,
    progress: Callable[[str], None] = print,
) -> dict:
    """Runs every cell ``repeats`` times, round robin, and writes bench.json/.md/.png.

    Args:
        cases: The cells; :func:`plan_cases` ``()`` (the main job) when ``None``.
        backend: The ``torch.compile`` backend of every compiling strategy.
        steps: Steady steps timed per run (the median is the run's step time).
        warmup: Untimed steps between the cold step and the timed ones.
        device: ``cpu`` or ``cuda``.
        float8: Convert eligible Linear layers to torchao Float8 in every strategy.
        repeats: Runs per cell, each a fresh process; repeat ``r`` of every cell runs
            before repeat ``r + 1`` of any. The report gives medians and spreads.
        out: Output directory.
        timeout: Seconds one run may take before its processes are killed.
        profile: Write cProfile / torch.profiler / compile-phase files per run under
            ``out/profile`` (their timings are inflated by profiling).
        mesh: ``(replicas, shards)``: the multi-rank cells shard as HSDP on that 2-D mesh
            (their ``nproc`` must be ``replicas * shards``); ``None``: FSDP over all ranks.
        mode: The ``torch.compile`` mode of every compiling strategy (``None``: the
            default); ``reduce-overhead`` and ``max-autotune`` (CUDA graphs) need ``cuda``.
        progress: Receives one line per run and phase.

    After the round robin, the paired runs (module docstring) time the steady steps of
    each single-process depth's strategies side by side; the steady-step ratios come
    from them.

    Returns:
        The report dict written to ``bench.json``.

    Raises:
        BenchError: A run failed or timed out (its output tail is in the message).
        ConfigError: Bad arguments.
    """
    if steps < 1 or warmup < 0 or repeats < 1:
        raise ConfigError(
            f"need steps >= 1, warmup >= 0, repeats >= 1; got steps={steps}, "
            f"warmup={warmup}, repeats={repeats}"
        )
    _check_mode(mode, backend=backend, device=device)
    cases = plan_cases() if cases is None else list(cases)
    cases, skipped = _skip_unavailable(cases, progress)
    replicate = _check_mesh(mesh, cases)
    _check_model_dependencies(cases)
    order = interleave(cases, repeats)
    out = Path(out)
    load_start, runs, started = load_snapshot(), [], time.perf_counter()
    progress(
        f"aotdist bench: {len(cases)} cells x {repeats} repeat(s), round robin, "
        f"backend={backend}, device={device}, each run a fresh process with an empty "
        f"compiler cache; load average {load_start['loadavg']} on {load_start['cpus']} "
        "CPUs"
    )
    paired_cells = _paired_cells(cases) if not profile else []
    pairs = {(c.model, c.depth) for c in paired_cells}
    # On CPU measurements fork from one server that imported the compiler stack (about 2 s
    # saved a run, none of it measured time); on CUDA each is spawned: a CUDA runtime
    # touched before a fork fails in the child. Others' CPU use is sampled throughout.
    forked = fork_available() and device == "cpu"
    with (
        tempfile.TemporaryDirectory(prefix="aotdist-bench-isa-") as isa_dir,
        tempfile.TemporaryDirectory(prefix="aotdist-bench-warm-") as warm_root,
        ForkServer() if forked else contextlib.nullcontext() as server,
        OthersMeter() as others,
    ):
        isa_seed = _seed_isa_probes(isa_dir, backend=backend, device=device, progress=progress)
        for n, (rep, case) in enumerate(order, start=1):
            progress(
                f"[{n}/{len(order)}] repeat {rep + 1}/{repeats} {_label(case)}: cold step + "
                f"{warmup} warm-up + {steps} timed steps "
                f"({time.perf_counter() - started:.0f}s elapsed)"
            )
            profile_dir = str(out / "profile" / f"repeat{rep}") if profile else None
            mark = others.mark()
            r = _measure_in_fresh_process(
                case,
                backend=backend,
                steps=steps,
                warmup=warmup,
                device=device,
                float8=float8,
                timeout=timeout,
                profile_dir=profile_dir,
                progress=progress,
                seed=isa_seed,
                replicate=replicate,
                mode=mode,
                keep_cache=_warm_dir(warm_root, case, rep, pairs),
                server=server,
            )
            r["others_cpu_share"] = others.share_since(mark)
            progress(
                f"        compile {r['compile_s']:.2f}s  step {r['steady_step_s'] * 1e3:.2f}ms"
                f"  saved {r['saved_activation_bytes'] / 1024:.0f}KiB"
                f"  peak +{r['peak_mem_mib']:.0f}MiB  frames {r['frames_compiled']}"
                f"  graph breaks {r['graph_breaks']}"
            )
            runs.append({**r, "repeat": rep})
        # Steady-step ratios: separate processes minutes apart disagree by tens of percent
        # on a shared machine, so each depth's strategies also run side by side in one.
        # Their compiles are not measured, so they load what the first repeat compiled.
        paired, failed, rounds = [], [], max(4, 2 * repeats)
        for case in paired_cells:
            progress(
                f"[paired] {case.model} depth={case.depth}: {case.strategy.replace(',', ', ')}"
                f" in one process, {rounds} interleaved rounds of {steps} steps "
                f"({time.perf_counter() - started:.0f}s elapsed)"
            )
            warm = os.path.join(warm_root, f"{case.model}-{case.depth}")
            mark = others.mark()
            try:
                paired.append(
                    _measure_once(
                        case,
                        backend=backend,
                        steps=steps,
                        warmup=warmup,
                        device=device,
                        float8=float8,
                        timeout=timeout,
                        profile_dir=None,
                        progress=progress,
                        paired_rounds=rounds,
                        mode=mode,
                        seed=warm if os.path.isdir(warm) else isa_seed,
                        server=server,
                    )
                )
                paired[-1]["others_cpu_share"] = others.share_since(mark)
            except BenchError as exc:  # the round robin's results stand without it
                failed.append(f"depth {case.depth}: {str(exc).splitlines()[0]}")
                progress(
                    f"        paired run failed; the steady-step ratios at depth "
                    f"{case.depth} stay across processes. {exc}"
                )
        others_share = others.total()
    settings = {
        "backend": backend,
        "compile_mode": mode,
        "steps": steps,
        "warmup": warmup,
        "device": device,
        "float8": float8,
        "repeats": repeats,
        "profiled": profile,
        "mesh": list(mesh) if mesh else None,
        "cases": [asdict(c) for c in cases],
        "order": [[rep, asdict(c)] for rep, c in order],
        "duration_s": time.perf_counter() - started,
        "load_start": load_start,
        "load_end": load_snapshot(),
        "start": "forked" if server is not None else "spawned",
        "others_cpu_share": others_share,
        "paired_failures": failed,
        "skipped": skipped,
    }
    return write_report(runs, out, settings=settings, paired=paired)
