"""How much of the machine other processes took while the bench ran.

The load average cannot tell the bench's own compiles (gcc on every core) from another
job. :class:`OthersMeter` samples ``/proc`` once a second in a thread: the CPU time each
process used since the last sample, split into the bench's own (the bench process and its
descendants: measurements, their ranks, compile workers, gcc) and everyone else's. A
measurement's figure is the others' CPU seconds over its wall time times the CPU count: 0
on a quiet machine, 0.5 when another job kept half the cores busy. Processes that start
and end between two samples are not seen (short-lived other processes are undercounted).
Linux only; elsewhere the figures are ``None``.
"""

from __future__ import annotations

import os
import threading
import time

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _processes() -> dict[int, tuple[int, float]]:
    """``pid -> (ppid, CPU seconds so far)`` of every process readable in ``/proc``."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone, or not ours to read
        # after the name: state ppid ... utime (12th) stime (13th), in clock ticks
        out[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK)
    return out


def _ours(procs: dict[int, tuple[int, float]], root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


class OthersMeter:
    """Samples others' CPU time in a thread; :meth:`mark` and :meth:`share_since` give the
    share over any stretch, :meth:`total` over the whole time it ran."""

    def __init__(self, interval: float = 1.0) -> None:
        self.available = os.path.isdir("/proc/self") and os.path.exists("/proc/stat")
        self.cpus = os.cpu_count() or 1
        self._interval = interval
        self._others_s = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = time.monotonic()

    def __enter__(self) -> OthersMeter:
        if self.available:
            self._last = _processes()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        self._start = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    def _loop(self) -> None:
        root = os.getpid()
        while not self._stop.wait(self._interval):
            now = _processes()
            ours = _ours(now, root)
            used = sum(
                max(cpu - self._last[pid][1], 0.0) if pid in self._last else 0.0
                for pid, (_, cpu) in now.items()
                if pid not in ours
            )
            with self._lock:
                self._others_s += used
            self._last = now

    def mark(self) -> tuple[float, float]:
        """A point to measure from: ``(monotonic time, others' CPU seconds so far)``."""
        with self._lock:
            return time.monotonic(), self._others_s

    def share_since(self, mark: tuple[float, float]) -> float | None:
        """Others' CPU seconds since ``mark`` over its wall time x CPUs (``None``: not
        measurable here, or under a second)."""
        wall = time.monotonic() - mark[0]
        if not self.available or wall < 1.0:
            return None
        with self._lock:
            return (self._others_s - mark[1]) / (wall * self.cpus)

    def total(self) -> float | None:
        """The share over the whole time the meter ran."""
        return self.share_since((self._start, 0.0))
