"""Benchmark report: ratios from measured values, targets, a markdown table, a plot.

Results are grouped by (model, ranks): a group's strategies and depths are compared
with each other only. Every ratio records its numerator and denominator, both measured
values of the same run.
"""

from __future__ import annotations

import json
import operator
import platform
from pathlib import Path

__all__ = ["TARGETS", "compute_ratios", "evaluate_targets", "group_of", "machine_description",
           "write_report"]

# (what the issue asks, ratio name with {d} for the group's largest depth, comparison, bound)
TARGETS = (
    ("cold compile: aotdist <= 0.4x full", "compile aotdist/full @depth{d}", "<=", 0.4),
    ("cold compile: aotdist <= 1.1x accelerate", "compile aotdist/accelerate @depth{d}", "<=", 1.1),
    ("compile growth smallest -> largest depth: aotdist <= 1.2x", "compile growth aotdist", "<=",
     1.2),
    ("steady step: aotdist <= 1.0x full", "step aotdist/full @depth{d}", "<=", 1.0),
    ("steady step: aotdist < accelerate", "step aotdist/accelerate @depth{d}", "<", 1.0),
    ("peak memory: aotdist <= eager", "memory aotdist/eager @depth{d}", "<=", 1.0),
    ("warm start (cached artifacts) <= 0.2x cold", "first step warm/cold aotdist+cache @depth{d}",
     "<=", 0.2),
    ("2-rank cold start, rank 0 shares its compiles <= 0.7x independent compiles",
     "first step aotdist+cache/aotdist @depth{d}", "<=", 0.7),
)
_OPS = {"<=": operator.le, "<": operator.lt}


def machine_description() -> str:
    """CPU model and core count (and GPU name when CUDA is present)."""
    import os

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    desc = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"
    if torch.cuda.is_available():
        desc += f", {torch.cuda.get_device_name()}"
    return desc


def group_of(result: dict) -> str:
    """The comparison group of a result: its model, and its ranks under FSDP2."""
    nproc = result.get("nproc", 1)
    return result["model"] + (f" fsdp2x{nproc}" if nproc > 1 else "")


