"""Run a function on several ranks of a real process group, (parent side).

:func:`run_distributed` spawns one process per rank (``spawn`` start method), sets up
``torch.distributed`` in each, runs the function and returns every rank's result. A
failure on any rank is raised in the caller as :class:`DistributedTestError` naming the
rank and carrying its traceback, and the other ranks are stopped at once: a rank that
raises never leaves its peers waiting in a collective until a timeout.

Results travel back pickled by value (tensors included): a CUDA tensor comes back on its
device, so return ``.cpu()`` values to keep the calling process off the GPU.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_module
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from aotdist.errors import ConfigError, DistributedTestError, DistributedTimeoutError
from aotdist.launch.rank import rank_main

# "forkserver": ranks are forked from a server process that imported torch and aotdist
# once (start-up in well under a second instead of seconds); anything else: spawn.
START_ENV = "AOTDIST_RANK_START"
_server_env: dict[str, str] | None = None  # the environment the forkserver started with
_PER_CALL = ("PYTEST_CURRENT_TEST",)  # differs per call and is read by nothing at import

_POLL_S = 0.05  # how often the parent checks the result queue and the processes
_STOP_GRACE_S = 2.0  # between SIGTERM and SIGKILL when stopping ranks
_STACK_DUMP_WAIT_S = 1.0  # for hung ranks to write their Python stacks on timeout
_SECONDARY_WAIT_S = 0.5  # for other ranks' errors to arrive after the first failure
_PEER_LOST = ("closed by peer", "reset by peer", "Broken pipe", "Connection refused")  # named last


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago.

    The port is released before returning, so another process may take it before it is
    used; that race is rare on a test machine.

    Returns:
        The port number.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    skip_teardown: bool = False,
    **kwargs: Any,
) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned ranks.

    Each rank is a fresh process (``spawn`` start method; ``forkserver`` with
    ``AOTDIST_RANK_START=forkserver``, as the tests run, which forks each rank from one
    process that imported torch once) with ``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` set, and
    ``OMP_NUM_THREADS=1`` unless the caller set it. It initializes the default process
    group with ``backend`` (for ``"nccl"`` it first selects ``cuda:<rank>``), waits at a
    barrier until every rank has joined, runs ``fn``, reports the result, and destroys
    the process group.

    The first failure seen ends the run: a rank that raised, or one that exited without
    reporting (``os._exit``, a segfault, the OOM killer). The other ranks are then
    terminated, and killed if they do not exit within a short grace. Processes are
    always reaped before this function returns or raises.

    Args:
        fn: A function defined at module level of an importable module, so that the
            spawned processes can import it. Its return value must be picklable.
        world_size: Number of ranks, at least 1.
        *args: Passed to ``fn`` after ``rank`` and ``world_size``; must be picklable.
        backend: The ``torch.distributed`` backend, ``"gloo"`` or ``"nccl"``.
        timeout: Seconds for the whole run, start-up included; also the process
            group's collective timeout.
        skip_teardown: After reporting, leave each rank with ``os._exit(0)`` at once, its
            ``atexit`` handlers skipped too. By default a rank runs them and then leaves
            without interpreter finalization (``exit_without_teardown``: torch's gloo
            worker threads can abort it), and a rank that crashes in them fails the run.
        **kwargs: Passed to ``fn``; must be picklable. ``backend``, ``timeout`` and
            ``skip_teardown`` are taken by this function and never reach ``fn``.

    Returns:
        The value ``fn`` returned on each rank, ordered by rank.

    Raises:
        ConfigError: ``fn``, an argument or a keyword argument cannot be pickled (a
            lambda or a local function), ``world_size`` or ``timeout`` is not positive,
            or ``"nccl"`` is asked for with fewer CUDA devices than ranks.
        DistributedTimeoutError: ``timeout`` elapsed; the message names the ranks still
            running and, where the platform allows, shows their Python stacks.
        DistributedTestError: A rank raised (the message names the rank and has its
            traceback), exited without reporting a result, or crashed after reporting
            (in teardown; the message names the rank and its exit code).
    """
    _check_config(fn, world_size, backend, timeout)
    payload = _pickle_call(fn, args, kwargs)
    name = _describe(fn)
    ctx = _context()
    port = free_port()
    result_queue = ctx.Queue()
    procs: list[Any] = []
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="aotdist-ranks-") as stack_dir:
        try:
            for rank in range(world_size):
                proc = ctx.Process(
                    target=rank_main,
                    args=(
                        rank,
                        world_size,
                        port,
                        backend,
                        timeout,
                        payload,
                        result_queue,
                        os.path.join(stack_dir, f"rank{rank}.stack"),
                        os.getpid(),
                        skip_teardown,
                        dict(os.environ),
                    ),
                    name=f"aotdist-rank{rank}",
                )
                proc.start()
                procs.append(proc)
            run = _Run(procs, result_queue, name, timeout, stack_dir)
            return run.collect(deadline)
        finally:
            _stop(procs)
            result_queue.close()
            result_queue.join_thread()


