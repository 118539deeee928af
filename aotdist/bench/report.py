"""Benchmark report: cells with median and spread, ratios per repeat with verdicts,
the machine's lines (:mod:`aotdist.bench.machine`), a markdown table and a plot.

Runs are grouped by (model, ranks): a group's strategies and depths are compared with
each other only. The arithmetic (medians, per-repeat ratios, met / missed / noisy) is in
:mod:`aotdist.bench.stats`; this module writes it out.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from aotdist.bench.machine import (
    installed_setuptools,
    load_line,
    machine_description,
    setuptools_line,
)
from aotdist.bench.stats import (
    compute_ratios,
    evaluate_targets,
    group_of,
    summarize_cells,
)
from aotdist.bench.timeto import time_to_steps


def _groups(rows: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(group_of(r), []).append(r)
    return groups


def _fmt_regions(r: dict) -> str:
    return (
        ", ".join(
            f"{n}: {s['subgraphs']} for {s['call_sites']} sites"
            for n, s in r.get("regions", {}).items()
        )
        or "-"
    )


def _fig(cell: dict, key: str, scale: float = 1.0, fmt: str = ".2f") -> str:
    """``median [min-max]`` of a cell's figure (the median alone for one run)."""
    sp = cell.get("spread", {}).get(key)
    if sp is None:
        value = cell.get(key)
        return "-" if value is None else f"{value * scale:{fmt}}"
    text = f"{sp['median'] * scale:{fmt}}"
    if sp["n"] > 1:
        text += f" [{sp['min'] * scale:{fmt}}-{sp['max'] * scale:{fmt}}]"
    return text


def _isa_line(results: list[dict]) -> str:
    """How the cold step leaves out Inductor's CPU ISA probes, with their time here."""
    values = [r["isa_probe_s"] for r in results if r.get("isa_probe_s")]
    if not values:
        return ""
    return (
        "Inductor's CPU ISA probes, a one-time cost of an Inductor cache dir, are built "
        "once per bench and copied into each run's empty cache dir (the +cache cells "
        "excepted: their runs measure a fresh start); every run runs and times them "
        f"before the cold step ({min(values):.2f}-{max(values):.2f} s per run here), so "
        "cold compile leaves them out, and the warm/cold first-step ratio (a fresh start) "
        "adds them back on both sides. "
    )


def _mesh_text(settings: dict) -> str:
    mesh = settings.get("mesh")
    return f", HSDP mesh {mesh[0]}x{mesh[1]} (replicate x shard)" if mesh else ""


def _mode_text(settings: dict) -> str:
    mode = settings.get("compile_mode")
    return f", torch.compile mode {mode} in every compiling strategy" if mode else ""


