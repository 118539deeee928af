"""Compile metrics: time by phase, graphs, graph breaks, recompiles, region reuse.

Two sources, both read without changing any compiler setting:

* ``torch._dynamo.utils.get_compilation_metrics()``: one record per Dynamo frame
  compile (and per lazily compiled backward) with cumulative times for Dynamo,
  AOTAutograd and Inductor, the recompile reason and the failure, if any;
  ``torch._dynamo.utils.counters["graph_break"]`` for graph-break reasons.
* :class:`RecordingBackend`, the backend wrapper :func:`aotdist.compile_regions`
  installs: it sees every FX graph Dynamo hands over, counts the ``invoke_subgraph``
  call sites and distinct subgraphs of each region, then delegates to the real backend.

Use :func:`track` around the first training step(s)::

    with aotdist.metrics.track(model) as m:
        loss = model(x).sum(); loss.backward()
    print(m.summary())
"""

from __future__ import annotations

import contextlib
import operator
import re
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from aotdist.errors import RegionCaptureError, RegionCompileWarning

__all__ = ["CompileMetrics", "GraphRecord", "RecordingBackend", "RegionStats", "track"]

# Every RecordingBackend appends here, so track() can see graphs compiled in its window.
_GRAPH_LOG: list[GraphRecord] = []
_MAX_LOG = 10_000


@dataclass
class GraphRecord:
    """One FX graph Dynamo handed to the backend."""

    index: int
    model_id: int
    num_ops: int
    backend_seconds: float
    # region name -> instance fqns that call its subgraph, and the subgraph identifiers
    call_sites: dict[str, list[str]] = field(default_factory=dict)
    subgraphs: dict[str, set[str]] = field(default_factory=dict)
    # region name -> instance fqns whose ops were inlined into this graph
    inlined: dict[str, set[str]] = field(default_factory=dict)
    # region compiled as a frame of its own (after a graph break outside it), if any
    standalone: str | None = None
    gm: Any = None


@dataclass
class RegionStats:
    """Reuse of one region: the goal is ``subgraphs == 1`` and ``call_sites == instances``."""

    instances: int
    call_sites: int = 0
    subgraphs: int = 0
    inlined: int = 0
    standalone_graphs: int = 0  # graphs of the region compiled as frames of their own


@dataclass
class CompileMetrics:
    """What compiling cost and produced within one :func:`track` window (seconds)."""

    compile_seconds: float = 0.0
    dynamo_seconds: float = 0.0
    aot_autograd_seconds: float = 0.0
    backend_seconds: float = 0.0
    wall_seconds: float = 0.0
    frames_compiled: int = 0
    graphs: int = 0
    graph_breaks: dict[str, int] = field(default_factory=dict)
    # Dynamo errors that made it skip a frame or fall back to eager (counters["unimplemented"])
    unsupported: dict[str, int] = field(default_factory=dict)
    recompiles: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    regions: dict[str, RegionStats] = field(default_factory=dict)
    fixes: dict[str, str] = field(default_factory=dict)
    demoted: dict[str, str] = field(default_factory=dict)
    # "graph": one whole-model graph calling region subgraphs; "frames": each region its
    # own compiled graph (under FSDP2); "" when no aotdist model was tracked
    mode: str = ""

    @property
    def num_graph_breaks(self) -> int:
        return sum(self.graph_breaks.values())

    def to_dict(self) -> dict:
        """JSON-able copy."""
        d = asdict(self)
        d["num_graph_breaks"] = self.num_graph_breaks
        return d

    def summary(self) -> str:
        """A compact multi-line text report."""
        lines = [
            f"compile {self.compile_seconds:.2f}s (dynamo {self.dynamo_seconds:.2f}s, "
            f"aot_autograd {self.aot_autograd_seconds:.2f}s, backend {self.backend_seconds:.2f}s)"
            f" | frames {self.frames_compiled} | graphs {self.graphs} | "
            f"graph breaks {self.num_graph_breaks} | recompiles {len(self.recompiles)}"
            + (f" | mode {self.mode}" if self.mode else ""),
        ]
        for name, st in self.regions.items():
            extra = f", {st.inlined} inlined" if st.inlined else ""
            if st.standalone_graphs:
                extra += f", {st.standalone_graphs} standalone frame graph(s)"
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
        return "\n".join(lines)


_PATH_TOKEN = re.compile(r"\._modules\[['\"]([^'\"]+)['\"]\]|\[['\"]([^'\"]+)['\"]\]|\[(\d+)\]|\.(\w+)")