def _context():
    """``spawn``, or ``forkserver`` where :data:`START_ENV` asks for it and the environment
    is the one the server started with (the modules it imported read their settings from
    that environment; a call under another one is spawned, so it sees its own)."""
    global _server_env
    if os.environ.get(START_ENV) != "forkserver" or sys.platform != "linux":
        return mp.get_context("spawn")
    env = {k: v for k, v in os.environ.items() if k not in _PER_CALL}
    if _server_env is None:
        _server_env = env
        mp.set_forkserver_preload(["aotdist.launch.rank"])
    return mp.get_context("forkserver" if env == _server_env else "spawn")


def _check_config(fn: Any, world_size: Any, backend: Any, timeout: Any) -> None:
    """Raise ``ConfigError`` listing every invalid argument of ``run_distributed``."""
    problems = []
    if not callable(fn):
        problems.append(f"fn must be callable, got {type(fn).__name__} {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        problems.append(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        problems.append(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if not isinstance(backend, str) or not backend:
        problems.append(f"backend must be a backend name such as 'gloo', got {backend!r}")
    elif backend == "nccl" and isinstance(world_size, int):
        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if devices < world_size:
            problems.append(
                f"backend 'nccl' needs one CUDA device per rank: world_size={world_size} "
                f"but {devices} device(s) are visible; use backend='gloo' or fewer ranks"
            )
    if problems:
        raise ConfigError("run_distributed: " + "; ".join(problems))


def _pickle_call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> bytes:
    """Pickle ``(fn, args, kwargs)`` for the ranks, or say which part cannot be pickled."""
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ConfigError(
            f"run_distributed: fn {_describe(fn)} cannot be pickled ({exc}); the spawned "
            "ranks import it by name, so it must be a function defined at module level of "
            "an importable module, not a lambda, a local (nested) function or a method of "
            "an unpicklable object. Move it to module level (functools.partial of a "
            "module-level function works too)."
        ) from exc
    for index, value in enumerate(args):
        _check_picklable(value, f"positional argument {index}")
    for key, value in kwargs.items():
        _check_picklable(value, f"keyword argument {key!r}")
    return pickle.dumps((fn, args, kwargs))


def _check_picklable(value: Any, what: str) -> None:
    try:
        pickle.dumps(value)
    except Exception as exc:
        raise ConfigError(
            f"run_distributed: {what} ({type(value).__name__}) cannot be pickled ({exc}); "
            "arguments are sent to the spawned ranks, so pass picklable values (build "
            "models, process groups and open files inside fn instead)."
        ) from exc


def _describe(fn: Any) -> str:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{module}.{qualname}" if module else qualname


class _Run:
    """The parent's view of one ``run_distributed`` call: reports and exits per rank."""

    def __init__(
        self, procs: list[Any], result_queue: Any, name: str, timeout: float, stack_dir: str
    ):
        self.procs = procs
        self.queue = result_queue
        self.name = name
        self.timeout = timeout
        self.stack_dir = stack_dir
        self.results: dict[int, Any] = {}
        self.errors: dict[int, str] = {}  # rank -> traceback, in arrival order

    @property
    def world_size(self) -> int:
        return len(self.procs)

    def collect(self, deadline: float) -> list:
        while len(self.results) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._raise_timeout()
            if self._receive(min(_POLL_S, remaining)):
                if self.errors:
                    self._raise_failure()
            elif self._silent_deaths():
                self._raise_failure()
        self._wait_for_exit(deadline)
        return [self.results[rank] for rank in range(self.world_size)]

    def _receive(self, wait: float) -> bool:
        """Store one report if one arrives within ``wait`` seconds; ``True`` if one did."""
        try:
            status, rank, value = (
                self.queue.get(timeout=wait) if wait > 0 else self.queue.get_nowait()
            )
        except queue_module.Empty:
            return False
        if status == "ok":
            try:
                self.results[rank] = pickle.loads(value)
            except Exception as exc:
                raise DistributedTestError(
                    f"rank {rank} of {self.world_size} returned a value from {self.name} that "
                    f"cannot be unpickled in the calling process ({type(exc).__name__}: {exc}); "
                    "return plain data or tensors, or types importable in this process",
                    rank=rank,
                ) from exc
        else:
            self.errors[rank] = value
        return True

    def _drain(self) -> None:
        """Read every report already sent; a rank flushes its report before it exits."""
        while self._receive(0):
            pass

    def _silent_deaths(self) -> dict[int, int]:
        """Ranks that exited without a report (after draining the queue), with exit codes."""
        if all(p.exitcode is None for p in self.procs):
            return {}
        self._drain()
        return {
            rank: proc.exitcode
            for rank, proc in enumerate(self.procs)
            if proc.exitcode is not None and rank not in self.results and rank not in self.errors
        }

    def _raise_failure(self) -> None:
        # A rank found dead without a report when the first failure is seen most likely
        # died first: peers' errors ("connection closed by peer") follow from it, while a
        # rank that raises flushes its report before it leaves the process group. The
        # wait comes first: a peer's "connection reset" report can arrive before the dead
        # rank's exit code is visible (seen on a loaded 2-core machine).
        time.sleep(_SECONDARY_WAIT_S)
        self._drain()
        deaths = self._silent_deaths()
        if deaths:
            rank = next(iter(deaths))
            primary = (
                f"rank {rank} of {self.world_size} {_exit_text(deaths[rank])} without "
                f"reporting a result from {self.name} (its stderr, above, may say why: "
                "a native crash prints its Python stack there)"
            )
        else:
            rank = min(self.errors, key=lambda r: any(t in self.errors[r] for t in _PEER_LOST))
            primary = f"rank {rank} of {self.world_size} failed in {self.name}:\n{self.errors[rank].rstrip()}"
        deaths.update(self._silent_deaths())
        others = [f"rank {r} {_exit_text(code)}" for r, code in deaths.items() if r != rank]
        others += [f"rank {r}: {_last_line(tb)}" for r, tb in self.errors.items() if r != rank]
        message = primary
        if others:
            message += "\nOther ranks also failed before they were stopped: " + "; ".join(others)
        raise DistributedTestError(message, rank=rank, exit_code=deaths.get(rank))

    def _raise_timeout(self) -> None:
        self._drain()
        if self.errors or self._silent_deaths():
            self._raise_failure()
        running = [r for r in range(self.world_size) if r not in self.results]
        stacks = self._dump_stacks(running)
        finished = [r for r in range(self.world_size) if r in self.results]
        message = (
            f"{self.name} timed out after {self.timeout:g} s on {self.world_size} ranks: "
            f"{_ranks(running)} {'is' if len(running) == 1 else 'are'} still running"
        )
        if finished:
            message += f" ({_ranks(finished)} returned)"
        message += (
            "; all ranks were killed. A rank waiting in a collective its peers never enter "
            "is the usual cause; raise timeout= if the work is just slow."
        )
        for rank in running:
            if stacks.get(rank):
                message += f"\n\nrank {rank} Python stacks at the timeout:\n{stacks[rank].rstrip()}"
        raise DistributedTimeoutError(message, running)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask running ranks for their Python stacks (faulthandler on SIGUSR1)."""
        if not hasattr(signal, "SIGUSR1"):
            return {}
        signalled = []
        for rank in ranks:
            proc = self.procs[rank]
            if proc.is_alive() and proc.pid is not None:
                try:
                    os.kill(proc.pid, signal.SIGUSR1)
                    signalled.append(rank)
                except OSError:
                    pass
        if not signalled:
            return {}
        time.sleep(_STACK_DUMP_WAIT_S)
        stacks = {}
        for rank in signalled:
            try:
                with open(os.path.join(self.stack_dir, f"rank{rank}.stack")) as f:
                    stacks[rank] = f.read()
            except OSError:
                pass
        return stacks

    def _wait_for_exit(self, deadline: float) -> None:
        """After every rank reported: each must exit cleanly before the deadline."""
        # At least a short grace, for results that arrive just before the deadline.
        exit_deadline = max(deadline, time.monotonic() + _STOP_GRACE_S)
        for proc in self.procs:
            proc.join(max(0.0, exit_deadline - time.monotonic()))
        stuck = [r for r, p in enumerate(self.procs) if p.exitcode is None]
        if stuck:
            raise DistributedTimeoutError(
                f"{self.name}: {_ranks(stuck)} returned a result but did not exit within "
                f"the {self.timeout:g} s timeout (stuck destroying the process group?); all "
                "ranks were killed",
                stuck,
            )
        for rank, proc in enumerate(self.procs):
            if proc.exitcode != 0:
                raise DistributedTestError(
                    f"rank {rank} of {self.world_size} returned a result from {self.name} but "
                    f"then {_exit_text(proc.exitcode)} while shutting down",
                    rank=rank,
                    exit_code=proc.exitcode,
                )


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with exit code {code}"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no traceback)"


def _stop(procs: list[Any]) -> None:
    """Terminate the ranks still running, kill those that outlive the grace, reap all."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    grace_end = time.monotonic() + _STOP_GRACE_S
    for proc in procs:
        proc.join(max(0.0, grace_end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join()
        proc.close()
