"""Tests of ``aotdist.launch.run_distributed`` (re-exported by ``aotdist.testing``) on gloo (CPU).

The rank functions live at module level: the spawned ranks import this module by name
(pytest puts this folder on ``sys.path`` and ``spawn`` hands ``sys.path`` to the child).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from aotdist.errors import AOTDistError, ConfigError
from aotdist.testing import (
    DistributedTestError,
    DistributedTimeoutError,
    free_port,
    run_distributed,
)

# ------------------------------------------------------------------ functions the ranks run


def _all_reduce_sum(rank: int, world_size: int, scale: float = 1.0) -> dict:
    value = torch.tensor([float(rank + 1)]) * scale
    dist.all_reduce(value)
    return {
        "sum": value,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "env": {
            key: os.environ.get(key)
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "OMP_NUM_THREADS")
        },
    }


def _write_pid(pid_dir: str, rank: int) -> None:
    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))


def _raise_on_rank1(rank: int, world_size: int, pid_dir: str) -> None:
    _write_pid(pid_dir, rank)
    dist.all_reduce(torch.ones(1))  # both ranks got this far
    if rank == 1:
        raise ValueError("boom")
    # Rank 0 waits for a peer that never comes; even if gloo notices the peer left, it
    # then stays stuck, like a rank blocked in a collective: it must be killed.
    try:
        dist.barrier()
    except Exception:
        pass
    time.sleep(3600)


def _exit_on_rank1(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _abort_on_rank1(rank: int, world_size: int) -> None:
    """A native crash mid-work, as glibc's "double free or corruption" abort would cause."""
    if rank == 1:
        os.abort()
    dist.barrier()


def _crash_in_teardown_on_rank1(rank: int, world_size: int, how: str) -> int:
    """Returns normally; rank 1 then dies while its interpreter exits (atexit)."""
    if rank == 1:
        import atexit
        import ctypes

        if how == "exit":
            atexit.register(os._exit, 3)
        else:  # a segfault in teardown, as a broken C++ destructor would cause
            atexit.register(ctypes.string_at, 0)
    return rank


def _hang_on_rank1(rank: int, world_size: int, pid_dir: str) -> int:
    _write_pid(pid_dir, rank)
    if rank == 1:
        time.sleep(3600)
    return rank


def _all_gather_ranks(rank: int, world_size: int) -> list[int]:
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([rank * 10]))
    return [int(t.item()) for t in gathered]


# ------------------------------------------------------------------------------ helpers


def _pids(pid_dir: Path) -> dict[int, int]:
    return {
        int(path.stem.removeprefix("rank")): int(path.read_text())
        for path in pid_dir.glob("rank*.pid")
    }


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _assert_no_ranks_left(pid_dir: Path, world_size: int) -> None:
    assert multiprocessing.active_children() == []
    pids = _pids(pid_dir)
    assert sorted(pids) == list(range(world_size)), pids
    assert [rank for rank, pid in pids.items() if _is_running(pid)] == []


# -------------------------------------------------------------------------------- tests


@pytest.mark.timeout(60)
def test_all_reduce_results_are_returned_per_rank():
    results = run_distributed(_all_reduce_sum, 2, scale=2.0, timeout=30)

    assert len(results) == 2
    for rank, result in enumerate(results):
        assert torch.equal(result["sum"], torch.tensor([6.0]))  # 2 * (1 + 2)
        assert (result["rank"], result["world_size"]) == (rank, 2)
        expected_threads = os.environ.get("OMP_NUM_THREADS", "1")
        assert result["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "OMP_NUM_THREADS": expected_threads,
        }
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(90)
def test_error_on_one_rank_is_raised_and_stops_the_waiting_rank(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank1, 2, str(tmp_path), timeout=60)
    elapsed = time.monotonic() - start

    message = str(info.value)
    assert "rank 1" in message
    assert "ValueError: boom" in message
    assert "_raise_on_rank1" in message  # the traceback
    assert info.value.rank == 1 and info.value.exit_code is None  # it raised
    assert isinstance(info.value, AOTDistError) and isinstance(info.value, RuntimeError)
    assert not isinstance(info.value, DistributedTimeoutError)
    assert elapsed < 30, f"took {elapsed:.1f} s: the waiting rank was not stopped promptly"
    _assert_no_ranks_left(tmp_path, 2)