def module_path_to_fqn(path: str) -> str:
    """``L['self'].blocks.1`` / ``L['self']._modules['blocks']._modules['1']`` -> ``blocks.1``."""
    path = path.strip()
    if re.match(r"^L\[['\"][^'\"]+['\"]\]\[", path):
        return ""  # rooted at an argument (L['args'][0]): a frame compiled on its own
    path = re.sub(r"^L\[['\"][^'\"]+['\"]\]", "", path)
    path = re.sub(r"^\.__self__", "", path)  # root compiled as model._call_impl: L['fn'].__self__
    path = re.sub(r"getattr\((.*?), ['\"]([^'\"]+)['\"]\)", r"\1.\2", path)
    parts = [next(g for g in m.groups() if g is not None) for m in _PATH_TOKEN.finditer(path)]
    return ".".join(parts)


def _nodes_outside_regions(gm: torch.fx.GraphModule, invoke) -> Iterator[torch.fx.Node]:
    """Nodes of ``gm`` and of the bodies of its other higher-order ops (activation
    checkpointing wraps regions in one), but not of region subgraphs themselves."""
    for node in gm.graph.nodes:
        yield node
        if node.op != "call_function" or node.target is invoke:
            continue
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            for arg in node.args:
                if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
                    body = getattr(gm, str(arg.target), None)
                    if isinstance(body, torch.fx.GraphModule):
                        yield from _nodes_outside_regions(body, invoke)


def _stack_fqns(node: torch.fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [module_path_to_fqn(v[0]) for v in stack.values() if isinstance(v, tuple)]


class RecordingBackend:
    """A ``torch.compile`` backend that records each graph's region reuse, then delegates.

    Attributes the wrapped backend exposes (``compiler_name``, ``get_compiler_config``...)
    are forwarded, so Dynamo treats it as the backend it wraps.
    """

    def __init__(self, inner: Callable, *, model: nn.Module | None = None, plan=None,
                 keep_graphs: bool = False):
        self.inner = torch._dynamo.lookup_backend(inner) if isinstance(inner, str) else inner
        self.plan = plan
        self.keep_graphs = keep_graphs
        self._model_id = id(model) if model is not None else 0
        self._model_ref = weakref.ref(model) if model is not None else None
        self._fqn_to_region = {f: r.name for r in plan for f in r.fqns} if plan else {}
        self.records: list[GraphRecord] = []

    def __getattr__(self, name: str):
        if name == "inner":  # not yet set (during unpickling): avoid recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        record = GraphRecord(
            index=len(_GRAPH_LOG), model_id=self._model_id,
            num_ops=sum(1 for n in gm.graph.nodes if n.op == "call_function"),
            backend_seconds=0.0, gm=gm if self.keep_graphs else None,
        )
        node_regions = self._analyse(gm, record)
        _warn_autograd_function_splits(gm, node_regions)
        record.standalone = self._standalone_region()
        start = time.perf_counter()
        try:
            compiled = self._compile(gm, example_inputs)
        except Exception as exc:
            failing = _regions_named_in(exc, node_regions)
            if failing:
                raise RegionCaptureError(failing, _first_error_line(exc)) from exc
            raise
        record.backend_seconds = time.perf_counter() - start
        self.records.append(record)
        _GRAPH_LOG.append(record)
        del _GRAPH_LOG[:-_MAX_LOG]
        return compiled

    def _compile(self, gm: torch.fx.GraphModule, example_inputs):
        """The inner backend, unless ``gm`` resizes an input's storage (the FSDP pattern):
        torch 2.15 then segfaults, so aotdist's repaired AOTAutograd pipeline compiles it,
        or, for a backend aotdist cannot rebuild, the graph runs eagerly (with a warning)."""
        from aotdist.aot import aot_backend, storage_resized_inputs

        resized = ([] if getattr(self.inner, "_aotdist_fixes_resizes", False)
                   else storage_resized_inputs(gm))
        if not resized:
            return self.inner(gm, example_inputs)
        repaired = aot_backend(self.inner)
        if repaired is not None:
            return repaired(gm, example_inputs)
        warnings.warn(
            f"a compiled graph resizes the storage of {resized} (the FSDP pattern); with "
            f"torch 2.15 compiling it with backend {self.inner!r} would crash the process, so "
            "it runs eagerly. Fix: use backend='aot_eager' or 'inductor', which aotdist repairs.",
            RegionCompileWarning, stacklevel=2,
        )
        return gm.forward

    def _analyse(self, gm: torch.fx.GraphModule, record: GraphRecord) -> dict[str, str]:
        """Fills ``record``; returns invoke_subgraph node name -> region name."""
        invoke = torch.ops.higher_order.invoke_subgraph
        node_regions: dict[str, str] = {}
        for node in _nodes_outside_regions(gm, invoke):
            if node.op != "call_function":
                continue
            if node.target is operator.getitem and getattr(node.args[0], "target", None) is invoke:
                continue  # unpacking a region's outputs is not an inlined op
            fqns = [f for f in _stack_fqns(node) if f in self._fqn_to_region]
            if node.target is invoke:
                ident = str(node.args[1])
                fqn = fqns[-1] if fqns else None
                region = self._fqn_to_region.get(fqn) if fqn else None
                if region is None:
                    region = "<unknown>"
                record.call_sites.setdefault(region, []).append(fqn or "?")
                record.subgraphs.setdefault(region, set()).add(f"{record.index}:{ident}")
                node_regions[node.name] = region
            elif fqns:
                region = self._fqn_to_region[fqns[-1]]
                record.inlined.setdefault(region, set()).add(fqns[-1])
        return node_regions


    def _standalone_region(self) -> str | None:
        """The region whose instance is the frame being compiled, if it is one.

        After a graph break outside the regions (say, in the loop over blocks), Dynamo
        compiles each block call as a frame of its own: no invoke_subgraph, but the frame's
        code is compiled once and reused by every instance.
        """
        model = self._model_ref() if self._model_ref is not None else None
        if model is None:
            return None
        try:
            from torch._dynamo.symbolic_convert import InstructionTranslator

            f_locals = InstructionTranslator.current_tx().f_locals
        except Exception:  # not inside a Dynamo frame compile: nothing to attribute
            return None
        candidates = [f_locals.get("self")]
        args = f_locals.get("args")
        if isinstance(args, tuple) and args:
            candidates.append(args[0])
        by_id = {id(m): f for f, m in model.named_modules()}
        for obj in candidates:
            fqn = by_id.get(id(obj))
            if fqn in self._fqn_to_region:
                return self._fqn_to_region[fqn]
        return None


