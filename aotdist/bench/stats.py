"""Bench arithmetic on repeated runs: medians and spreads per cell, ratios per repeat,
and verdicts on targets that noise cannot flip.

A *run* is one measurement (one fresh process) of a cell, tagged with its ``repeat``
index. Runs of the same repeat ran side by side (:func:`aotdist.bench.cells.interleave`),
so every ratio is computed within one repeat, from two runs of that repeat, and the
report gives the median of those per-repeat ratios with their min-max spread. A target
is *met* when every repeat's ratio meets it, *missed* when none does, and *noisy* when
the spread straddles the bound: the run cannot tell, and says so instead of guessing.
"""

from __future__ import annotations

import math
import operator
import statistics

# The peers aotdist is measured against: every compiling strategy that is not aotdist's.
PEERS = ("full", "accelerate", "per_block", "repeated_blocks")


def fresh_start_s(result: dict) -> float:
    """A fresh start's first step: the cold step plus the ISA probes run before it and
    the cache bundle's load in ``parallelize`` (a warm start's saved graph loads there)."""
    return (
        result["first_step_s"]
        + (result.get("isa_probe_s") or 0.0)
        + (result.get("cache_load_s") or 0.0)
    )


def restart_s(result: dict) -> float:
    """A run's set-up and first step, as a restart waits for them: the strategy's apply
    (where ``parallelize`` loads saved artifacts), the ISA probes and the first step."""
    return (
        result["first_step_s"] + (result.get("isa_probe_s") or 0.0) + (result.get("apply_s") or 0.0)
    )


# Per-run figures a cell reports as median and spread.
FIGURES = (
    "compile_s",
    "first_step_s",
    "isa_probe_s",
    "steady_step_s",
    "peak_mem_mib",
    "saved_activation_bytes",
    "saved_bytes_total",
    "warm_first_step_s",
    "warm_restart_s",
)

# (what the target asks, ratio name with {d} for a depth and {lo} for the group's smallest,
# comparison, bound, which depths: "every" depth of the group, "8+" (every depth >= 8),
# "largest" (the largest depth where both sides were measured: the main job's depth-64 cell
# has no whole-model compile), or "largest 32+" (that, if it is 32 or more)
TARGETS = (
    (
        "cold T(100): aotdist <= 1.0x the best peer",
        "T(100) aotdist/best peer @depth{d}",
        "<=",
        1.0,
        "every",
    ),
    (
        "cold T(1000): aotdist <= 0.85x the best peer",
        "T(1000) aotdist/best peer @depth{d}",
        "<=",
        0.85,
        "every",
    ),
    (
        "aotdist overtakes accelerate within 300 steps",
        "crossover aotdist/accelerate @depth{d}",
        "<=",
        300,
        "every",
    ),
    ("T(10000): aotdist <= 1.0x full", "T(10000) aotdist/full @depth{d}", "<=", 1.0, "every"),
    (
        "T(10000): aotdist <= 1.0x the best peer",
        "T(10000) aotdist/best peer @depth{d}",
        "<=",
        1.0,
        "every",
    ),
    (
        "T(100000): aotdist <= 1.0x the best peer",
        "T(100000) aotdist/best peer @depth{d}",
        "<=",
        1.0,
        "every",
    ),
    (
        "short run (compile.expected_steps under 1,000: each region a frame of its own): "
        "T(100) <= 1.0x the best peer",
        "T(100) aotdist+frames/best peer @depth{d}",
        "<=",
        1.0,
        "every",
    ),
    (
        "long run (compile.expected_steps: the whole graph lowered): T(100000) <= 1.0x "
        "the best peer",
        "T(100000) aotdist+lowered/best peer @depth{d}",
        "<=",
        1.0,
        "every",
    ),
    (
        "long run: steady step with the whole graph lowered <= 1.0x full",
        "step aotdist+lowered/full @depth{d}",
        "<=",
        1.0,
        "every",
    ),
    (
        "warm restart T(100): aotdist (artifact cache) <= 0.4x the best peer's",
        "warm T(100) aotdist+cache/best peer @depth{d}",
        "<=",
        0.4,
        "every",
    ),
    ("steady step: aotdist <= 1.0x full", "step aotdist/full @depth{d}", "<=", 1.0, "every"),
    (
        "steady step: aotdist <= 0.8x accelerate",
        "step aotdist/accelerate @depth{d}",
        "<=",
        0.8,
        "every",
    ),
    (
        "cold compile: aotdist <= 1.0x accelerate",
        "compile aotdist/accelerate @depth{d}",
        "<=",
        1.0,
        "every",
    ),
    (
        "tracing per extra block (Dynamo + AOTAutograd): aotdist <= 10 ms",
        "tracing ms per extra block aotdist depth{d}/depth{lo}",
        "<=",
        10.0,
        "every",
    ),
    (
        "compile growth from the smallest depth: aotdist <= 1.1x",
        "compile growth aotdist depth{d}/depth{lo}",
        "<=",
        1.1,
        "every",
    ),
    ("saved for backward: aotdist <= full", "saved aotdist/full @depth{d}", "<=", 1.0, "every"),
    (
        "peak memory growth: aotdist <= 1.1x per-block compile",
        "memory aotdist/per_block @depth{d}",
        "<=",
        1.1,
        "every",
    ),
    (
        "peak memory: aotdist <= accelerate",
        "memory aotdist/accelerate @depth{d}",
        "<=",
        1.0,
        "every",
    ),
    (
        "graph-mode FSDP cold compile <= 1.2x hooks mode",
        "compile aotdist-graph/aotdist @depth{d}",
        "<=",
        1.2,
        "every",
    ),
    (
        "graph-mode FSDP steady step <= hooks mode",
        "step aotdist-graph/aotdist @depth{d}",
        "<=",
        1.0,
        "8+",
    ),
    (
        "warm start (cached artifacts) <= 0.05x cold",
        "first step warm/cold aotdist+cache @depth{d}",
        "<=",
        0.05,
        "largest",
    ),
    (
        "graph-mode FSDP warm start <= 0.05x cold",
        "first step warm/cold aotdist-graph+cache @depth{d}",
        "<=",
        0.05,
        "largest",
    ),
    (
        "2-rank cold start, rank 0 shares its compiles <= 0.7x independent compiles",
        "first step aotdist+cache/aotdist @depth{d}",
        "<=",
        0.7,
        "largest",
    ),
)
# What the accelerate strategy's notes say where it found no blocks (strategies.py writes
# it, evaluate_targets reads it): its cell is then a whole-model compile.
WHOLE_MODEL_NOTE = "compiles the whole model"

