"""What a bench run measured on: the machine (CPU, cores, torch, GPU), its load and the
other processes' share of it, and an environment's setuptools that slows every run. The
report (:mod:`aotdist.bench.report`) prints these lines above its tables."""

from __future__ import annotations

import os
import platform

from aotdist.bench.stats import group_of


def load_snapshot() -> dict:
    """The machine's load average (1, 5, 15 min) and CPU count, now."""
    try:
        load = list(os.getloadavg())
    except OSError:  # not available on this platform
        load = None
    return {"loadavg": load, "cpus": os.cpu_count()}


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


# setuptools before 67 imports pkg_resources when imported, which scans every installed
# distribution; torch's C++ builder imports setuptools in each process that builds or loads
# Inductor's CPU kernels (0.29-0.31 s against 0.05-0.06 s on the Xeon the README names)
PKG_RESOURCES_SETUPTOOLS_BELOW = 67


def installed_setuptools() -> str | None:
    """The version of setuptools in this environment (the bench's runs share it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("setuptools")
    except PackageNotFoundError:
        return None


def setuptools_line(settings: dict) -> str:
    """A line for the report when the environment's setuptools adds its import to every run
    (torch 2.11 allows any setuptools below 82; Python 3.11's venv bundles 65.5)."""
    found = settings.get("setuptools")
    try:
        major = int(str(found).split(".")[0])
    except ValueError:
        return ""
    if major >= PKG_RESOURCES_SETUPTOOLS_BELOW:
        return ""
    return (
        f"setuptools {found}: every run imports pkg_resources when torch's C++ builder first "
        "loads (about 0.25 s more per process, in the ISA probes and warm restarts of every "
        "strategy alike; cold compiles are timed apart). Fix: pip install -U "
        "'setuptools<82' (torch 2.14 requires 77 or newer)."
    )


BUSY_SHARE = 0.10  # others' share of the CPU over the whole run from which it was busy
BUSY_RUN_SHARE = 0.25  # ... and during one measurement


def load_line(settings: dict, runs: list[dict] | None = None) -> str:
    def one(snap: dict | None) -> str:
        if not snap or snap.get("loadavg") is None:
            return "n/a"
        return "/".join(f"{v:.2f}" for v in snap["loadavg"])

    start, end = settings.get("load_start"), settings.get("load_end")
    cpus = (start or end or {}).get("cpus")
    line = f"Load average (1/5/15 min): {one(start)} at start, {one(end)} at end; {cpus} CPUs."
    share = settings.get("others_cpu_share")
    if share is not None:  # sampled all along, the bench's own processes apart
        disturbed = [
            f"{r['strategy']} {group_of(r)} depth {r['depth']} repeat {r.get('repeat', 0) + 1}"
            f" ({r['others_cpu_share']:.0%})"
            for r in runs or []
            if (r.get("others_cpu_share") or 0.0) > BUSY_RUN_SHARE
        ]
        line += f" Other processes used {share:.0%} of the CPU time while the bench ran."
        if share > BUSY_SHARE or disturbed:
            line += " **The machine was busy: timings are not those of a quiet machine.**"
        if disturbed:
            line += (
                f" Runs during which others took over {BUSY_RUN_SHARE:.0%}: "
                + ", ".join(disturbed)
                + "."
            )
        return line
    # Without the sampler: the load average. The end reading includes the bench's own last
    # run (about one busy core), the start reading does not: without that allowance a
    # quiet machine reads as busy at the end.
    loads = [
        start["loadavg"][0] if start and start.get("loadavg") else 0.0,
        end["loadavg"][0] - 1.0 if end and end.get("loadavg") else 0.0,
    ]
    if cpus and max(loads) > 0.5 * cpus:
        line += " **The machine was busy: timings are not those of a quiet machine.**"
    return line
