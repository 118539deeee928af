"""The storage-resize pattern on a buffer, crossed with every fix that can touch it.

A region that grows a buffer's storage, writes the buffer, reads it and frees the storage
again (FSDP's pattern, and offloading code's) killed the process once the buffer-write
pass copied the buffer: the copy was freed, then written back. Each combination of
``resize_cases.py`` (write source x ``no_grad`` x storage empty at entry, crossed with the
buffer-write pass, BatchNorm statistics, the layout merge, activation checkpointing,
nested regions and FSDP2 hooks mode) runs in its own process, so that a crash fails
the test; each must train as eager does, with the buffer's storage freed as in eager.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

CASES = Path(__file__).with_name("resize_cases.py")
TOLERANCE = 1e-5
INDUCTOR_TOLERANCE = 1e-3  # fused reductions sum in another order (BatchNorm over 4 rows)
# the region each fix leaves reused as one subgraph (nested: the outer one, with the inner
# one's ops inside its subgraph, which metrics names)
REUSED = {
    "plain": "ResizingBlock",
    "batchnorm": "ResizingBlock",
    "layout": "ResizingBlock",
    "nested": "Outer",
    "fsdp": "ResizingBlock",
}


def _run(fix: str, entry: str, backend: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, str(CASES), fix, entry, backend],
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    started = [ln["start"] for ln in lines if "start" in ln]
    assert proc.returncode == 0, (
        f"{fix}/{entry}/{backend} died with "
        f"{'SIGSEGV' if proc.returncode == -signal.SIGSEGV else proc.returncode} in variant "
        f"{started[-1] if started else None}:\n{proc.stderr[-3000:]}"
    )
    results = [ln for ln in lines if "variant" in ln]
    assert len(results) == 6 == len(started), proc.stdout
    return results


def _check_reused(results: list[dict], region: str, tolerance: float = TOLERANCE) -> None:
    for r in results:
        assert r["worst"] <= tolerance, r
        assert r["regions"][region] == [3, 3, 1], r  # instances, call sites, subgraphs
        if region == "Outer":  # every inner instance ran, inside the outer subgraph
            assert r["within"] == {"ResizingBlock": ["Outer", 3]}, r
        assert not r["demoted"] and not r["warnings"], r


@pytest.mark.parametrize("entry", ["full", "empty"])
@pytest.mark.parametrize("fix", ["plain", "batchnorm", "layout", "nested"])
def test_the_resize_pattern_stays_one_reused_subgraph(fix, entry):
    _check_reused(_run(fix, entry, "aot_eager"), REUSED[fix])


@pytest.mark.parametrize("entry", ["full", "empty"])
def test_under_activation_checkpointing_the_region_is_demoted_by_name(entry):
    # the checkpointed call is recomputed in backward, where a copy of the buffer would
    # read the storage the moved resize freed: the pass leaves it, torch refuses it
    for r in _run("ac", entry, "aot_eager"):
        assert r["worst"] <= TOLERANCE, r
        assert r["demoted"] == ["ResizingBlock"], r
        assert any("'ResizingBlock'" in w for w in r["warnings"]), r


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["full", "empty"])
def test_under_fsdp2_hooks_mode_on_two_ranks(entry):
    _check_reused(_run("fsdp", entry, "aot_eager"), REUSED["fsdp"])


@pytest.mark.slow
@pytest.mark.inductor
@pytest.mark.parametrize("fix", ["plain", "batchnorm"])
def test_with_inductor(fix):
    _check_reused(_run(fix, "empty", "inductor"), REUSED[fix], INDUCTOR_TOLERANCE)
