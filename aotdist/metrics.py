"""Compile metrics: time by phase, graphs, graph breaks, recompiles, region reuse.

Read from Dynamo's compilation metrics and graph-break counters, and from the
:class:`~aotdist.backends.recording.GraphRecord` log of the recording backend
(``invoke_subgraph`` call sites and distinct subgraphs of each region). This module only
reads: it decides nothing about how a model is compiled.

Use :func:`track` around the first training step(s)::

    with aotdist.metrics.track(model) as m:
        loss = model(x).sum(); loss.backward()
    print(m.summary())
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from torch import nn

from aotdist import _compat
from aotdist.backends.recording import GraphRecord, graph_log_cursor, records_since
from aotdist.compile.state import STATE_ATTR, CompileMode

__all__ = ["CompileMetrics", "RegionStats", "Tracker", "model_records", "track"]


@dataclass
class RegionStats:
    """Reuse of one region: the goal is ``subgraphs == 1`` and ``call_sites == instances``."""

    instances: int
    call_sites: int = 0
    subgraphs: int = 0
    inlined: int = 0
    standalone_graphs: int = 0  # graphs of the region compiled as frames of their own
    # the region whose subgraph holds this one's ops (nested, used once per outer body:
    # torch inlines it there), and how many of its instances ran so
    within: str = ""
    within_instances: int = 0
    # instances in none of the window's graphs (neither called, inlined nor within another
    # region's subgraph): not called by the forward, or run eager after a graph break
    unseen: tuple[str, ...] = ()


@dataclass
class CompileMetrics:
    """What compiling cost and produced within one :func:`track` window (seconds)."""

    # None ("n/a" in summaries): this torch's compile records lack a field the figure needs
    compile_seconds: float | None = 0.0
    dynamo_seconds: float | None = 0.0
    aot_autograd_seconds: float | None = 0.0
    backend_seconds: float | None = 0.0
    wall_seconds: float = 0.0
    frames_compiled: int | None = 0
    graphs: int = 0
    graph_breaks: dict[str, int] = field(default_factory=dict)
    # Dynamo errors that made it skip a frame or fall back to eager (counters["unimplemented"])
    unsupported: dict[str, int] = field(default_factory=dict)
    recompiles: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    regions: dict[str, RegionStats] = field(default_factory=dict)
    fixes: dict[str, str] = field(default_factory=dict)
    demoted: dict[str, str] = field(default_factory=dict)
    eager: dict[str, str] = field(default_factory=dict)  # region -> why it ran uncompiled
    reuse: dict[str, str] = field(default_factory=dict)  # region -> why >1 subgraph
    # "graph": one whole-model graph calling region subgraphs; "frames": each region its
    # own compiled graph, the code around them eager (under FSDP2, tensor parallelism
    # without it, or compile.outer eager: a short run's choice); "" when no aotdist model
    # was tracked
    mode: CompileMode | str = ""
    # the window ran a whole-model graph loaded from the cache bundle (no trace); calls
    # its guards did not cover (each compiled as usual), with the failing guard
    precompiled: bool = False
    precompile_misses: list[str] = field(default_factory=list)
    # how Inductor compiled the graphs that call regions: "fx" (region bodies only, the
    # glue unlowered: compile.outer), "inductor" (lowered whole), both, or "" (no such graph)
    outer: str = ""

    @property
    def num_graph_breaks(self) -> int:
        return sum(self.graph_breaks.values())

    def to_dict(self) -> dict:
        """JSON-able copy."""
        d = asdict(self)
        d["num_graph_breaks"] = self.num_graph_breaks
        d["mode"] = str(self.mode)
        return d

    def summary(self) -> str:
        """A compact multi-line text report."""
        lines = [
            f"compile {_s(self.compile_seconds)} (dynamo {_s(self.dynamo_seconds)}, "
            f"aot_autograd {_s(self.aot_autograd_seconds)}, backend {_s(self.backend_seconds)})"
            f" | frames {_n(self.frames_compiled)} | graphs {self.graphs} | "
            f"graph breaks {self.num_graph_breaks} | recompiles {len(self.recompiles)}"
            + (f" | mode {self.mode}" if self.mode else "")
            + (f" | outer {self.outer}" if self.outer else "")
            + (" | saved graph loaded" if self.precompiled else ""),
        ]
        for name, st in self.regions.items():
            extra = f", {st.inlined} inlined" if st.inlined else ""
            if st.standalone_graphs:
                extra += f", {st.standalone_graphs} standalone frame graph(s)"
            if st.within:
                extra += f", {st.within_instances} compiled inside {st.within}'s subgraph"
            if st.unseen:
                extra += f", {len(st.unseen)} in no graph ({', '.join(st.unseen[:2])}"
                extra += ", ...)" if len(st.unseen) > 2 else ")"
            lines.append(
                f"  region {name}: {st.instances} instances, {st.call_sites} call sites, "
                f"{st.subgraphs} distinct subgraph(s){extra}"
            )
        for reason, n in self.graph_breaks.items():
            lines.append(f"  graph break x{n}: {reason.splitlines()[0][:160]}")
        for reason, n in self.unsupported.items():
            lines.append(f"  unsupported x{n}: {reason.splitlines()[0][:160]}")
        for reason in self.recompiles:
            lines.append(f"  recompile: {reason.splitlines()[0][:160]}")
        for name, fix in self.fixes.items():
            lines.append(f"  region {name} fixed: {fix}")
        for name, why in self.demoted.items():
            lines.append(f"  region {name} compiled inline: {why[:160]}")
        for name, why in self.eager.items():
            lines.append(f"  region {name} RAN EAGER: {why[:160]}")
        for name, why in self.reuse.items():
            lines.append(f"  region {name} reuse: {why[:160]}")
        for why in self.precompile_misses:
            lines.append(f"  saved graph missed: {why[:160]}")
        return "\n".join(lines)


def _s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.2f}s"


def _n(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def _us(cm, name: str) -> float:
    return (getattr(cm, name, None) or 0) / 1e6


# CompileMetrics figure -> the CompilationMetrics fields it is computed from
_NEEDS = {
    "compile_seconds": (
        "is_forward",
        "dynamo_cumulative_compile_time_us",
        "backward_cumulative_compile_time_us",
    ),
    "dynamo_seconds": (
        "is_forward",
        "dynamo_cumulative_compile_time_us",
        "aot_autograd_cumulative_compile_time_us",
    ),
    "aot_autograd_seconds": (
        "is_forward",
        "aot_autograd_cumulative_compile_time_us",
        "inductor_cumulative_compile_time_us",
        "backward_cumulative_compile_time_us",
    ),
    "backend_seconds": ("inductor_cumulative_compile_time_us",),
    "frames_compiled": ("is_forward",),
}


class Tracker:
    """Collects :class:`CompileMetrics` between :meth:`start` and :meth:`stop`.

    For integrations whose hooks open and close the window in different calls (the
    Lightning callback, the Accelerate hook); :func:`track` is the ``with`` form.

    Args:
        model: A model compiled by :func:`aotdist.compile_regions`; its region reuse is
            reported. Without it, region stats cover every aotdist model compiled.
    """

    def __init__(self, model: nn.Module | None = None):
        self.model = model
        self.metrics: CompileMetrics | None = None
        self._before: tuple | None = None

    @property
    def running(self) -> bool:
        """Whether :meth:`start` was called and :meth:`stop` not yet."""
        return self._before is not None

    def start(self) -> CompileMetrics:
        """Opens the window; returns the :class:`CompileMetrics` :meth:`stop` fills in.

        Raises:
            RuntimeError: The window is already open.
        """
        if self._before is not None:
            raise RuntimeError("Tracker.start() called twice; call stop() first")
        self.metrics = CompileMetrics()
        self._precompiled_calls = _precompiled_calls(self.model)
        self._before = (
            {id(m) for m in _compat.compilation_metrics() or []},
            Counter(_compat.dynamo_counters("graph_break")),
            Counter(_compat.dynamo_counters("unimplemented")),
            graph_log_cursor(),
            time.perf_counter(),
        )
        return self.metrics

    def stop(self) -> CompileMetrics:
        """Closes the window and fills in the metrics of what compiled inside it.

        Raises:
            RuntimeError: :meth:`start` was not called.
        """
        if self._before is None or self.metrics is None:
            raise RuntimeError("Tracker.stop() called before start()")
        before_ids, breaks_before, unsupported_before, cursor, start = self._before
        self._before = None
        metrics = self.metrics
        metrics.wall_seconds = time.perf_counter() - start
        records_now = _compat.compilation_metrics()
        _fill_times(metrics, [m for m in records_now or [] if id(m) not in before_ids])
        _mark_unavailable(
            metrics, None if records_now is None else _compat.compilation_metric_fields()
        )
        breaks = Counter(_compat.dynamo_counters("graph_break")) - breaks_before
        metrics.graph_breaks = dict(breaks)
        metrics.unsupported = dict(
            Counter(_compat.dynamo_counters("unimplemented")) - unsupported_before
        )
        records = records_since(cursor)
        if self.model is not None:
            records = [r for r in records if r.model_id == id(self.model)]
        metrics.graphs = len(records)
        metrics.precompiled = _precompiled_calls(self.model) > self._precompiled_calls or any(
            r.precompiled for r in records
        )
        _fill_regions(metrics, self.model, records)
        return metrics


@contextlib.contextmanager
def track(model: nn.Module | None = None) -> Iterator[CompileMetrics]:
    """Collects :class:`CompileMetrics` for the compiles that happen inside the block.

    Args:
        model: A model compiled by :func:`aotdist.compile_regions`; its region reuse is
            reported. Without it, region stats cover every aotdist model compiled.

    Yields:
        A :class:`CompileMetrics`, filled in when the block exits.
    """
    tracker = Tracker(model)
    metrics = tracker.start()
    try:
        yield metrics
    finally:
        tracker.stop()


def _precompiled_calls(model: nn.Module | None) -> int:
    state = vars(model).get(STATE_ATTR) if model is not None else None
    return sum(saved.calls for saved in _saved_graphs(state)) if state is not None else 0


def _saved_graphs(state) -> list:
    """The saved graphs a model loaded from its cache bundle (whole model, or per frame)."""
    rec = state.hooks.cache
    if rec is None:  # no cache configured
        return []
    return [s for s in (rec.precompiled, *rec.frame_precompiled.values()) if s is not None]


def _fill_times(metrics: CompileMetrics, entries: list) -> None:
    for cm in entries:
        if getattr(cm, "is_runtime", False):
            # run-time work torch logs in the same table (recording a CUDA graph under
            # mode="reduce-overhead", after the compile): no frame compiled, nothing to add
            continue
        inductor = _us(cm, "inductor_cumulative_compile_time_us")
        if getattr(cm, "is_forward", None):
            total = _us(cm, "dynamo_cumulative_compile_time_us")
            aot = _us(cm, "aot_autograd_cumulative_compile_time_us")
            metrics.frames_compiled += 1
            metrics.dynamo_seconds += max(total - aot, 0.0)
            metrics.aot_autograd_seconds += max(aot - inductor, 0.0)
            if getattr(cm, "recompile_reason", None):
                metrics.recompiles.append(cm.recompile_reason)
        else:  # a lazily compiled backward graph
            total = _us(cm, "backward_cumulative_compile_time_us")
            metrics.aot_autograd_seconds += max(total - inductor, 0.0)
        metrics.backend_seconds += inductor
        metrics.compile_seconds += total
        if getattr(cm, "fail_type", None):
            metrics.failures.append(f"{cm.fail_type}: {cm.fail_reason}")


def _mark_unavailable(metrics: CompileMetrics, fields: frozenset[str] | None) -> None:
    """Figures whose source fields this torch lacks become ``None``, not a silent 0."""
    for figure, needs in _NEEDS.items():
        if fields is None or not set(needs) <= fields:
            setattr(metrics, figure, None)


def _fill_regions(metrics: CompileMetrics, model: nn.Module | None, records) -> None:
    state = vars(model).get(STATE_ATTR) if model is not None else None
    if state is not None:
        for region in state.plan:
            metrics.regions[region.name] = RegionStats(instances=region.count)
        metrics.mode = state.settings.mode
        metrics.fixes = dict(state.applied.fixes)
        metrics.demoted = dict(state.applied.demoted)
        metrics.eager = dict(state.log.eager)
        metrics.reuse = dict(state.log.reuse)
        metrics.precompile_misses = [
            miss for saved in _saved_graphs(state) for miss in saved.misses
        ]
    subgraphs: dict[str, set[str]] = {}
    inlined: dict[str, set[str]] = {}
    within: dict[str, tuple[str, set[str]]] = {}
    seen: set[str] = set()
    for rec in records:
        for name, sites in rec.call_sites.items():
            metrics.regions.setdefault(name, RegionStats(instances=0)).call_sites += len(sites)
            seen.update(sites)
        for name, ids in rec.subgraphs.items():
            subgraphs.setdefault(name, set()).update(ids)
        for name, fqns in rec.inlined.items():
            inlined.setdefault(name, set()).update(fqns)
            seen.update(fqns)
        for name, (holder, fqns) in rec.within.items():
            within.setdefault(name, (holder, set()))[1].update(fqns)
            seen.update(fqns)
    for name, (holder, fqns) in within.items():
        st = metrics.regions.setdefault(name, RegionStats(instances=0))
        st.within, st.within_instances = holder, len(fqns)
    outers = sorted({r.outer for r in records if r.outer and r.call_sites})
    metrics.outer = "+".join(outers)
    for rec in records:
        if rec.standalone is not None:
            metrics.regions.setdefault(rec.standalone, RegionStats(instances=0))
            metrics.regions[rec.standalone].standalone_graphs += 1
    for name, ids in subgraphs.items():
        metrics.regions[name].subgraphs = len(ids)
    for name, fqns in inlined.items():
        metrics.regions.setdefault(name, RegionStats(instances=0)).inlined = len(fqns)
    if state is not None and state.settings.mode == CompileMode.FRAMES:
        # Each region is its own compiled function: its call sites are the instances that
        # ran it (since compile), its distinct graphs the frames compiled for it.
        for name, st in metrics.regions.items():
            st.call_sites = len(state.log.frame_calls.get(name, ()))
            st.subgraphs = st.standalone_graphs
    elif state is not None and seen:  # a window that compiled the model's graph
        for region in state.plan:
            if region.name in metrics.regions and region.name not in (
                *state.applied.demoted,
                *state.log.eager,
            ):
                unseen = tuple(f for f in region.fqns if f not in seen)
                metrics.regions[region.name].unseen = unseen


def model_records(model: nn.Module) -> list[GraphRecord]:
    """Every graph recorded for ``model`` since it was compiled by aotdist."""
    state = vars(model).get(STATE_ATTR)
    if state is None or state.backend is None:
        return []
    return list(state.backend.records)
