"""Sharing rank 0's compiles with the other ranks in a cold ``shared``-mode run.

Between ``aotdist.cache.load`` and ``aotdist.cache.save``, :class:`CompileSharing`
wraps Inductor's FX graph cache (``FxGraphCache.load_with_key`` and ``_save_graph``;
:meth:`CompileSharing.stop` puts the originals back). Rank 0 publishes, through the
process group's store, the FX cache key of its n-th graph lookup and then the artifacts
that serve it; every other rank, at its n-th lookup, uses rank 0's artifacts when the
keys are equal, and otherwise (a different key, a timeout, rank 0 done with its first
step) compiles the graph itself with a warning that gives the reason. Why this is
safe: docs/internals.md.
"""

from __future__ import annotations

import itertools
import time
import warnings
from collections.abc import Callable

from aotdist import _compat
from aotdist.cache.artifacts import install, pack
from aotdist.cache.bundle import decode
from aotdist.errors import CacheWarning

_GENERATION = itertools.count()


class CompileSharing:
    """Rank 0 compiles each graph, the other ranks load its artifacts (see module doc).

    Args:
        rank: This process's rank in the default process group.
        timeout_s: Seconds to wait for rank 0 at one graph before compiling here.
    """

    def __init__(self, rank: int, *, timeout_s: float = 300.0):
        self.rank, self.timeout_s = rank, timeout_s
        self.store = _compat.default_store()
        self.prefix = f"aotdist_cache/{next(_GENERATION)}"
        self.lookups = 0
        self.loaded = 0  # graphs served by rank 0's artifacts (other ranks)
        self.published = 0  # graphs published (rank 0)
        self.misses: list[str] = []  # why graphs were compiled here (other ranks)
        self._restore: Callable[[], None] | None = None

    # -- installation (scoped: stop() restores FxGraphCache exactly) ------------------

    def start(self) -> None:
        if self._restore is not None:
            return
        self._restore = _compat.wrap_fx_graph_cache(
            self._wrap_lookup, self._wrap_save if self.rank == 0 else None
        )

    def stop(self) -> None:
        if self._restore is None:
            return
        self._restore()
        self._restore = None
        if self.rank == 0:
            self.store.set(f"{self.prefix}/done", b"1")

    # -- rank 0 ------------------------------------------------------------------------

    def _publish(self, key: str) -> None:
        data = pack({"graph": key})
        if data is not None:
            self.store.set(f"{self.prefix}/fx/{key}", data)
            self.published += 1

    def _wrap_save(self, save):
        def _save_graph(key, *args, **kwargs):
            save(key, *args, **kwargs)
            self._publish(key)

        return _save_graph

    # -- every rank --------------------------------------------------------------------

    def _wrap_lookup(self, lookup):
        def load_with_key(key, *args, **kwargs):
            n, self.lookups = self.lookups, self.lookups + 1
            if self.rank == 0:
                self.store.set(f"{self.prefix}/seq/{n}", key)
                result = lookup(key, *args, **kwargs)
                if result[0] is not None:  # a hit here: publish it too
                    self._publish(key)
                return result
            why = self._fetch(n, key)
            result = lookup(key, *args, **kwargs)
            if why is None and result[0] is None:
                why = "rank 0's artifacts did not serve it (FX graph cache miss after loading)"
            if why is not None:
                self.misses.append(why)
                warnings.warn(
                    f"aotdist cache: rank {self.rank} compiles graph {n} itself: {why}.",
                    CacheWarning,
                    stacklevel=2,
                )
            else:
                self.loaded += 1
            return result

        return load_with_key

    def _fetch(self, n: int, key: str) -> str | None:
        """Installs rank 0's artifacts for graph ``n``; the reason if it cannot."""
        seq = f"{self.prefix}/seq/{n}"
        if not self._wait(seq):
            return (
                f"rank 0 did not reach graph {n} within {self.timeout_s}s, or finished "
                "its first step without it"
            )
        theirs = self.store.get(seq).decode()
        if theirs != key:
            return (
                f"its FX graph cache key differs from rank 0's ({key[:12]}... vs "
                f"{theirs[:12]}...): something rank-specific is in the graph or its inputs"
            )
        fx = f"{self.prefix}/fx/{key}"
        if not self._wait(fx, gone=f"{self.prefix}/seq/{n + 1}"):
            return f"rank 0 did not publish its artifacts within {self.timeout_s}s"
        try:
            _, mega, kernels = decode(self.store.get(fx))
            install(mega, kernels)
        except Exception as exc:
            return f"rank 0's artifacts could not be installed ({type(exc).__name__}: {exc})"
        return None

    def _wait(self, name: str, *, gone: str | None = None) -> bool:
        """Waits for store key ``name``; gives up when rank 0 is done or reached ``gone``."""
        deadline = time.monotonic() + self.timeout_s
        stops = [f"{self.prefix}/done"] + ([gone] if gone else [])
        while time.monotonic() < deadline:
            if self.store.check([name]):
                return True
            if any(self.store.check([s]) for s in stops):
                return self.store.check([name])
            time.sleep(0.02)
        return False