_OPS = {"<=": operator.le, "<": operator.lt}


def group_of(result: dict) -> str:
    """The comparison group of a run or cell: its model, and its ranks under FSDP2."""
    nproc = result.get("nproc", 1)
    return result["model"] + (f" fsdp2x{nproc}" if nproc > 1 else "")


def _groups(rows: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(group_of(r), []).append(r)
    return groups


def _spread(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def summarize_cells(runs: list[dict]) -> list[dict]:
    """One entry per cell: the median of every figure in :data:`FIGURES`, its spread.

    The cell's other fields (compile split, regions, graph counts) are those of its run
    with the median cold compile. ``spread[figure]`` is ``{"median", "min", "max", "n"}``
    and ``runs`` lists every run's figures with its repeat index.
    """
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault((group_of(r), r["depth"], r["strategy"]), []).append(r)
    out = []
    for rows in cells.values():
        by_compile = sorted(rows, key=lambda r: r["compile_s"])
        cell = dict(by_compile[(len(rows) - 1) // 2])
        cell.pop("repeat", None)
        cell["spread"] = {}
        for key in FIGURES:
            values = [r[key] for r in rows if r.get(key) is not None]
            if values:
                cell["spread"][key] = _spread(values)
                cell[key] = cell["spread"][key]["median"]
        cell["repeats"] = len(rows)
        cell["runs"] = [
            {"repeat": r.get("repeat", 0), **{k: r[k] for k in FIGURES if r.get(k) is not None}}
            for r in rows
        ]
        out.append(cell)
    return out


def _ratios_one_repeat(rows: list[dict]) -> dict[str, tuple[float, float, str | None]]:
    """``name -> (numerator, denominator)`` from the runs of one repeat."""
    found: dict[str, tuple[float, float, str | None]] = {}
    for group, members in _groups(rows).items():
        idx = {(r["strategy"], r["depth"]): r for r in members}
        depths = sorted({r["depth"] for r in members})
        strategies = sorted({r["strategy"] for r in members})

        def put(key: str, num: float | None, den: float | None, group=group, unit=None):
            """A ratio of two measurements; ``unit``: what the value is where it is not a
            quotient of like quantities (the report prints it instead of ``x``)."""
            if num is not None and den is not None and den > 0:
                found[f"{group}: {key}"] = (num, den, unit)

        for d in depths:
            a = idx.get(("aotdist", d))
            for peer in PEERS:
                p = idx.get((peer, d))
                if a and p:
                    put(f"compile aotdist/{peer} @depth{d}", a["compile_s"], p["compile_s"])
                    put(f"step aotdist/{peer} @depth{d}", a["steady_step_s"], p["steady_step_s"])
                    put(
                        f"saved aotdist/{peer} @depth{d}",
                        a.get("saved_activation_bytes"),
                        p.get("saved_activation_bytes"),
                    )
                    put(
                        f"memory aotdist/{peer} @depth{d}",
                        a.get("peak_mem_mib"),
                        p.get("peak_mem_mib"),
                    )
            g = idx.get(("aotdist-graph", d))
            if a and g:  # graph-mode FSDP against hooks mode (several ranks)
                put(f"compile aotdist-graph/aotdist @depth{d}", g["compile_s"], a["compile_s"])
                put(f"step aotdist-graph/aotdist @depth{d}", g["steady_step_s"], a["steady_step_s"])
            for mode in ("aotdist", "aotdist-graph"):  # region bodies only vs lowered whole
                fx, low = idx.get((mode, d)), idx.get((f"{mode}+lowered", d))
                if fx and low:
                    for what, key in (
                        ("compile", "compile_s"),
                        ("step", "steady_step_s"),
                        ("memory", "peak_mem_mib"),
                    ):
                        put(f"{what} {mode}/{mode}+lowered @depth{d}", fx.get(key), low.get(key))
            for name in ("aotdist+cache", "aotdist-graph+cache"):
                w = idx.get((name, d))
                if w and w.get("warm_first_step_s") is not None:
                    put(
                        f"first step warm/cold {name} @depth{d}",
                        w["warm_first_step_s"],
                        fresh_start_s(w),
                    )
            c = idx.get(("aotdist+cache", d))
            if c and a and c["nproc"] > 1:  # sharing between ranks: cold vs independent
                # (compiles only: each rank runs its own ISA probes in both)
                put(
                    f"first step aotdist+cache/aotdist @depth{d}",
                    c["first_step_s"],
                    a["first_step_s"],
                )
            e = idx.get(("eager", d))
            for s in strategies:
                r = idx.get((s, d))
                if r and e and s != "eager":
                    put(f"memory {s}/eager @depth{d}", r["peak_mem_mib"], e["peak_mem_mib"])
        for s in strategies:  # growth from the strategy's smallest depth to each other
            mine = [d for d in depths if (s, d) in idx]
            for hi in mine[1:]:
                if s != "eager":
                    lo, top = idx[(s, mine[0])], idx[(s, hi)]
                    put(
                        f"compile growth {s} depth{hi}/depth{mine[0]}",
                        top["compile_s"],
                        lo["compile_s"],
                    )
                    # what one more block adds to the tracing phases: ms over blocks
                    t_lo, t_hi = _tracing_s(lo), _tracing_s(top)
                    if t_lo is not None and t_hi is not None:
                        put(
                            f"tracing ms per extra block {s} depth{hi}/depth{mine[0]}",
                            1000 * (t_hi - t_lo),
                            hi - mine[0],
                            unit="ms",
                        )
    return found


def _tracing_s(result: dict) -> float | None:
    """Dynamo + AOTAutograd seconds of a run's cold compile (torch's CompilationMetrics,
    every frame summed), or None where the run has no phase split."""
    split = result.get("compile_split_s") or {}
    if split.get("dynamo") is None or split.get("aot_autograd") is None:
        return None
    return split["dynamo"] + split["aot_autograd"]


def _paired_step_ratios(paired: list[dict]) -> dict:
    """``step aotdist/<peer>`` ratios from runs of :func:`~aotdist.bench.runner.
    measure_paired`: one per interleaved round, the two medians of that round."""
    ratios = {}
    for p in paired:
        medians = p["slice_step_s"]
        # aotdist as it compiles by default, with the whole graph lowered (a long run) and
        # with each region a frame of its own (a short run)
        for subject in ("aotdist", "aotdist+lowered", "aotdist+frames"):
            for peer in PEERS:
                if not medians.get(subject) or not medians.get(peer):
                    continue
                rows = [
                    {"round": k, "numerator": a, "denominator": b, "value": a / b}
                    for k, (a, b) in enumerate(zip(medians[subject], medians[peer], strict=True))
                    if b > 0
                ]
                if rows:
                    name = f"{group_of(p)}: step {subject}/{peer} @depth{p['depth']}"
                    ratios[name] = {**_summary(rows), "per_round": rows, "source": "paired"}
    return ratios


def _summary(rows: list[dict]) -> dict:
    """Median and spread of per-repeat (or per-round) ratios, and the medians of their
    numerators and denominators."""
    values = [r["value"] for r in rows]
    return {
        "value": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "repeats": len(rows),
        "numerator": statistics.median(r["numerator"] for r in rows),
        "denominator": statistics.median(r["denominator"] for r in rows),
    }


def compute_ratios(runs: list[dict], paired: list[dict] | None = None) -> dict:
    """Every ratio the report shows, computed per repeat from runs that ran side by side.

    Names are ``"<group>: <ratio>"``, e.g. ``"gpt: compile aotdist/full @depth32"``.
    Each entry: ``value`` (median of the per-repeat ratios), ``min`` and ``max`` (their
    spread), ``numerator`` / ``denominator`` (medians of the measured values), and
    ``per_repeat`` (every repeat's numerator, denominator and quotient), so a reader
    (and the tests) can check each ratio was computed from measurements. Runs without a
    ``repeat`` key count as repeat 0.

    With ``paired`` runs (strategies side by side in one process), the steady-step
    ratios of aotdist over its peers come from their interleaved rounds instead
    (``per_round``, ``source: "paired"``; ``repeats`` counts rounds).
    """
    by_repeat: dict[int, list[dict]] = {}
    for r in runs:
        by_repeat.setdefault(r.get("repeat", 0), []).append(r)
    per_name: dict[str, list[dict]] = {}
    units: dict[str, str] = {}
    for rep in sorted(by_repeat):
        for name, (num, den, unit) in _ratios_one_repeat(by_repeat[rep]).items():
            per_name.setdefault(name, []).append(
                {"repeat": rep, "numerator": num, "denominator": den, "value": num / den}
            )
            if unit:
                units[name] = unit
    ratios = {name: {**_summary(rows), "per_repeat": rows} for name, rows in per_name.items()}
    for name, unit in units.items():
        ratios[name]["unit"] = unit
    ratios.update(_paired_step_ratios(paired or []))
    return ratios


def verdict(ratio: dict, op: str, bound: float) -> str:
    """``"met"`` when every repeat's ratio meets ``op bound``, ``"missed"`` when none
    does, ``"noisy"`` when the spread (min-max) straddles the bound. ``None`` stands for
    infinity (a crossover that never comes)."""
    meets = _OPS[op]
    lo, hi = (math.inf if ratio[k] is None else ratio[k] for k in ("min", "max"))
    if meets(hi, bound):
        return "met"
    if not meets(lo, bound):
        return "missed"
    return "noisy"


def evaluate_targets(results: list[dict], ratios: dict) -> list[dict]:
    """The targets, each checked at every depth, every depth from 8, or the largest depth
    of its group where both sides were measured (see :data:`TARGETS`). ``ratios`` may hold
    step counts too (``unit: "steps"``: the crossovers of :mod:`aotdist.bench.timeto`)."""
    rows = []
    for group, members in _groups(results).items():
        depths = sorted({r["depth"] for r in members})
        # Where Accelerate found no blocks it compiled the whole model: its step is full's.
        whole = any(
            r["strategy"] == "accelerate" and WHOLE_MODEL_NOTE in (r.get("notes") or "")
            for r in members
        )
        lo = min((r["depth"] for r in members if r["strategy"] == "aotdist"), default=depths[0])
        for text, pattern, op, bound, where in TARGETS:
            if whole and pattern.startswith("step aotdist/accelerate"):
                text, bound = (
                    ("steady step: aotdist <= 1.0x accelerate (a whole-model compile here)"),
                    1.0,
                )
            least = int(where.split()[-1][:-1]) if where.endswith("+") else 0
            keys = [(d, f"{group}: {pattern.format(d=d, lo=lo)}") for d in depths if d >= least]
            keys = [(d, k) for d, k in keys if k in ratios]
            for d, key in keys[-1:] if where.startswith("largest") else keys:
                r = ratios[key]
                v = verdict(r, op, bound)
                rows.append(
                    {
                        "group": group,
                        "depth": d,
                        "target": text,
                        "ratio": key,
                        "value": r["value"],
                        "min": r["min"],
                        "max": r["max"],
                        "unit": r.get("unit", "x"),
                        "bound": bound,
                        "op": op,
                        "verdict": v,
                        "met": {"met": True, "missed": False}.get(v),
                    }
                )
    return rows