@pytest.mark.timeout(60)
def test_rank_that_exits_without_reporting_is_named_with_its_exit_code():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_exit_on_rank1, 2, timeout=30)

    message = str(info.value)
    assert "rank 1" in message
    assert "exit code 3" in message
    assert info.value.rank == 1 and info.value.exit_code == 3
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(60)
def test_rank_killed_by_a_signal_prints_where_it_died(capfd):
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_abort_on_rank1, 2, timeout=30)

    assert info.value.rank == 1 and "SIGABRT" in str(info.value), str(info.value)
    # faulthandler in the rank: its Python stack at the crash reaches the parent's stderr
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err and "_abort_on_rank1" in err, err[-2000:]
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(60)
def test_hung_rank_times_out_and_every_rank_is_killed(tmp_path):
    start = time.monotonic()
    with pytest.raises(DistributedTimeoutError) as info:
        run_distributed(_hang_on_rank1, 2, str(tmp_path), timeout=10)
    elapsed = time.monotonic() - start

    message = str(info.value)
    assert "rank 1 is still running" in message
    assert "(rank 0 returned)" in message
    assert info.value.ranks == [1]
    assert info.value.rank == 1
    assert "_hang_on_rank1" in message  # rank 1's Python stack at the timeout
    assert 10 <= elapsed < 30
    _assert_no_ranks_left(tmp_path, 2)


def _local_function(rank: int, world_size: int) -> int:
    return rank


@pytest.mark.timeout(30)
def test_unpicklable_fn_or_argument_is_a_config_error_before_spawning():
    def nested(rank: int, world_size: int) -> int:
        return rank

    for fn in (lambda rank, world_size: rank, nested):
        with pytest.raises(ConfigError, match="module level"):
            run_distributed(fn, 2)
    with pytest.raises(ConfigError, match="positional argument 0"):
        run_distributed(_local_function, 2, lambda: None)
    with pytest.raises(ConfigError, match="world_size"):
        run_distributed(_local_function, 0)
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(90)
def test_world_size_4_all_gather():
    results = run_distributed(_all_gather_ranks, 4, timeout=60)

    assert results == [[0, 10, 20, 30]] * 4


@pytest.mark.timeout(120)
def test_a_rank_that_crashes_in_teardown_after_reporting_fails_the_run():
    for how, code in (("exit", "exit code 3"), ("segfault", "SIGSEGV (exit code -11)")):
        with pytest.raises(DistributedTestError, match="while shutting down") as info:
            run_distributed(_crash_in_teardown_on_rank1, 2, how, timeout=60)
        assert info.value.rank == 1 and "rank 1 of 2" in str(info.value), how
        assert info.value.exit_code == (3 if how == "exit" else -11)
        assert code in str(info.value), (how, str(info.value))
    # Opt-in, for a known torch teardown crash: ranks leave with os._exit(0) after reporting.
    assert run_distributed(
        _crash_in_teardown_on_rank1, 2, "exit", skip_teardown=True, timeout=60
    ) == [0, 1]
    assert multiprocessing.active_children() == []


def test_free_port_is_a_usable_port():
    # A listening socket and a torch.distributed store can take it, and it is not one
    # that is in use right now.
    from torch.distributed import TCPStore

    port = free_port()
    store = TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    store.set("k", "v")
    assert store.get("k") == b"v"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock, pytest.raises(OSError):
        sock.bind(("127.0.0.1", port))  # the store holds it: it was a real, free port
    del store
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", free_port()))


def _env_and_parent(rank: int, world_size: int, name: str) -> tuple[str | None, int]:
    return os.environ.get(name), os.getppid()


@pytest.mark.parametrize("start", ["spawn", "forkserver"])
def test_either_start_method_runs_the_ranks_in_the_callers_environment(monkeypatch, start):
    monkeypatch.setenv("AOTDIST_RANK_START", start)
    first = run_distributed(_env_and_parent, 2, "AOTDIST_PROBE")
    monkeypatch.setenv("AOTDIST_PROBE", "changed")  # after a forkserver started: spawned
    second = run_distributed(_env_and_parent, 2, "AOTDIST_PROBE")
    assert [env for env, _ in first] == [None, None]
    forked = [parent != os.getpid() for _, parent in first]  # from the server
    assert forked == [start == "forkserver"] * 2
    assert [env for env, _ in second] == ["changed", "changed"]
    assert all(parent == os.getpid() for _, parent in second)  # spawned by this process
