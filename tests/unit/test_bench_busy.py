"""The bench's reading of other processes' CPU use: the bench's own process tree apart,
a process outside it counted."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from aotdist.bench.busy import OthersMeter, _ours
from aotdist.bench.machine import load_line

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def test_the_bench_tree_is_its_process_and_every_descendant():
    procs = {1: (0, 9.0), 10: (1, 1.0), 11: (10, 1.0), 12: (11, 1.0), 13: (1, 5.0), 14: (13, 2.0)}
    assert _ours(procs, 10) == {10, 11, 12}
    assert _ours(procs, 13) == {13, 14}


def test_a_process_outside_the_bench_counts_as_others():
    """A busy loop re-parented away from this process (its shell exits at once) is
    someone else's load; it burns about 3 CPU seconds, and at least 1 must be seen."""
    burn = f"{sys.executable} -c 'import time; t = time.time()\nwhile time.time() - t < 3: pass' &"
    with OthersMeter(interval=0.2) as meter:
        mark = meter.mark()
        subprocess.run(["sh", "-c", burn], check=True)
        time.sleep(3.5)
        share = meter.share_since(mark)
    wall = 3.5
    assert share is not None and share * wall * meter.cpus > 1.0


def test_the_report_says_busy_from_others_share_and_names_the_disturbed_runs():
    settings = {"load_start": {"loadavg": [0.1, 0.1, 0.1], "cpus": 2}, "others_cpu_share": 0.02}
    runs = [
        {"strategy": "aotdist", "model": "gpt", "depth": 8, "nproc": 1, "others_cpu_share": 0.01},
        {"strategy": "full", "model": "gpt", "depth": 8, "nproc": 1, "repeat": 1},
    ]
    quiet = load_line(settings, runs)
    assert "Other processes used 2% of the CPU time" in quiet and "busy" not in quiet
    runs[1]["others_cpu_share"] = 0.4
    line = load_line(settings, runs)
    assert "The machine was busy" in line and "full gpt depth 8 repeat 2 (40%)" in line
    assert "The machine was busy" in load_line({**settings, "others_cpu_share": 0.2}, [])
