"""Which rank ``run_distributed`` names when several report errors (no processes spawned)."""

from __future__ import annotations

import queue

import pytest

from aotdist.errors import DistributedTestError
from aotdist.launch import runner


class _Alive:
    exitcode = None


def test_the_rank_that_raised_is_named_even_when_a_peer_s_lost_connection_came_first(monkeypatch):
    monkeypatch.setattr(runner, "_SECONDARY_WAIT_S", 0.0)
    reports = queue.Queue()
    run = runner._Run([_Alive(), _Alive()], reports, "step", timeout=10, stack_dir="")
    # rank 0's symptom arrived first and was read; rank 1's own error is still queued
    run.errors[0] = (
        "Traceback ...\nRuntimeError: [gloo/transport/tcp/pair.cc:547] "
        "Connection closed by peer [127.0.0.1]:20893\n"
    )
    reports.put(("error", 1, "Traceback ...\nRuntimeError: rank 1 lost its data loader\n"))
    with pytest.raises(DistributedTestError) as info:
        run._raise_failure()
    assert info.value.rank == 1 and "lost its data loader" in str(info.value)
    assert "rank 0: RuntimeError: [gloo" in str(info.value)  # the symptom, listed after
