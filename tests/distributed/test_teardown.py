"""``aotdist.launch.exit_without_teardown``: a finished gloo run exits 0, and exit stays exit.

The gloo case reproduces torch's teardown abort: a process whose collectives' work is
still being released by gloo's worker threads when Python finalizes dies with SIGABRT
("terminate called without an active exception"). On a 2-core machine a plain exit of the
script below aborted in 4-5 of 6 runs on torch 2.11, 2.14 and 2.15.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aotdist.launch import exit_without_teardown

_GLOO = """
import sys
import torch
import torch.distributed as dist
from aotdist.launch import exit_without_teardown

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
tensors = [torch.ones(2_000_000) for _ in range(20)]
works = [dist.all_reduce(t, async_op=True) for t in tensors]
works[0].wait()
del works
print("trained", flush=True)
{exit}
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
    )


def test_a_gloo_process_with_collectives_in_flight_exits_zero(tmp_path: Path):
    code = _GLOO.format(exit="exit_without_teardown()")
    for i in range(3):
        proc = _run(code, str(tmp_path / f"store{i}"))
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
        assert proc.stdout == "trained\n"
        assert "terminate called" not in proc.stderr


def test_exit_keeps_the_exit_code_threads_atexit_handlers_and_buffered_output():
    code = textwrap.dedent("""
        import atexit, sys, threading, time
        from aotdist.launch import exit_without_teardown

        def late():
            time.sleep(0.3)
            print("thread done")

        threading.Thread(target=late).start()
        atexit.register(lambda: print("atexit ran"))
        sys.stdout.write("buffered ")  # stdout is a pipe: block-buffered, no newline
        exit_without_teardown(3)
        print("not reached")
    """)
    proc = _run(code)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered thread done\natexit ran\n"


def test_exit_shuts_down_a_process_pool_like_interpreter_exit():
    """concurrent.futures shuts its executors down from threading's exit hooks, before
    the atexit handlers; without them multiprocessing's atexit handler waits for the
    pool's workers forever (this hung the ranks of a graph-mode FSDP test)."""
    code = textwrap.dedent("""
        import concurrent.futures, operator
        from aotdist.launch import exit_without_teardown

        if __name__ == "__main__":
            pool = concurrent.futures.ProcessPoolExecutor(2)
            print(pool.submit(operator.add, 1, 1).result(), flush=True)
            exit_without_teardown()
    """)
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "2\n"


@pytest.mark.parametrize("code", [True, "0", 1.0])
def test_exit_code_must_be_an_int(code):
    with pytest.raises(TypeError, match="int exit status"):
        exit_without_teardown(code)