def _warn_autograd_function_splits(gm: torch.fx.GraphModule, node_regions: dict[str, str]
                                   ) -> None:
    """Warns (once per graph and region) when a region's call sites got distinct subgraphs
    because its forward calls a ``torch.autograd.Function``.

    torch 2.11's Dynamo reuses an ``invoke_subgraph`` only when every ``call_function``
    target of the new trace *is* the previous trace's target
    (``are_same_graph_modules``), and it traces each ``autograd.Function.apply`` (torchao
    ``Float8Linear``'s matmul, for one) as a fresh ``trampoline_autograd_apply`` function.
    Such a region compiles once per call site: correct, but not reused. torch 2.15
    traces autograd.Functions differently and reuses the subgraph.
    """
    bodies: dict[str, set[str]] = {}
    for node in gm.graph.nodes:
        region = node_regions.get(node.name)
        if region is not None and region != "<unknown>":
            bodies.setdefault(region, set()).add(str(node.args[0].target))
    for region, names in bodies.items():
        if len(names) < 2:
            continue
        if not any("trampoline_autograd_apply" in getattr(n.target, "__name__", "")
                   for name in names for n in getattr(gm, name).graph.nodes
                   if n.op == "call_function"):
            continue
        warnings.warn(
            f"aotdist region {region!r}: its call sites compiled as {len(names)} distinct "
            "subgraphs, not one: its forward calls a torch.autograd.Function (e.g. "
            f"torchao Float8Linear), and torch {torch.__version__} cannot reuse a subgraph "
            "that does (each trace gets a fresh autograd-function trampoline). Results are "
            "correct; compile time grows with the call sites. torch 2.15 reuses it.",
            RegionCompileWarning, stacklevel=3,
        )


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and its causes/contexts, innermost last (at most 8)."""
    seen = 0
    while exc is not None and seen < 8:
        yield exc
        exc = exc.__cause__ or exc.__context__
        seen += 1


def _regions_named_in(exc: BaseException, node_regions: dict[str, str]) -> list[str]:
    """Regions whose invoke_subgraph node the backend's error names ("While executing %x")."""
    found: list[str] = []
    for e in exception_chain(exc):
        for name in re.findall(r"While executing %(\w+)", str(e)):
            region = node_regions.get(name)
            if region and region != "<unknown>" and region not in found:
                found.append(region)
    return found


