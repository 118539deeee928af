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

ALL_STRATEGIES = ("eager", "full", "accelerate", "per_block", "aotdist")
WARM_SUFFIX = "+warm"  # --strategies full+warm: the cell also times a warm restart


@dataclass(frozen=True)
class Case:
    """One cell: a model at a depth, compiled one way, on ``nproc`` ranks; ``warm``: each
    run is followed by a restart, a second fresh process on the compiler caches it left."""

    model: str
    depth: int
    strategy: str
    nproc: int = 1
    warm: bool = False


@dataclass(frozen=True)
class SubBench:
    """A group of cells the report compares with each other; ``warm``: the strategies
    whose cells also time a warm restart."""

    model: str
    depths: tuple[int, ...]
    nproc: int = 1
    strategies: tuple[str, ...] = ALL_STRATEGIES
    warm: tuple[str, ...] = ()


@dataclass(frozen=True)
class JobSettings:
    """Defaults of a job: timed steps, untimed warm-up steps, repeats per cell."""

    steps: int
    warmup: int
    repeats: int


# The main job: what a user waits for, time to the first N steps (T(N)) against every
# peer, at the depths people train. Each run is a fresh process; then the paired runs
# (each depth's strategies side by side in one process, 4 interleaved rounds, loading what
# the first repeat compiled) give the steady steps, and each round one T(N) ratio. Two
# repeats, so that every figure has a spread; the runs fork from a server that imported
# the compiler stack once (aotdist.bench.forkserver), which keeps the job within 15
# minutes on a quiet 2-core Intel Xeon (measured: docs/bench/README.md).
# - GPT at depths 8, 32 and 64 against full, Accelerate and per-block compile (no full at
#   64: a whole-model compile there takes minutes; full's T(10000) is judged at 32);
#   depth 8 also restarts every strategy on its kept compiler caches (warm T(100)),
#   aotdist without and with its artifact cache.
# - transformers' Llama at depth 32 (decoder layers in a ModuleList; no full: minutes).
# - GPT with its blocks in an nn.ModuleDict at depth 8, where Accelerate's compile_regions
#   finds no blocks and compiles the whole model (so that model has no separate full cell).
# - Where a whole-model compile has the fastest step (GPT 8 and 32, the ModuleDict model),
#   aotdist+lowered too: what aotdist compiles for a long run (compile.expected_steps), so
#   that T(10,000) and T(100,000) show the choice a long run gets; everywhere
#   aotdist+frames, what a short run gets (each region a frame of its own), for T(100).
# Left out (in the --full job): full at depth 64, Llama at 8 and 64 and its full cells, the
# ModuleDict model at 32, eager. Still available with --model / --nproc: torchvision's
# ViT and the FSDP2 groups (gloo step times on CPU say little about NCCL on GPUs).
_PEERS_AND_AOTDIST = ("full", "accelerate", "per_block", "aotdist")
_WARM = (*_PEERS_AND_AOTDIST, "aotdist+cache")
_LONG = "aotdist+lowered"  # what compile.expected_steps >= 10,000 compiles: a long run
_SHORT = "aotdist+frames"  # what compile.expected_steps < 1,000 compiles: a short run
MAIN_JOB = (
    SubBench("gpt", (8,), strategies=(*_WARM, _LONG, _SHORT), warm=_WARM),
    SubBench("gpt", (32,), strategies=(*_PEERS_AND_AOTDIST, _LONG, _SHORT)),
    SubBench("gpt", (64,), strategies=(*_PEERS_AND_AOTDIST[1:], _SHORT)),
    SubBench("llama", (32,), strategies=(*_PEERS_AND_AOTDIST[1:], _SHORT)),
    SubBench("dictgpt", (8,), strategies=(*_PEERS_AND_AOTDIST[1:], _LONG, _SHORT)),
)
MAIN_SETTINGS = JobSettings(steps=20, warmup=3, repeats=2)