def _groups(results: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(group_of(r), []).append(r)
    return groups


def compute_ratios(results: list[dict]) -> dict:
    """Every ratio the report shows, each a quotient of two measured values.

    Names are ``"<group>: <ratio>"``, e.g. ``"gpt: compile aotdist/full @depth32"``.
    Each entry records its numerator and denominator so a reader (and the tests) can
    check it was computed from measurements, not typed in.
    """
    ratios: dict[str, dict] = {}
    for group, rows in _groups(results).items():
        idx = {(r["strategy"], r["depth"]): r for r in rows}
        depths = sorted({r["depth"] for r in rows})
        strategies = sorted({r["strategy"] for r in rows})

        def put(key: str, num: float | None, den: float | None, group=group):
            if num is None or den is None or den <= 0:
                return
            ratios[f"{group}: {key}"] = {"value": num / den, "numerator": num,
                                         "denominator": den}

        for d in depths:
            a = idx.get(("aotdist", d))
            for peer in ("full", "accelerate"):
                p = idx.get((peer, d))
                if a and p:
                    put(f"compile aotdist/{peer} @depth{d}", a["compile_s"], p["compile_s"])
                    put(f"step aotdist/{peer} @depth{d}", a["steady_step_s"], p["steady_step_s"])
            c = idx.get(("aotdist+cache", d))
            if c and c.get("warm_first_step_s") is not None:
                put(f"first step warm/cold aotdist+cache @depth{d}", c["warm_first_step_s"],
                    c["first_step_s"])
            if c and a and c["nproc"] > 1:  # sharing between ranks: cold vs independent
                put(f"first step aotdist+cache/aotdist @depth{d}", c["first_step_s"],
                    a["first_step_s"])
            e = idx.get(("eager", d))
            for s in strategies:
                r = idx.get((s, d))
                if r and e and s != "eager":
                    put(f"memory {s}/eager @depth{d}", r["peak_mem_mib"], e["peak_mem_mib"])
        if len(depths) >= 2:
            lo, hi = depths[0], depths[-1]
            for s in strategies:
                a, b = idx.get((s, hi)), idx.get((s, lo))
                if s != "eager" and a and b:
                    put(f"compile growth {s} depth{hi}/depth{lo}", a["compile_s"], b["compile_s"])
    return ratios


def evaluate_targets(results: list[dict], ratios: dict) -> list[dict]:
    """The issue's targets, each checked at its group's largest depth where measured."""
    rows = []
    for group, members in _groups(results).items():
        depths = sorted({r["depth"] for r in members})
        for text, pattern, op, bound in TARGETS:
            name = pattern.format(d=depths[-1])
            if name == "compile growth aotdist":
                name = f"compile growth aotdist depth{depths[-1]}/depth{depths[0]}"
            key = f"{group}: {name}"
            if key not in ratios:
                continue
            value = ratios[key]["value"]
            rows.append({"group": group, "target": text, "ratio": key, "value": value,
                         "bound": bound, "op": op, "met": bool(_OPS[op](value, bound))})
    return rows


def _fmt_regions(r: dict) -> str:
    return ", ".join(f"{n}: {s['subgraphs']} for {s['call_sites']} sites"
                     for n, s in r.get("regions", {}).items()) or "-"


def _markdown(report: dict) -> str:
    results, settings = report["results"], report["settings"]
    memory_metric = next((r["memory_metric"] for r in results), "")
    lines = [f"Machine: {report['machine']}", "",
             f"Settings: backend {settings['backend']}, device {settings['device']}, "
             f"float8 {settings['float8']}, cold step + {settings['warmup']} warm-up + "
             f"{settings['steps']} timed steps (median), {settings['repeats']} fresh process(es) "
             f"per cell, each with an empty compiler cache; run took "
             f"{settings['duration_s'] / 60:.1f} min."
             + (" PROFILED: timings inflated." if settings.get("profiled") else ""), "",
             f"Cold compile = first step wall time - median steady step. Peak memory: "
             f"{memory_metric}.", ""]
    for group, rows in _groups(results).items():
        lines += [f"### {group}", "",
                  "| strategy | depth | cold compile (s) | steady step (ms) | peak mem (MiB) | "
                  "frames compiled | graph breaks | recompiles after step 1 | "
                  "subgraphs/region |", "|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (r["depth"], r["strategy"])):
            lines.append(
                f"| {r['strategy']} | {r['depth']} | {r['compile_s']:.2f} | "
                f"{r['steady_step_s'] * 1e3:.2f} | {r['peak_mem_mib']:.0f} | "
                f"{r['frames_compiled']} | {r['graph_breaks']} | "
                f"{r['recompiles_after_first_step']} | {_fmt_regions(r)} |")
        lines.append("")
    lines += ["### Where cold compile time goes (s)", "",
              "| group | strategy | depth | dynamo | aot_autograd | inductor | "
              "of which codegen | of which kernel compile wait | C++ compiles | "
              "outside compiler |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (group_of(r), r["depth"], r["strategy"])):
        if r["strategy"] == "eager":
            continue
        c = r["compile_split_s"]
        lines.append(
            f"| {group_of(r)} | {r['strategy']} | {r['depth']} | {c['dynamo']:.2f} | "
            f"{c['aot_autograd']:.2f} | {c['inductor']:.2f} | {c['inductor_codegen']:.2f} | "
            f"{c['inductor_kernel_load_wait']:.2f} | {c['cpp_compiles']} | "
            f"{c['outside_compiler']:.2f} |")
    lines += ["", "| ratio | value | numerator / denominator |", "|---|---|---|"]
    lines += [f"| {k} | {v['value']:.2f}x | {v['numerator']:.4g} / {v['denominator']:.4g} |"
              for k, v in report["ratios"].items()]
    lines += ["", "Targets (from issue 6; checked at each group's largest depth):", "",
              "| group | target | value | |", "|---|---|---|---|"]
    lines += [f"| {t['group']} | {t['target']} | {t['value']:.2f}x | "
              f"{'met' if t['met'] else '**missed**'} |" for t in report["targets"]]
    notes = sorted({f"{r['strategy']} on {group_of(r)}: {r['notes']}"
                    for r in results if r.get("notes")})
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    strategies = sorted({r["strategy"] for r in results})
    colors = {s: f"C{i}" for i, s in enumerate(strategies)}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for gi, (group, rows) in enumerate(_groups(results).items()):
        for s in strategies:
            pts = sorted((r for r in rows if r["strategy"] == s), key=lambda r: r["depth"])
            if s != "eager" and len(pts) >= 2:
                ax1.plot([r["depth"] for r in pts], [r["compile_s"] for r in pts], marker="o",
                         color=colors[s], linestyle=("-", "--", ":")[gi % 3],
                         label=f"{s} ({group})")
    ax1.set(xlabel="depth (blocks)", ylabel="cold compile (s)", title="Cold compile vs depth")
    ax1.set_xscale("log", base=2)
    cells = sorted({(group_of(r), r["depth"]) for r in results})
    width = 0.8 / max(len(strategies), 1)
    idx = {(group_of(r), r["depth"], r["strategy"]): r for r in results}
    for j, s in enumerate(strategies):
        xs = [i + j * width for i, c in enumerate(cells) if (*c, s) in idx]
        ys = [idx[(*c, s)]["steady_step_s"] * 1e3 for c in cells if (*c, s) in idx]
        ax2.bar(xs, ys, width=width, color=colors[s], label=s)
    ax2.set_xticks([i + width * (len(strategies) - 1) / 2 for i in range(len(cells))],
                   [f"{g}\ndepth {d}" for g, d in cells], fontsize=8)
    ax2.set(ylabel="steady step (ms, median)", title="Step time per strategy")
    ax2.set_yscale("log")
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_report(results: list[dict], out: Path, *, settings: dict | None = None) -> dict:
    """Writes ``bench.json``, ``bench.md`` and ``bench.png`` under ``out``; prints the md."""
    out.mkdir(parents=True, exist_ok=True)
    ratios = compute_ratios(results)
    report = {"machine": machine_description(), "settings": dict(settings or {}),
              "results": results, "ratios": ratios,
              "targets": evaluate_targets(results, ratios)}
    report["settings"].setdefault("duration_s", 0.0)
    for key, default in (("backend", "?"), ("device", "?"), ("float8", False), ("warmup", 0),
                         ("steps", 0), ("repeats", 1)):
        report["settings"].setdefault(key, default)
    report["plot"] = _plot(results, out / "bench.png")
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    md = _markdown(report)
    (out / "bench.md").write_text(md)
    print(md)
    return report
