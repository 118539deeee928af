"""Time to the first N training steps, what a user waits for: T(N) = cold compile + N x
steady step, per strategy and repeat, aotdist's ratio to the best peer, and the step count
from which aotdist stays ahead of each peer (the crossover).

Per repeat of a cell: the cold compile of that repeat's run with the steady step of each
paired round given to that repeat (round k to the k-th repeat modulo the repeats) where a
paired run timed the strategy, else the run's own. Ratios and crossovers are computed
within one such pair, then reported as median [min-max], as in :mod:`aotdist.bench.stats`.
A warm restart (a second process on the kept compiler caches) gives warm T(N) = its set-up
and first step + N x the same steady step.
"""

from __future__ import annotations

import math
import statistics

from aotdist.bench.stats import PEERS, group_of

HORIZONS = (100, 1_000, 10_000, 100_000)  # the N of T(N)
WARM_HORIZON = 100
# aotdist's cold strategies, each against the peers: the default, a long run's, a short one's
SUBJECTS = ("aotdist", "aotdist+lowered", "aotdist+frames")
WARM_SUBJECTS = ("aotdist", "aotdist+cache")  # without and with its artifact cache


def crossover_steps(cold_a: float, step_a: float, cold_p: float, step_p: float) -> float:
    """The fewest steps ``n >= 0`` from which ``cold_a + n * step_a <= cold_p + n * step_p``
    holds at every later step: ``0`` when aotdist is ahead from the start and its step is no
    slower, ``math.inf`` when its step is slower (a peer that is behind at first still
    overtakes it)."""
    if step_a > step_p:
        return math.inf
    if cold_a <= cold_p:
        return 0
    if step_a == step_p:
        return math.inf
    n = math.ceil((cold_a - cold_p) / (step_p - step_a))
    # float rounding: the smallest n that satisfies the inequality as computed
    while n > 0 and cold_a + (n - 1) * step_a <= cold_p + (n - 1) * step_p:
        n -= 1
    while cold_a + n * step_a > cold_p + n * step_p:
        n += 1
    return n


def _slots(runs: list[dict], paired: list[dict]) -> dict:
    """``(group, depth) -> [(repeat, round)]``: the repeats of the cells there, each with
    the paired rounds it is given (round ``k`` to the ``k``-th repeat modulo the repeats),
    or ``(repeat, None)`` where no paired run timed that depth."""
    rounds = {
        (group_of(p), p["depth"]): max((len(v) for v in p["slice_step_s"].values()), default=0)
        for p in paired
    }
    repeats: dict[tuple, set[int]] = {}
    for r in runs:
        repeats.setdefault((group_of(r), r["depth"]), set()).add(r.get("repeat", 0))
    out = {}
    for key, reps in repeats.items():
        reps_sorted = sorted(reps)
        out[key] = [
            (rep, k)
            for i, rep in enumerate(reps_sorted)
            for k in (range(i, rounds.get(key, 0), len(reps_sorted)) or [None])
        ]
    return out