def _markdown(report: dict) -> str:
    results, settings = report["results"], report["settings"]
    memory_metric = next((r["memory_metric"] for r in results if r.get("memory_metric")), "")
    lines = [
        f"Machine: {report['machine']}",
        "",
        load_line(settings, report.get("runs")),
        "",
        *([line, ""] if (line := setuptools_line(settings)) else []),
        f"Settings: backend {settings['backend']}{_mode_text(settings)}, "
        f"device {settings['device']}, "
        f"float8 {settings['float8']}{_mesh_text(settings)}, cold step + "
        f"{settings['warmup']} warm-up + {settings['steps']} timed steps (median), {settings['repeats']} repeat(s) per "
        f"cell, run round robin (every cell once per repeat), each run a fresh process "
        f"with an empty compiler cache; run took {settings['duration_s'] / 60:.1f} min."
        + (" PROFILED: timings inflated." if settings.get("profiled") else ""),
        "",
        *_time_to_steps_lines(report),
        "### Diagnostics: compile, step, memory",
        "",
        "Figures: median [min-max] over the repeats. Cold compile = first step wall time "
        f"- median steady step. {_isa_line(results)}Peak memory: {memory_metric}. Saved for backward: bytes "
        "of the unique storages the training step's forward saves for backward "
        "(saved-tensor hooks), parameters and buffers excluded: the activation memory a "
        "GPU would hold.",
        "",
    ]
    for group, rows in _groups(results).items():
        lines += [
            f"### {group}",
            "",
            "| strategy | depth | cold compile (s) | steady step (ms) | saved for "
            "backward (KiB) | peak mem (MiB) | frames compiled | graph breaks | "
            "recompiles after step 1 | subgraphs/region |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(rows, key=lambda r: (r["depth"], r["strategy"])):
            lines.append(
                f"| {r['strategy']} | {r['depth']} | {_fig(r, 'compile_s')} | "
                f"{_fig(r, 'steady_step_s', 1e3)} | "
                f"{_fig(r, 'saved_activation_bytes', 1 / 1024, '.0f')} | "
                f"{_fig(r, 'peak_mem_mib', 1, '.0f')} | {r['frames_compiled']} | "
                f"{r['graph_breaks']} | {r['recompiles_after_first_step']} | "
                f"{_fmt_regions(r)} |"
            )
        lines.append("")
    lines += _warm_lines(results)
    lines += [
        "### Where cold compile time goes (s, the run with the median cold compile)",
        "",
        "| group | strategy | depth | dynamo | aot_autograd | inductor | "
        "of which codegen | of which kernel compile wait | C++ compiles | "
        "outside compiler |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (group_of(r), r["depth"], r["strategy"])):
        if r["strategy"] == "eager":
            continue
        c = r["compile_split_s"]
        lines.append(
            f"| {group_of(r)} | {r['strategy']} | {r['depth']} | {c['dynamo']:.2f} | "
            f"{c['aot_autograd']:.2f} | {c['inductor']:.2f} | {c['inductor_codegen']:.2f} | "
            f"{c['inductor_kernel_load_wait']:.2f} | {c['cpp_compiles']} | "
            f"{c['outside_compiler']:.2f} |"
        )
    lines += _paired_lines(report.get("paired") or [], settings.get("paired_failures") or [])
    lines += [
        "",
        "Ratios: computed per repeat from the two runs of that repeat (they ran side "
        "by side); value = median of the per-repeat ratios [min-max]. Ratios marked "
        "(paired) are per round of the paired runs above instead; their repeats column "
        "counts rounds. The T(N) ratios are in the first table (all of them in "
        "bench.json).",
        "",
        "| ratio | value [min-max] | repeats | median numerator / denominator |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {k}{' (paired)' if v.get('source') == 'paired' else ''} | {_value(v)} | "
        f"{v['repeats']} | "
        f"{v['numerator']:.4g} / {v['denominator']:.4g} |"
        for k, v in report["ratios"].items()
        if v.get("source") != "time to steps"
    ]
    lines += [
        "",
        "Targets: met = every repeat meets the bound, missed = none does, "
        "noisy = the spread straddles it (this run cannot tell).",
        "",
        "| group | target | depth | value [min-max] | verdict |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {t['group']} | {t['target']} | {t['depth']} | {_value(t)} | "
        f"{'**missed**' if t['verdict'] == 'missed' else t['verdict']} |"
        for t in report["targets"]
    ]
    notes = sorted(
        {f"{r['strategy']} on {group_of(r)}: {r['notes']}" for r in results if r.get("notes")}
    )
    notes += [f"skipped: {s}" for s in settings.get("skipped") or []]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _value(r: dict) -> str:
    """``median [min-max]`` of a ratio (``0.95x [0.90-1.10]``), of milliseconds
    (``65 ms [63 to 67]``: signed, a strategy's tracing may shrink with depth) or of a
    step count (``849 [700-never] steps``; ``None`` is never)."""
    if r.get("unit") == "ms":  # round() gives ints: no "-0"
        return f"{round(r['value'])} ms [{round(r['min'])} to {round(r['max'])}]"
    if r.get("unit") != "steps":
        return f"{r['value']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]"

    def n(v):
        return "never" if v is None else f"{v:.0f}"

    return f"{n(r['value'])} [{n(r['min'])}-{n(r['max'])}] steps"


def _seconds(sp: dict | None) -> str:
    if not sp:
        return "-"
    return f"{sp['median']:.1f}" + (f" [{sp['min']:.1f}-{sp['max']:.1f}]" if sp["n"] > 1 else "")


def _time_to_steps_lines(report: dict) -> list[str]:
    """The lead table: T(N) per strategy, aotdist's ratio to the best peer, crossovers."""
    tts = report.get("time_to_steps") or {}
    if not tts.get("cells"):
        return []
    ns, w = [str(n) for n in tts["horizons"]], str(tts["warm_horizon"])
    ratios, crossings = report["ratios"], tts["crossovers"]
    lines = [
        "### Time to the first N steps",
        "",
        "T(N) = cold compile + N x steady step (paired where a paired run timed the "
        "strategy), in seconds, median [min-max] over the repeats; each ratio is "
        "computed within a repeat against the best peer of that repeat (full, "
        "accelerate, per_block: whichever measured). Warm T(N) = a restart's set-up "
        "and first step on the compiler caches the cold run left (the strategy's "
        "apply included) + N x the same step. Crossover: the step count from which "
        "aotdist stays ahead of the peer (never: its step is slower).",
        "",
    ]
    for group in dict.fromkeys(c["group"] for c in tts["cells"]):
        cells = [c for c in tts["cells"] if c["group"] == group]
        warm = any(c.get("warm_T") for c in cells)
        lines += [
            f"#### {group}",
            "",
            "| depth | strategy | "
            + " | ".join(f"T({int(n):,})" for n in ns)
            + (f" | warm T({w})" if warm else "")
            + " |",
            "|---|---|" + "---|" * (len(ns) + warm),
        ]
        for c in sorted(cells, key=lambda c: (c["depth"], c["strategy"])):
            lines.append(
                f"| {c['depth']} | {c['strategy']} | "
                + " | ".join(_seconds(c["T"].get(n)) for n in ns)
                + (f" | {_seconds((c.get('warm_T') or {}).get(w))}" if warm else "")
                + " |"
            )
            key = f"{group}: T({{}}) {c['strategy']}/best peer @depth{c['depth']}"
            if key.format(ns[0]) in ratios or ratios.get(
                f"{group}: warm T({w}) {c['strategy']}/best peer @depth{c['depth']}"
            ):
                cols = [_best(ratios.get(key.format(n))) for n in ns]
                if warm:
                    cols.append(
                        _best(
                            ratios.get(
                                f"{group}: warm T({w}) {c['strategy']}/best peer @depth{c['depth']}"
                            )
                        )
                    )
                lines.append(
                    f"| {c['depth']} | **{c['strategy']} / best peer** | " + " | ".join(cols) + " |"
                )
        rows = sorted(
            (k.split(" @depth")[1], k.split(": crossover ")[1].split(" @")[0], v)
            for k, v in crossings.items()
            if k.startswith(f"{group}: crossover ")
        )
        if rows:
            lines += ["", "| depth | stays ahead of the peer from step |", "|---|---|"]
            lines += [
                f"| {d} | {pair}: {_value(v)} |"
                for d, pair, v in sorted(rows, key=lambda r: (int(r[0]), r[1]))
            ]
        lines.append("")
    return lines


def _best(r: dict | None) -> str:
    if not r:
        return "-"
    return _value(r) + (f" ({r['best_peer']})" if r.get("best_peer") else "")


def _warm_lines(results: list[dict]) -> list[str]:
    """Which path each +cache cell's warm start took, and what the cold run's save cost."""
    out = []
    for r in sorted(results, key=lambda r: (group_of(r), r["depth"])):
        if r.get("warm_first_step_s") is None:
            continue
        saved = (
            "the saved graphs of its region frames (FSDP2 hooks mode)"
            if r.get("mode") == "frames"
            else "the saved whole-model graph"
        )
        if r["strategy"] != "aotdist+cache":
            saved += f" ({r['strategy']})"
        path = (
            f"{saved}, untraced"
            if r.get("warm_precompiled")
            else f"traced again ({r.get('warm_precompile_reason') or 'no saved graph'})"
        )
        out.append(
            f"- {group_of(r)}, depth {r['depth']}: warm start (bundle load and first "
            f"step) {_fig(r, 'warm_first_step_s')} s via {path}; the cold run's save "
            f"took {r.get('cache_save_s') or 0.0:.2f} s"
        )
    return ["Warm starts (+cache cells):", "", *out, ""] if out else []


def _paired_lines(paired: list[dict], failures: list[str]) -> list[str]:
    if failures:
        return [
            "",
            "Paired runs that failed (the steady-step ratios at their depths are "
            "across processes): " + "; ".join(failures),
        ] + _paired_lines(paired, [])
    if not paired:
        return []
    lines = [
        "",
        "### Steady step side by side (paired runs)",
        "",
        "One process per depth builds every strategy (same weights and batch), loading "
        "the artifacts the first repeat compiled where it can (its compiles are not "
        "measured), then times them in interleaved rounds (each round: the timed steps "
        "of every strategy, the order rotating). The steady-step targets use the "
        "per-round ratios of these runs; the cells' own steady steps above come from "
        "processes minutes apart.",
        "",
        "| group | depth | rounds x steps | steady step (ms), median [min-max] of round "
        "medians | cache hits: FX graph / AOTAutograd |",
        "|---|---|---|---|---|",
    ]
    for p in paired:
        figs = ", ".join(
            f"{name} {statistics.median(v) * 1e3:.2f} [{min(v) * 1e3:.2f}-{max(v) * 1e3:.2f}]"
            for name, v in p["slice_step_s"].items()
            if v
        )
        hits = p.get("cache_hits") or {}
        lines.append(
            f"| {group_of(p)} | {p['depth']} | {p['slices']} x "
            f"{p['steps_per_slice']} | {figs} | {hits.get('fx_graph', '-')} / "
            f"{hits.get('aot_autograd', '-')} |"
        )
    return lines


def _crossings(tts: dict, group: str, depth: int) -> list[tuple[str, str, float | None]]:
    """``(subject, peer, steps)`` of one panel's crossovers (``None``: never)."""
    out = []
    for key, v in tts.get("crossovers", {}).items():
        if key.startswith(f"{group}: crossover ") and key.endswith(f" @depth{depth}"):
            subject, peer = key.split(": crossover ")[1].split(" @")[0].split("/")
            out.append((subject, peer, v["value"]))
    return out


def _plot(report: dict, path: Path) -> bool:
    """What the report leads with: time to step N against N for each strategy, one panel
    per model and depth (log-log, medians of the cold compile and the paired steady step),
    the step where aotdist overtakes each peer marked; ``False`` without matplotlib or
    anything compiled."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    tts = report.get("time_to_steps") or {}
    cells = tts.get("cells") or []
    panels = list(dict.fromkeys((c["group"], c["depth"]) for c in cells))
    if not panels:
        return False
    strategies = sorted({c["strategy"] for c in cells})
    colors = {s: f"C{i}" for i, s in enumerate(strategies)}
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.2 * nrows), squeeze=False)
    n = [10 ** (k / 20) for k in range(0, 101)]  # 1 to 100,000 steps
    for ax, (group, depth) in zip(axes.flat, panels, strict=False):  # spare axes hidden
        here = {c["strategy"]: c for c in cells if (c["group"], c["depth"]) == (group, depth)}
        for s, c in sorted(here.items()):
            cold, step = c["cold_s"]["median"], c["step_s"]["median"]
            ax.plot(
                n,
                [cold + k * step for k in n],
                color=colors[s],
                linewidth=2.2 if s.startswith("aotdist") else 1.2,
                label=s,
            )
        notes = []
        for subject, peer, steps in _crossings(tts, group, depth):
            if subject not in here:
                continue
            if steps is None:
                notes.append(f"{subject} never overtakes {peer}")
            elif steps == 0:
                notes.append(f"{subject} ahead of {peer} from step 0")
            else:
                c = here[subject]
                y = c["cold_s"]["median"] + steps * c["step_s"]["median"]
                ax.plot([steps], [y], "o", color=colors[peer], markersize=7, fillstyle="none")
                notes.append(f"{subject} overtakes {peer} at step {steps:,.0f} (o)")
        for h in tts.get("horizons", ()):
            ax.axvline(h, color="0.85", linewidth=0.8, zorder=0)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="training steps N",
            ylabel="time to step N (s)",
            title=f"{group}, depth {depth}",
        )
        if notes:
            ax.text(0.02, 0.98, "\n".join(notes), transform=ax.transAxes, fontsize=6.5, va="top")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(
        "Time to step N = cold compile + N x steady step (medians over the repeats)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_report(
    runs: list[dict], out: Path, *, settings: dict | None = None, paired: list[dict] | None = None
) -> dict:
    """Writes ``bench.json``, ``bench.md`` and ``bench.png`` under ``out``; prints the md.

    Args:
        runs: Every measurement, each tagged with its ``repeat`` (0 when missing).
        out: Output directory (created).
        settings: How the runs were made (backend, steps, repeats, load snapshots...).
        paired: Runs of strategies side by side in one process (steady steps only); the
            steady-step ratios come from them where present.

    Returns:
        The report: ``results`` (one entry per cell, medians and spreads), ``runs``,
        ``ratios`` (the T(N) ones too), ``time_to_steps`` (:func:`aotdist.bench.timeto.
        time_to_steps`), ``targets``, ``settings``, ``machine`` and ``plot``.
    """
    out.mkdir(parents=True, exist_ok=True)
    results = summarize_cells(runs)
    tts = time_to_steps(runs, paired)
    ratios = {**tts["ratios"], **compute_ratios(runs, paired)}
    report = {
        "machine": machine_description(),
        "settings": dict(settings or {}),
        "results": results,
        "runs": runs,
        "paired": list(paired or []),
        "ratios": ratios,
        "time_to_steps": tts,
        "targets": evaluate_targets(results, {**ratios, **tts["crossovers"]}),
    }
    report["settings"].setdefault("duration_s", 0.0)
    report["settings"].setdefault("setuptools", installed_setuptools())
    for key, default in (
        ("backend", "?"),
        ("device", "?"),
        ("float8", False),
        ("warmup", 0),
        ("steps", 0),
        ("repeats", 1),
    ):
        report["settings"].setdefault(key, default)
    report["plot"] = _plot(report, out / "bench.png")
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    md = _markdown(report)
    (out / "bench.md").write_text(md)
    print(md)
    return report
