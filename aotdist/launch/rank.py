"""The rank side of :func:`aotdist.launch.run_distributed`: one spawned (or forked) process.

Sets the ``torch.distributed`` environment, dies with its parent, initializes the process
group, runs the function and reports the result (pickled) or the traceback, then leaves
without interpreter finalization (``atexit`` handlers still run unless ``skip_teardown``).
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from aotdist.launch.teardown import exit_without_teardown


def _die_with_parent(parent_pid: int) -> None:
    """On Linux, have the kernel kill this rank if the parent dies (no orphans)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid and not _alive(parent_pid):  # died before prctl took effect
        os._exit(1)  # (under forkserver the parent is the server, which dies with the caller)


def _caller_output(parent_pid: int) -> None:
    """Under ``forkserver`` (the parent is the server): stdout and stderr are the caller's
    current ones, as a spawned rank's are, not the server's from when it started."""
    if os.getppid() == parent_pid or not sys.platform.startswith("linux"):
        return
    for fd in (1, 2):
        try:
            target = os.open(f"/proc/{parent_pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue  # (a socket, say): the server's stays
        os.dup2(target, fd)
        os.close(target)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout: float,
    payload: bytes,
    result_queue: Any,
    stack_file: str,
    parent_pid: int,
    skip_teardown: bool = False,
    env: dict[str, str] | None = None,
) -> None:
    """Entry point of one spawned rank."""
    _die_with_parent(parent_pid)
    _caller_output(parent_pid)
    if env is not None:  # the caller's, as a spawned rank's (a forked one has the server's)
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    # A rank that dies of a fatal signal (a native crash: SIGSEGV, or SIGABRT from glibc's
    # "double free or corruption") prints its Python stacks to stderr, which the parent
    # shows, so the report says where it died, not only that it died.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        stack_out = open(stack_file, "w")  # stays open: faulthandler writes to it later
        faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)

    try:
        try:
            fn, args, kwargs = pickle.loads(payload)
        except BaseException:
            report = (
                "error",
                rank,
                traceback.format_exc()
                + "\nfn or its arguments could not be loaded in the spawned process: define "
                "fn at module level of a module a fresh interpreter can import (not in an "
                "interactive session or `python -c`).",
            )
        else:
            report = _run_fn(rank, world_size, backend, timeout, fn, args, kwargs)
        result_queue.put(report)
        # Flush the report before leaving the process group, so that it reaches the
        # parent before the errors this rank's departure causes in its peers.
        result_queue.close()
        result_queue.join_thread()
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    if skip_teardown:
        # Opt-in (run_distributed(skip_teardown=True)): the report is delivered and the
        # group closed, so leave at once, without atexit handlers either. With torch 2.15,
        # teardown after Inductor compiled in the process can abort ("terminate called
        # without an active exception", SIGABRT) although the work succeeded; seen once in
        # CI-like runs of the cache tests.
        os._exit(0)
    # Otherwise leave as interpreter exit would up to finalization: atexit handlers run,
    # so a crash there shows in the exit code; finalization is skipped, where a gloo
    # worker thread still releasing a collective's tensors aborts the process (torch's,
    # on every supported release; aotdist.launch.teardown).
    exit_without_teardown(0)


def _run_fn(
    rank: int,
    world_size: int,
    backend: str,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
) -> tuple[str, int, Any]:
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        # No rank runs fn until every rank has finished joining: gloo's init returns on
        # one rank before its peer's side of the connection is up, and a rank whose fn
        # returns at once could leave and fail the peer's init ("connectFullMesh failed:
        # Connection closed by peer"; seen on a loaded 2-core machine, 3 of 60 runs).
        dist.barrier(device_ids=[rank] if backend == "nccl" else None)
        result = fn(rank, world_size, *args, **kwargs)
    except BaseException:
        return ("error", rank, traceback.format_exc())
    try:
        return ("ok", rank, pickle.dumps(result))
    except Exception:
        return (
            "error",
            rank,
            traceback.format_exc()
            + f"\nthe value fn returned ({type(result).__name__}) cannot be pickled; "
            "return plain data, tensors or state dicts instead.",
        )
