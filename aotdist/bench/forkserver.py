"""Fresh measurement processes without paying the imports each time.

Each bench measurement must be a fresh process: empty in-memory compiler state, its own
Inductor cache dir, its own memory high-water mark. Started with ``python -m``, each also
spends seconds importing torch, Dynamo, AOTAutograd and Inductor (never in a timed
figure: the runner imports them before its timers start). :class:`ForkServer` starts one
server that imports them once and forks a child per measurement, as fresh as a spawned
one for everything measured (nothing compiled, no kernel or thread pool, no CUDA context
in the server); the child runs :func:`aotdist.bench.runner.main` with the measurement's
arguments and environment and writes its output to files the caller reads.

One server per ``run_bench`` call, Linux and ``--device cpu`` only (a CUDA runtime touched
before a fork fails in the child). ``AOTDIST_BENCH_START=spawn`` turns it off. Method and
the fork-against-spawn check: docs/bench/README.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

START_ENV = "AOTDIST_BENCH_START"  # "spawn": every measurement a `python -m` process


def fork_available() -> bool:
    """Whether measurements may fork from a server here (Linux, not turned off)."""
    return sys.platform == "linux" and os.environ.get(START_ENV, "fork") != "spawn"


def _child(request: dict) -> None:
    """In the forked child: the measurement's environment and output files, then the
    runner's ``main``; never returns."""
    status = 1
    try:
        # appending: processes that reopen this output (forkserver ranks) append to it too
        fd_in = os.open(os.devnull, os.O_RDONLY)
        fd_out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        fd_err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        for fd, std in ((fd_in, 0), (fd_out, 1), (fd_err, 2)):
            os.dup2(fd, std)
            os.close(fd)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        import warnings

        warnings.simplefilter("ignore")  # as PYTHONWARNINGS=ignore does for a spawned run
        from aotdist.bench import runner

        sys.argv = ["aotdist.bench.runner", *request["argv"]]
        status = runner.main(request["argv"])
    except BaseException:  # noqa: BLE001 - the child reports every failure, then exits
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # as the runner's __main__: skip the compiler's teardown


def serve() -> None:
    """The server loop: one JSON request a line on stdin (``argv``, ``env``, ``out``,
    ``err``); for each, forks a child, answers ``{"pid"}``, waits, answers ``{"status"}``
    (the child's exit code, minus the signal that killed it)."""
    from aotdist import _compat

    _compat.import_compiler_stack()
    import aotdist.bench.models  # noqa: F401 - imported once, for every child
    import aotdist.bench.runner  # noqa: F401
    import aotdist.bench.strategies  # noqa: F401

    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stray prints never reach the protocol
    reply.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            reply.close()  # the child holds no end of the protocol pipe
            _child(request)
        reply.write(json.dumps({"pid": pid}) + "\n")
        _, wait_status = os.waitpid(pid, 0)
        reply.write(json.dumps({"status": os.waitstatus_to_exitcode(wait_status)}) + "\n")


class ForkServer:
    """The client: :meth:`run` one measurement in a child forked from the server.

    Use as a context manager; the server exits when its stdin closes.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> ForkServer:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from aotdist.bench.forkserver import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._expect("ready")
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None

    def _expect(self, key: str):
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(
                f"the bench's fork server exited (exit {self._proc.poll()}); "
                f"run with {START_ENV}=spawn to start every measurement as a process"
            )
        return json.loads(line)[key]

    def run(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        workdir: str,
        timeout: float,
        on_line: Callable[[str], None],
    ) -> tuple[int, str]:
        """Runs ``aotdist.bench.runner`` with ``argv`` in a forked child with ``env``;
        ``on_line`` gets each stdout line as it comes. Returns the exit code (negative:
        the signal that ended it; ``-9`` after ``timeout`` seconds) and stderr."""
        out, err = Path(workdir, "stdout"), Path(workdir, "stderr")
        self._proc.stdin.write(
            json.dumps({"argv": argv, "env": env, "out": str(out), "err": str(err)}) + "\n"
        )
        self._proc.stdin.flush()
        pid = self._expect("pid")
        killer = threading.Timer(timeout, _kill, (pid,))
        killer.start()
        done = threading.Event()
        reader = threading.Thread(target=_follow, args=(out, on_line, done), daemon=True)
        reader.start()
        try:
            status = self._expect("status")
        finally:
            killer.cancel()
            done.set()
            reader.join()
        return status, err.read_text(errors="replace") if err.exists() else ""


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _follow(path: Path, on_line: Callable[[str], None], done: threading.Event) -> None:
    """Hands ``on_line`` each complete line written to ``path`` until ``done`` is set and
    the file is read to its end."""
    while not path.exists() and not done.is_set():
        time.sleep(0.05)
    if not path.exists():
        return
    with open(path) as f:
        pending = ""
        while True:
            chunk = f.read()
            if chunk:
                pending += chunk
                *lines, pending = pending.split("\n")
                for line in lines:
                    on_line(line + "\n")
            elif done.is_set():
                if pending:
                    on_line(pending)
                return
            else:
                time.sleep(0.1)


def spawned(
    argv: list[str], *, env: dict, timeout: float, on_line: Callable[[str], None]
) -> tuple[int, str]:
    """``python -m aotdist.bench.runner ARGV`` as a new process: its exit code (``-9``:
    killed after ``timeout`` seconds) and stderr; ``on_line`` gets each stdout line."""
    with tempfile.TemporaryFile(mode="w+") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aotdist.bench.runner", *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        try:
            for line in proc.stdout:
                on_line(line)
            proc.wait()
        finally:
            killer.cancel()
        stderr.seek(0)
        return proc.returncode, stderr.read()
