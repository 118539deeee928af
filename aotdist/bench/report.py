"""Benchmark report: ratios from measured values, a markdown table, a plot."""

from __future__ import annotations

import json
import platform
from pathlib import Path

__all__ = ["compute_ratios", "machine_description", "write_report"]


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


def _index(results: list[dict]) -> dict[tuple[str, int], dict]:
    return {(r["strategy"], r["depth"]): r for r in results}


def compute_ratios(results: list[dict]) -> dict:
    """Every ratio the report shows, each a quotient of two measured values.

    Each entry records its numerator and denominator so a reader (and the tests) can
    check it was computed from measurements, not typed in.
    """
    idx = _index(results)
    depths = sorted({r["depth"] for r in results})
    strategies = sorted({r["strategy"] for r in results})
    ratios: dict[str, dict] = {}

    def put(key: str, num: float | None, den: float | None):
        if num is None or den is None or den <= 0:
            return
        ratios[key] = {"value": num / den, "numerator": num, "denominator": den}

    for d in depths:
        a = idx.get(("aotdist", d))
        for peer in ("full", "accelerate"):
            p = idx.get((peer, d))
            if a and p:
                put(f"compile aotdist/{peer} @depth{d}", a["compile_s"], p["compile_s"])
                put(f"step aotdist/{peer} @depth{d}", a["steady_step_s"], p["steady_step_s"])
        e = idx.get(("eager", d))
        for s in strategies:
            r = idx.get((s, d))
            if r and e and s != "eager":
                put(f"memory {s}/eager @depth{d}", r["peak_mem_mib"], e["peak_mem_mib"])
    if len(depths) >= 2:
        lo, hi = depths[0], depths[-1]
        for s in strategies:
            if s == "eager":
                continue
            a, b = idx.get((s, hi)), idx.get((s, lo))
            if a and b:
                put(f"compile growth {s} depth{hi}/depth{lo}", a["compile_s"], b["compile_s"])
    return ratios


def _markdown(results: list[dict], ratios: dict, machine: str) -> str:
    lines = [f"Machine: {machine}", "",
             "| strategy | depth | cold compile (s) | steady step (ms) | peak mem (MiB) | "
             "frames compiled | graph breaks | recompiles after step 1 | subgraphs/region |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["depth"], r["strategy"])):
        sub = ", ".join(f"{n}: {s['subgraphs']} for {s['call_sites']} sites"
                        for n, s in r.get("regions", {}).items()) or "-"
        lines.append(
            f"| {r['strategy']} | {r['depth']} | {r['compile_s']:.2f} | "
            f"{r['steady_step_s'] * 1e3:.1f} | {r['peak_mem_mib']:.0f} | {r['frames_compiled']} | "
            f"{r['graph_breaks']} | {r['recompiles_after_first_step']} | {sub} |")
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {v['value']:.2f}x |" for k, v in ratios.items()]
    return "\n".join(lines) + "\n"


def _plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for s in sorted({r["strategy"] for r in results}):
        rows = sorted((r for r in results if r["strategy"] == s), key=lambda r: r["depth"])
        depths = [r["depth"] for r in rows]
        if s != "eager":
            ax1.plot(depths, [r["compile_s"] for r in rows], marker="o", label=s)
        ax2.plot(depths, [r["steady_step_s"] * 1e3 for r in rows], marker="o", label=s)
    ax1.set(xlabel="depth (blocks)", ylabel="cold compile (s)", title="Compile time vs depth")
    ax2.set(xlabel="depth (blocks)", ylabel="steady step (ms)", title="Step time")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_report(results: list[dict], out: Path) -> dict:
    """Writes ``bench.json``, ``bench.md`` and ``bench.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_description()
    ratios = compute_ratios(results)
    report = {"machine": machine, "results": results, "ratios": ratios}
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    md = _markdown(results, ratios, machine)
    (out / "bench.md").write_text(md)
    report["plot"] = _plot(results, out / "bench.png")
    print(md)
    return report