def _spread(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def _ratio(rows: list[dict]) -> dict:
    values = [r["value"] for r in rows]
    best = [r["peer"] for r in rows if r.get("peer")]
    return {
        "value": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "repeats": len(rows),
        "numerator": statistics.median(r["numerator"] for r in rows),
        "denominator": statistics.median(r["denominator"] for r in rows),
        "per_repeat": rows,
        "source": "time to steps",
        **({"best_peer": max(sorted(set(best)), key=best.count)} if best else {}),
    }


def _finite(x: float) -> float | None:
    return None if math.isinf(x) else x


def time_to_steps(runs: list[dict], paired: list[dict] | None = None) -> dict:
    """T(N) of every strategy per cell, aotdist's ratios to the best peer, crossovers.

    Each figure is computed per *slot*: a repeat's run (its cold compile, its warm
    restart) with one paired round given to that repeat (its steady steps), or the run's
    own steady step where no paired run timed the depth or the strategy.

    Returns:
        ``horizons``; ``cells``: one per (group, depth, strategy) with ``T`` (N ->
        ``{"median", "min", "max", "n"}`` in seconds over the slots), ``warm_T`` (the same
        at :data:`WARM_HORIZON`, cells with a warm restart), ``cold_s`` and ``step_s``
        (the two terms, the same spreads) and ``step_source`` (``paired`` or ``cell``);
        ``ratios``: ``"<group>: T(N) <subject>/best peer
        @depth<d>"``, ``T(N) <subject>/<peer>`` and ``warm T(100) <subject>/best peer``,
        shaped as :func:`aotdist.bench.stats.compute_ratios`' entries (``per_repeat``: one
        row per slot, with the best peer of that slot); ``crossovers``: ``"<group>:
        crossover <subject>/<peer> @depth<d>"``, ``value``/``min``/``max`` in steps
        (``None``: never) and ``per_repeat``.
    """
    paired = list(paired or [])
    rounds = {
        (group_of(p), p["depth"], s): v for p in paired for s, v in p["slice_step_s"].items() if v
    }
    slots = _slots(runs, paired)
    per: dict[tuple, dict[tuple, dict]] = {}  # (group, depth, strategy) -> slot -> figures
    for r in runs:
        if r["strategy"] == "eager" or r.get("compile_s") is None:
            continue
        group, depth, rep = group_of(r), r["depth"], r.get("repeat", 0)
        key = (group, depth, r["strategy"])
        for slot in slots[(group, depth)]:
            if slot[0] != rep:
                continue
            paired_step = key in rounds and slot[1] is not None and slot[1] < len(rounds[key])
            fig = {
                "cold": r["compile_s"],
                "source": "paired" if paired_step else "cell",
                "step": rounds[key][slot[1]] if paired_step else r["steady_step_s"],
            }
            if r.get("warm_restart_s") is not None:
                fig["warm"] = r["warm_restart_s"]
            per.setdefault(key, {})[slot] = fig
    cells = []
    for (group, depth, strategy), by_slot in per.items():
        figs = list(by_slot.values())
        cell = {
            "group": group,
            "depth": depth,
            "strategy": strategy,
            "step_source": figs[0]["source"],
            "cold_s": _spread([f["cold"] for f in figs]),
            "step_s": _spread([f["step"] for f in figs]),
            "T": {str(n): _spread([f["cold"] + n * f["step"] for f in figs]) for n in HORIZONS},
        }
        warm = [f["warm"] + WARM_HORIZON * f["step"] for f in figs if "warm" in f]
        if warm:
            cell["warm_T"] = {str(WARM_HORIZON): _spread(warm)}
        cells.append(cell)
    ratios: dict[str, list[dict]] = {}
    crossovers: dict[str, list[dict]] = {}

    def put(name: str, slot: tuple, mine: float, theirs: float, peer: str | None = None):
        ratios.setdefault(name, []).append(
            {
                "repeat": slot[0],
                "round": slot[1],
                "numerator": mine,
                "denominator": theirs,
                "value": mine / theirs,
                **({"peer": peer} if peer else {}),
            }
        )

    for (group, depth, subject), by_slot in per.items():
        if subject not in SUBJECTS + WARM_SUBJECTS:
            continue
        at = f"@depth{depth}"
        for slot, a in by_slot.items():
            peers = {
                p: per[(group, depth, p)][slot]
                for p in PEERS
                if slot in per.get((group, depth, p), {})
            }
            if subject in SUBJECTS:
                for n in HORIZONS:
                    mine = a["cold"] + n * a["step"]
                    theirs = {p: f["cold"] + n * f["step"] for p, f in peers.items()}
                    for p, t in theirs.items():
                        put(f"{group}: T({n}) {subject}/{p} {at}", slot, mine, t)
                    if theirs:
                        best = min(theirs, key=theirs.get)
                        put(
                            f"{group}: T({n}) {subject}/best peer {at}",
                            slot,
                            mine,
                            theirs[best],
                            best,
                        )
                for p, f in peers.items():
                    crossovers.setdefault(f"{group}: crossover {subject}/{p} {at}", []).append(
                        {
                            "repeat": slot[0],
                            "round": slot[1],
                            "steps": crossover_steps(a["cold"], a["step"], f["cold"], f["step"]),
                        }
                    )
            warm_peers = {
                p: f["warm"] + WARM_HORIZON * f["step"] for p, f in peers.items() if "warm" in f
            }
            if subject in WARM_SUBJECTS and "warm" in a and warm_peers:
                best = min(warm_peers, key=warm_peers.get)
                put(
                    f"{group}: warm T({WARM_HORIZON}) {subject}/best peer {at}",
                    slot,
                    a["warm"] + WARM_HORIZON * a["step"],
                    warm_peers[best],
                    best,
                )
    return {
        "horizons": list(HORIZONS),
        "warm_horizon": WARM_HORIZON,
        "cells": cells,
        "ratios": {k: _ratio(v) for k, v in ratios.items()},
        "crossovers": {k: _crossover(v) for k, v in crossovers.items()},
    }


def _crossover(rows: list[dict]) -> dict:
    """Median [min-max] of the per-repeat crossovers (``None``: never; a median with a
    never in it is never too)."""
    values = [r["steps"] for r in rows]
    return {
        "value": _finite(statistics.median(values)),
        "min": _finite(min(values)),
        "max": _finite(max(values)),
        "repeats": len(rows),
        "unit": "steps",
        "per_repeat": [{**r, "steps": _finite(r["steps"])} for r in rows],
    }
