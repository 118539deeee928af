"""What ``aotdist bench`` measures, and in which order.

A *cell* (:class:`Case`) is a model at a depth, compiled one way, on some ranks. The main
job (:data:`MAIN_JOB`) and the developers' quick job (:data:`QUICK_JOB`) are fixed lists
of cells; :func:`plan_cases` builds either, or the grid of explicit options.

Every cell runs ``repeats`` times, and :func:`interleave` orders the runs round robin:
repeat 0 of every cell, then repeat 1 of every cell, and so on. Runs that share a repeat
index ran minutes apart at most, so a ratio between two of them (aotdist over full at one
depth, say) sees the same machine load; a load spike hits one repeat of every cell
instead of every repeat of one cell. :mod:`aotdist.bench.stats` computes the ratios per
repeat.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aotdist.errors import ConfigError

__all__ = ["ALL_STRATEGIES", "MAIN_JOB", "QUICK_JOB", "Case", "JobSettings", "SubBench",
           "interleave", "plan_cases"]

ALL_STRATEGIES = ("eager", "full", "accelerate", "aotdist")


@dataclass(frozen=True)
class Case:
    """One cell: a model at a depth, compiled one way, on ``nproc`` ranks."""

    model: str
    depth: int
    strategy: str
    nproc: int = 1


@dataclass(frozen=True)
class SubBench:
    """A group of cells the report compares with each other."""

    model: str
    depths: tuple[int, ...]
    nproc: int = 1
    strategies: tuple[str, ...] = ALL_STRATEGIES


@dataclass(frozen=True)
class JobSettings:
    """Defaults of a job: timed steps, untimed warm-up steps, repeats per cell."""

    steps: int
    warmup: int
    repeats: int


# The main job: 19 cells x 2 repeats, each run a fresh process, then the paired runs
# (each depth's strategies side by side in one process, 4 interleaved rounds, loading what
# the first repeat compiled). It took 11.8 minutes on a quiet 2-core Intel Xeon with
# inductor (about 17 s per run); 2-core AMD EPYCs take about twice as long per run.
# - GPT at depths 2, 8 and 32 carries every target: step time at every depth, cold
#   compile and its growth, saved-for-backward and peak memory.
# - GPT at depth 64 (Accelerate and aotdist; a whole-model compile there takes minutes)
#   shows whether compile stays flat in depth.
# - Two models whose blocks nobody here wrote: transformers' Llama (decoder layers in a
#   ModuleList), and GPT with its blocks in an nn.ModuleDict, where Accelerate's
#   compile_regions finds no blocks and compiles the whole model (so that model has no
#   separate full cell).
# Two repeats (not three) make room for them; the step ratios come from the paired
# rounds, four per depth. Left out (still available with --model / --nproc):
# torchvision's ViT (blocks in an nn.Sequential: Accelerate's cell equals full) and the
# FSDP2 groups (gloo step times on CPU say little about NCCL on GPUs).
MAIN_JOB = (SubBench("gpt", (2, 8, 32)),
            SubBench("gpt", (64,), strategies=("accelerate", "aotdist")),
            SubBench("llama", (8,), strategies=("full", "accelerate", "aotdist")),
            SubBench("dictgpt", (8,), strategies=("accelerate", "aotdist")))
MAIN_SETTINGS = JobSettings(steps=20, warmup=3, repeats=2)

# `aotdist bench --quick`: one depth, one run per strategy, few steps (< 2 min with
# inductor on a quiet 2-core CPU). For developers; its ratios carry no spread.
QUICK_JOB = (SubBench("gpt", (2,)),)
QUICK_SETTINGS = JobSettings(steps=5, warmup=1, repeats=1)


def plan_cases(*, models: Sequence[str] | None = None, depths: Sequence[int] | None = None,
               nprocs: Sequence[int] | None = None,
               strategies: Sequence[str] | None = None, quick: bool = False) -> list[Case]:
    """The cells to measure, in order (one repeat; :func:`interleave` repeats them).

    With ``models``, ``depths`` and ``nprocs`` all ``None``: the main job
    (:data:`MAIN_JOB`), or :data:`QUICK_JOB` with ``quick``, restricted to
    ``strategies`` when given. Otherwise the grid of the given values, defaulting to GPT,
    depths 2, 8, 32 (2 with ``quick``), one process.

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
        subs = QUICK_JOB if quick else MAIN_JOB
    else:
        default_depths = (2,) if quick else (2, 8, 32)
        # On several ranks, aotdist's graph-mode FSDP runs beside the FSDP2 strategies.
        subs = tuple(SubBench(m, tuple(depths or default_depths), nproc=n,
                              strategies=ALL_STRATEGIES + (("aotdist-graph",) if n > 1 else ()))
                     for m in (models or ("gpt",)) for n in (nprocs or (1,)))
    return [Case(sb.model, d, s, sb.nproc) for sb in subs for d in sb.depths
            for s in (strategies or sb.strategies)]


def interleave(cases: Sequence[Case], repeats: int) -> list[tuple[int, Case]]:
    """``(repeat, case)`` in run order: round robin, every cell once per repeat.

    Raises:
        ConfigError: ``repeats`` is below 1.
    """
    if repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {repeats}")
    return [(r, case) for r in range(repeats) for case in cases]