# `aotdist bench --full` (plan_cases(full=True)): the whole matrix the targets name (GPT
# and Llama at depths 8, 32 and 64 against every peer, the ModuleDict model at 8 and 32,
# warm restarts at depth 8 of both, diffusers' Flux at 8 against compile_repeated_blocks
# too), each with what a short and a long run compile (aotdist+frames, aotdist+lowered),
# so that every T(N) target reads the choice a run of that length gets.
_ALL_RUNS = (*ALL_STRATEGIES, _LONG, _SHORT)
FULL_JOB = (
    SubBench("gpt", (8,), strategies=("eager", *_WARM, _LONG, _SHORT), warm=_WARM),
    SubBench("gpt", (32, 64), strategies=_ALL_RUNS),
    SubBench("llama", (8,), strategies=("eager", *_WARM, _LONG, _SHORT), warm=_WARM),
    SubBench("llama", (32, 64), strategies=_ALL_RUNS),
    SubBench("dictgpt", (8, 32), strategies=(*_PEERS_AND_AOTDIST[1:], _LONG, _SHORT)),
    SubBench("flux", (8,), strategies=(*_PEERS_AND_AOTDIST, "repeated_blocks", _SHORT)),
)

# `aotdist bench --quick`: one depth, one run per compiling strategy, few steps (about 2
# min with inductor on a quiet 2-core CPU). For developers; its T(N) spreads come from
# the paired rounds only.
QUICK_JOB = (SubBench("gpt", (2,), strategies=_PEERS_AND_AOTDIST),)
QUICK_SETTINGS = JobSettings(steps=5, warmup=1, repeats=1)


def plan_cases(
    *,
    models: Sequence[str] | None = None,
    depths: Sequence[int] | None = None,
    nprocs: Sequence[int] | None = None,
    strategies: Sequence[str] | None = None,
    quick: bool = False,
    full: bool = False,
) -> list[Case]:
    """The cells to measure, in order (one repeat; :func:`interleave` repeats them).

    With ``models``, ``depths`` and ``nprocs`` all ``None``: the main job
    (:data:`MAIN_JOB`), :data:`QUICK_JOB` with ``quick`` or :data:`FULL_JOB` with
    ``full``, restricted to ``strategies`` when given. Otherwise the grid of the given
    values, defaulting to GPT, depths 2, 8, 32 (2 with ``quick``), one process. A strategy
    named with :data:`WARM_SUFFIX` (``aotdist+warm``) gives ``warm`` cells.

    Raises:
        ConfigError: An unknown strategy or model, or a depth or rank count below 1.
    """
    from aotdist.bench.models import MODELS
    from aotdist.bench.strategies import get_strategy

    for s in strategies or ():
        get_strategy(s.removesuffix(WARM_SUFFIX))
    bad = [m for m in models or () if m not in MODELS]
    if bad:
        raise ConfigError(f"unknown bench model(s) {bad}; choose from {', '.join(MODELS)}")
    if any(d < 1 for d in depths or ()) or any(n < 1 for n in nprocs or ()):
        raise ConfigError(f"depths and --nproc must be >= 1; got depths={depths}, nproc={nprocs}")
    if models is None and depths is None and nprocs is None:
        subs = QUICK_JOB if quick else FULL_JOB if full else MAIN_JOB
    else:
        default_depths = (2,) if quick else (2, 8, 32)
        # On several ranks, aotdist's graph-mode FSDP runs beside the FSDP2 strategies.
        subs = tuple(
            SubBench(
                m,
                tuple(depths or default_depths),
                nproc=n,
                strategies=ALL_STRATEGIES + (("aotdist-graph",) if n > 1 else ()),
            )
            for m in (models or ("gpt",))
            for n in (nprocs or (1,))
        )
    return [
        Case(
            sb.model,
            d,
            s.removesuffix(WARM_SUFFIX),
            sb.nproc,
            warm=s.endswith(WARM_SUFFIX) or s in sb.warm,
        )
        for sb in subs
        for d in sb.depths
        for s in (strategies or sb.strategies)
    ]


def interleave(cases: Sequence[Case], repeats: int) -> list[tuple[int, Case]]:
    """``(repeat, case)`` in run order: round robin, every cell once per repeat.

    Raises:
        ConfigError: ``repeats`` is below 1.
    """
    if repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {repeats}")
    return [(r, case) for r in range(repeats) for case in cases]
