"""A model's loaded saved graphs (:mod:`aotdist.cache.precompile`): each compiled call
tries them in order and runs the one whose guards cover it, or says why none does."""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from aotdist.backends.recording import GraphRecord, RecordingBackend, append_record
from aotdist.errors import CacheWarning


class Precompiled:
    """The loaded graphs on a model: runs a call one covers, else says why not."""

    def __init__(
        self,
        model: nn.Module,
        fn: Any,
        records: list[dict],
        *,
        label: str = "the saved whole-model graph",
        saved: tuple | None = None,
    ):
        self.model_id, self.label = id(model), label
        self.saved = saved  # ({entry: bytes}, records entry): a forced save keeps them
        self.calls, self.misses = 0, []
        self.graphs = [[fn, records, False]]  # [function, records, ran once], tried in order

    def also(self, fn: Any, records: list[dict]) -> None:
        """Another saved graph of the same call (the eval call's), tried after the first."""
        self.graphs.append([fn, records, False])

    def run(self, args: tuple, kwargs: dict, backend: RecordingBackend) -> tuple[bool, Any]:
        """``(True, output)``, or ``(False, None)`` when every saved graph's guards fail
        (then warned once)."""
        whys = []
        for graph in self.graphs:
            try:
                hit, why = graph[0].check(args, kwargs), ""
            except Exception as exc:  # noqa: BLE001 - a guard that cannot be evaluated misses
                hit, why = False, f"the guard check failed: {type(exc).__name__}: {exc}"[:300]
            if hit:
                return True, self._run(graph, args, kwargs, backend)
            whys.append(why or graph[0].why(args, kwargs))
        if len(self.misses) < 20:
            self.misses.append("; the eval call's graph: ".join(whys))
        if len(self.misses) == 1:
            warnings.warn(
                f"aotdist cache: {self.label} does not cover this call "
                f"(guard failed: {self.misses[0]}); it is compiled as usual (kernels the "
                "bundle holds still load). Expected for a last, smaller batch or an eval "
                "step; if every call misses, delete the bundle so that this run's inputs "
                "save a new one.",
                CacheWarning,
                stacklevel=4,
            )
        return False, None

    def _run(self, graph: list, args: tuple, kwargs: dict, backend: RecordingBackend) -> Any:
        fn, records, ran = graph
        if not ran:  # metrics see the graph the saved one is
            graph[2] = True
            for rec in records:
                record = GraphRecord(
                    index=0,
                    model_id=self.model_id,
                    num_ops=rec["num_ops"],
                    backend_seconds=0.0,
                    call_sites=rec["call_sites"],
                    precompiled=True,
                    standalone=rec.get("standalone"),
                    subgraphs={k: set(v) for k, v in rec["subgraphs"].items()},
                    inlined={k: set(v) for k, v in rec["inlined"].items()},
                )
                backend.records.append(record)
                append_record(record)
        self.calls += 1
        return fn(args, kwargs)