def _first_error_line(exc: BaseException) -> str:
    """The innermost error's first meaningful line, without Dynamo's wrapper text."""
    for e in reversed(list(exception_chain(exc))):
        for line in str(e).splitlines():
            line = line.strip()
            if line and not line.startswith(("backend=", "While executing")):
                return f"{type(e).__name__}: {line}"[:300]
    return type(exc).__name__


def _us(cm, name: str) -> float:
    return (getattr(cm, name, None) or 0) / 1e6


@contextlib.contextmanager
def track(model: nn.Module | None = None) -> Iterator[CompileMetrics]:
    """Collects :class:`CompileMetrics` for the compiles that happen inside the block.

    Args:
        model: A model compiled by :func:`aotdist.compile_regions`; its region reuse is
            reported. Without it, region stats cover every aotdist model compiled.

    Yields:
        A :class:`CompileMetrics`, filled in when the block exits.
    """
    from torch._dynamo.utils import counters, get_compilation_metrics

    before_ids = {id(m) for m in get_compilation_metrics()}
    breaks_before = Counter(counters["graph_break"])
    unsupported_before = Counter(counters["unimplemented"])
    log_start = len(_GRAPH_LOG)
    log_tail = _GRAPH_LOG[-1] if _GRAPH_LOG else None
    metrics = CompileMetrics()
    start = time.perf_counter()
    try:
        yield metrics
    finally:
        metrics.wall_seconds = time.perf_counter() - start
        new = [m for m in get_compilation_metrics() if id(m) not in before_ids]
        _fill_times(metrics, new)
        breaks = Counter(counters["graph_break"]) - breaks_before
        metrics.graph_breaks = dict(breaks)
        metrics.unsupported = dict(Counter(counters["unimplemented"]) - unsupported_before)
        if log_tail is not None and log_tail in _GRAPH_LOG:
            log_start = _GRAPH_LOG.index(log_tail) + 1
        records = _GRAPH_LOG[log_start:]
        if model is not None:
            records = [r for r in records if r.model_id == id(model)]
        metrics.graphs = len(records)
        _fill_regions(metrics, model, records)


def _fill_times(metrics: CompileMetrics, entries: list) -> None:
    for cm in entries:
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


def _fill_regions(metrics: CompileMetrics, model: nn.Module | None, records) -> None:
    from aotdist.compile import STATE_ATTR

    state = vars(model).get(STATE_ATTR) if model is not None else None
    if state is not None:
        for region in state.plan:
            metrics.regions[region.name] = RegionStats(instances=region.count)
        metrics.mode = state.mode
        metrics.fixes = dict(state.fixes)
        metrics.demoted = dict(state.demoted)
    subgraphs: dict[str, set[str]] = {}
    inlined: dict[str, set[str]] = {}
    for rec in records:
        for name, sites in rec.call_sites.items():
            metrics.regions.setdefault(name, RegionStats(instances=0)).call_sites += len(sites)
        for name, ids in rec.subgraphs.items():
            subgraphs.setdefault(name, set()).update(ids)
        for name, fqns in rec.inlined.items():
            inlined.setdefault(name, set()).update(fqns)
    for rec in records:
        if rec.standalone is not None:
            metrics.regions.setdefault(rec.standalone, RegionStats(instances=0))
            metrics.regions[rec.standalone].standalone_graphs += 1
    for name, ids in subgraphs.items():
        metrics.regions[name].subgraphs = len(ids)
    for name, fqns in inlined.items():
        metrics.regions.setdefault(name, RegionStats(instances=0)).inlined = len(fqns)
    if state is not None and state.mode == "frames":
        # Each region is its own compiled function: its call sites are the instances that
        # ran it (since compile), its distinct graphs the frames compiled for it.
        for name, st in metrics.regions.items():
            st.call_sites = len(state.frame_calls.get(name, ()))
            st.subgraphs = st.standalone_graphs


def model_records(model: nn.Module) -> list[GraphRecord]:
    """Every graph recorded for ``model`` since it was compiled by aotdist."""
    from aotdist.compile import STATE_ATTR

    state = vars(model).get(STATE_ATTR)
    if state is None or state.backend is None:
        return []
    return list(state.backend.records)

