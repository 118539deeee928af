"""The recording backend: what each compiled graph holds, then the real backend.

:class:`RecordingBackend` wraps the backend :func:`aotdist.compile_regions` was given. For
every FX graph Dynamo hands over it records which region instances call an
``invoke_subgraph`` (call sites), which distinct subgraphs each region has, and which
instances were inlined instead (:class:`GraphRecord`, read by :mod:`aotdist.metrics`).
It also decides three things about how a graph compiles:

- a graph that resizes an input's storage (the FSDP pattern) or calls a region with
  complex tensors is compiled by aotdist's repaired AOTAutograd backend
  (:mod:`aotdist.backends.aot`); when the backend cannot be rebuilt, the first runs
  eagerly and the region of the second is demoted, each with a warning;
- a backend failure on a region's ``invoke_subgraph`` becomes a ``RegionCaptureError``
  naming the regions, so :mod:`aotdist.compile.guard` can fix or demote exactly those;
- a graph holding regions is partitioned with reductions recomputable (docs/internals.md).
"""

from __future__ import annotations

import contextlib
import operator
import re
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from aotdist import _compat
from aotdist.backends.aot import REBUILT, aot_backend, backend_name, storage_resized_inputs
from aotdist.backends.recompute import saving_checkpoint_boundaries
from aotdist.errors import RegionCaptureError, RegionCompileWarning, exception_chain
from aotdist.fixes import run_graph_passes
from aotdist.log import rank_zero_warn

# Every RecordingBackend appends here, so track() can see graphs compiled in its window;
# readers hold a cursor (graph_log_cursor) and ask for the records since (records_since).
_GRAPH_LOG: list[GraphRecord] = []
_MAX_LOG = 10_000
_appended = 0  # records ever appended: a cursor survives the log's trimming


class DryRunDone(Exception):  # noqa: N818 - a signal, not an error
    """Raised by a dry-run backend once the graph is traced: the call stops, nothing ran."""


def graph_log_cursor() -> int:
    """A cursor into the process-wide graph log: pass it to :func:`records_since`."""
    return _appended


def records_since(cursor: int) -> list[GraphRecord]:
    """Every graph recorded (by any model) since ``cursor`` was taken, oldest first."""
    kept = _appended - cursor
    return list(_GRAPH_LOG[-kept:]) if kept > 0 else []


def append_record(record: GraphRecord) -> None:
    """Adds a graph compiled elsewhere (a saved whole-model graph, loaded) to the log."""
    record.index = _appended
    _append(record)


def _append(record: GraphRecord) -> None:
    global _appended
    _GRAPH_LOG.append(record)
    del _GRAPH_LOG[:-_MAX_LOG]
    _appended += 1


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
    precompiled: bool = False  # loaded from a cache bundle's saved graph, not compiled here
    # Inductor's graphs: "fx" when only the region bodies were lowered, else "inductor"
    outer: str | None = None
    # region name -> per call site, each operand's (shape, dtype, stride, requires_grad)
    operands: dict[str, list[tuple]] = field(default_factory=dict)
    # region name -> (the region whose subgraph holds its ops, the instance fqns): a region
    # nested in another, called once per outer body, which torch inlines there
    within: dict[str, tuple[str, set[str]]] = field(default_factory=dict)


_PATH_TOKEN = re.compile(
    r"\._modules\[['\"]([^'\"]+)['\"]\]|\[['\"]([^'\"]+)['\"]\]|\[(\d+)\]|\.(\w+)"
)


_GETATTR = re.compile(r"getattr\(((?:(?!getattr\().)*?), ['\"]([^'\"]+)['\"]\)")


def module_path_to_fqn(path: str) -> str:
    """``L['self'].blocks.1`` / ``L['self']._modules['blocks']._modules['1']`` -> ``blocks.1``.

    Also read: ``__dict__['_modules'][...]`` (a class that defines ``__getattr__``:
    diffusers' ``ModelMixin``, peft's models), ``getattr(..., 'x')``, ``[0]`` indices and
    the ``_orig_mod`` of an ``OptimizedModule`` (an outer ``torch.compile``).
    """
    path = path.strip()
    while (unwrapped := _GETATTR.sub(r"\1.\2", path)) != path:  # innermost first
        path = unwrapped
    path = re.sub(r"\.__dict__\[['\"]_modules['\"]\]", "._modules", path)
    if re.match(r"^L\[['\"][^'\"]+['\"]\]\[", path):
        return ""  # rooted at an argument (L['args'][0]): a frame compiled on its own
    path = re.sub(r"^L\[['\"][^'\"]+['\"]\]", "", path)
    path = re.sub(r"^\.__self__", "", path)  # root compiled as model._call_impl: L['fn'].__self__
    parts = [next(g for g in m.groups() if g is not None) for m in _PATH_TOKEN.finditer(path)]
    return ".".join(p for p in parts if p != "_orig_mod")


def _operand_kind(arg: object) -> tuple | None:
    value = arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return None
    return (tuple(value.shape), value.dtype, value.stride(), value.requires_grad)


def _nodes_outside_regions(gm: torch.fx.GraphModule, invoke) -> Iterator[torch.fx.Node]:
    """Nodes of ``gm`` and of the bodies of its other higher-order ops (activation
    checkpointing wraps regions in one), but not of region subgraphs themselves."""
    for node in gm.graph.nodes:
        yield node
        if node.op != "call_function" or node.target is invoke:
            continue
        if isinstance(node.target, _compat.higher_order_operator_type() or ()):
            for arg in node.args:
                if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
                    body = submodule(gm, arg.target)
                    if isinstance(body, torch.fx.GraphModule):
                        yield from _nodes_outside_regions(body, invoke)


def submodule(gm: torch.fx.GraphModule, target: object) -> Any:
    """The submodule a ``get_attr`` names, dotted paths included (a subgraph nested in a
    subgraph: ``repeated_subgraph7.repeated_subgraph1``); ``None`` if there is none."""
    try:
        return gm.get_submodule(str(target))
    except AttributeError:
        return None


def _stack(node: torch.fx.Node, prefix: str) -> list[tuple[str, object]]:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    entries = []
    for v in stack.values():
        if isinstance(v, tuple):
            fqn = module_path_to_fqn(v[0])
            if prefix and _SELF_PATH.match(v[0].strip()):
                fqn = f"{prefix}.{fqn}" if fqn else prefix
            entries.append((fqn, v[1] if len(v) > 1 else None))
    return entries


def stack_regions(
    node: torch.fx.Node, fqn_to_region: dict[str, str], prefix: str = ""
) -> list[tuple[str, str]]:
    """``(instance fqn, region)`` for each region instance on ``node``'s module stack,
    outermost first. The region is read from the class marking gave the instance (its
    ``_aotdist_region``), so it never depends on how Dynamo spells the path; the fqn is
    the path as read, ``"?"`` where it names no instance of that region."""
    regions = set(fqn_to_region.values())
    found = []
    for fqn, cls in _stack(node, prefix):
        region = getattr(cls, "_aotdist_region", None) if isinstance(cls, type) else None
        if region not in regions:
            region = None
        by_path = fqn_to_region.get(fqn)
        if region is None and by_path is not None:
            region = by_path  # a class not marked here (frames mode's FSDP class is)
        if region is not None:
            found.append((fqn if by_path == region else "?", region))
    return found


_SELF_PATH = re.compile(r"^L\[['\"]self['\"]\]")


class RecordingBackend:
    """A ``torch.compile`` backend that records each graph's region reuse, then delegates.

    Attributes the wrapped backend exposes (``compiler_name``, ``get_compiler_config``...)
    are forwarded, so Dynamo treats it as the backend it wraps.
    """

    dry_run = False  # set per instance by aotdist.compile.isolate for its trials
    recompute_reductions = True  # a backend unpickled from before the option had it on

    def __init__(
        self,
        inner: Callable,
        *,
        model: nn.Module | None = None,
        plan=None,
        keep_graphs: bool = False,
        region_frame: str | None = None,
        outer: str | None = None,
        recompute_reductions: bool = True,
    ):
        self.inner = _compat.lookup_backend(inner) if isinstance(inner, str) else inner
        # "fx": Inductor compiles region bodies only (aotdist.backends.regional)
        self.outer = outer if backend_name(self.inner) == "inductor" else None
        self.plan = plan
        self.region_frame = region_frame  # every graph is this region's frame (a re-trace)
        # False for outer="eager" (a short run): its regions save their norm statistics,
        # per-block compile's partition, for the shorter backward compile (docs/internals.md)
        self.recompute_reductions = recompute_reductions
        self.keep_graphs = keep_graphs
        self.dry_run = False
        self._model_id = id(model) if model is not None else 0
        self._model_ref = weakref.ref(model) if model is not None else None
        self._fqn_to_region = {f: r.name for r in plan for f in r.fqns} if plan else {}
        self.records: list[GraphRecord] = []

    def __getattr__(self, name: str):
        if name == "inner":  # not yet set (during unpickling): avoid recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        run_graph_passes(gm)  # aotdist.fixes: layout merge, single-use inlining, buffer writes
        if self.dry_run:  # a trial (aotdist.compile.isolate): trace the joint graph, stop
            if not storage_resized_inputs(gm):
                aot_eager, _ = _compat.aot_eager_parts()
                aot_eager(gm, example_inputs)
            raise DryRunDone()
        record = GraphRecord(
            index=_appended,
            model_id=self._model_id,
            num_ops=sum(1 for n in gm.graph.nodes if n.op == "call_function"),
            backend_seconds=0.0,
            gm=gm if self.keep_graphs else None,
        )
        node_regions = self._analyse(gm, record)
        # complex regions need the conjugate views resolved before their calls
        complex_regions = _complex_regions(gm, node_regions)
        if complex_regions and not self._rebuilds():
            raise RegionCaptureError(complex_regions, _COMPLEX)
        _warn_autograd_function_splits(gm, node_regions)
        record.standalone = self.region_frame or self._standalone_region()
        record.outer = self.outer_for(gm)
        start = time.perf_counter()
        # Regions recompute norm statistics rather than save them (docs/internals.md).
        regions = bool(record.call_sites) or record.standalone is not None
        recompute = regions and self.recompute_reductions
        try:
            # A passed CPU vector-ISA load check is remembered across processes (torch
            # 2.11 would start a Python per ISA in every process, warm starts included);
            # Triton kernels from a cache entry find their autotuning under this cache dir.
            with (
                _compat.recomputable_reductions() if recompute else contextlib.nullcontext(),
                _compat.flat_nested_subgraph_refs() if regions else contextlib.nullcontext(),
                _compat.remembered_isa_loads(),
                _compat.rerooted_autotune_lookups(),
            ):
                compiled = self._compile(gm, example_inputs, rebuild=bool(complex_regions))
        except Exception as exc:
            if inner := _nested_regions_failing(exc, self.plan):
                raise RegionCaptureError(inner, f"{_NESTED}{_first_error_line(exc)})") from exc
            failing = _regions_named_in(exc, node_regions)
            if failing:
                raise RegionCaptureError(failing, _first_error_line(exc)) from exc
            raise
        record.backend_seconds = time.perf_counter() - start
        self.records.append(record)
        _append(record)
        return compiled

    def _rebuilds(self) -> bool:
        """Whether graphs can compile through aotdist's AOTAutograd pipeline, with its
        graph repairs (a named ``aot_eager`` or ``inductor``, or one that has them)."""
        return (
            getattr(self.inner, "_aotdist_fixes_resizes", False)
            or backend_name(self.inner) in REBUILT
        )

    def _compile(self, gm: torch.fx.GraphModule, example_inputs, *, rebuild: bool = False):
        """The inner backend, unless ``gm`` resizes an input's storage (the FSDP pattern)
        or ``rebuild`` (a region with complex tensors): aotdist's repaired AOTAutograd
        pipeline compiles it then (torch 2.15 would segfault on the resize; a complex
        region's backward would fail on a conjugate view), or, for a resize and a backend
        aotdist cannot rebuild, the graph runs eagerly (with a warning)."""
        with saving_checkpoint_boundaries():  # checkpointed regions recomputed one by one
            return self._compile_inner(gm, example_inputs, rebuild=rebuild)

    def _compile_inner(self, gm: torch.fx.GraphModule, example_inputs, *, rebuild: bool):
        if getattr(self.inner, "_aotdist_fixes_resizes", False):
            return self.inner(gm, example_inputs)
        resized = storage_resized_inputs(gm)
        outer = self.outer_for(gm) or "inductor"
        # aot_eager around regions: aotdist's build, whose partitioner saves what the
        # backward needs (aotdist.backends.partition)
        around_regions = backend_name(self.inner) == "aot_eager" and _calls_regions(gm)
        if not resized and not rebuild and outer == "inductor" and not around_regions:
            return self.inner(gm, example_inputs)
        repaired = aot_backend(self.inner, outer=outer)
        if repaired is not None:
            return repaired(gm, example_inputs)
        rank_zero_warn(
            f"a compiled graph resizes the storage of {resized} (the FSDP pattern); with "
            f"torch 2.15 compiling it with backend {self.inner!r} would crash the process, so "
            "it runs eagerly. Fix: use backend='aot_eager' or 'inductor', which aotdist repairs.",
            RegionCompileWarning,
            stacklevel=2,
        )
        return gm.forward

    def outer_for(self, gm: torch.fx.GraphModule) -> str | None:
        """How Inductor compiles ``gm`` (``None``: not Inductor): ``"fx"`` when it calls
        regions and ``compile.outer`` resolved to ``fx``, else ``"inductor"``."""
        if self.outer is None:
            return None
        return "fx" if self.outer == "fx" and _calls_regions(gm) else "inductor"

    def _analyse(self, gm: torch.fx.GraphModule, record: GraphRecord) -> dict[str, str]:
        """Fills ``record``; returns invoke_subgraph node name -> region name."""
        invoke = torch.ops.higher_order.invoke_subgraph
        node_regions: dict[str, str] = {}
        prefix = self.frame_prefix()
        for node in _nodes_outside_regions(gm, invoke):
            if node.op != "call_function":
                continue
            if node.target is operator.getitem and getattr(node.args[0], "target", None) is invoke:
                continue  # unpacking a region's outputs is not an inlined op
            found = stack_regions(node, self._fqn_to_region, prefix)
            fqn, region = found[-1] if found else ("?", None)
            if node.target is invoke:
                ident = str(node.args[1])
                region = region or "<unknown>"
                record.call_sites.setdefault(region, []).append(fqn)
                record.subgraphs.setdefault(region, set()).add(f"{record.index}:{ident}")
                record.operands.setdefault(region, []).append(
                    tuple(_operand_kind(a) for a in node.args[2:])
                )
                node_regions[node.name] = region
                self._nested_calls(gm, node, fqn, region, record, prefix)
            elif region is not None:
                record.inlined.setdefault(region, set()).add(fqn)
        for region, fqns in list(record.inlined.items()):
            # An instance that is also a call site ran as the subgraph: its nodes outside
            # are the call's glue (aotdist's de-aliasing clones), not an inlined body.
            fqns.difference_update(record.call_sites.get(region, ()))
            if not fqns:
                del record.inlined[region]
        return node_regions

    def _nested_calls(
        self, gm: torch.fx.GraphModule, call, fqn: str, region: str, record, prefix: str
    ) -> None:
        """Counts the region calls inside region ``call``'s subgraph (a region nested in
        another: timm's LeViT MLPs) as call sites, once per call of the outer one. The body
        was traced for one outer instance, whose path its nodes carry: each is read as
        the same path under ``fqn``, the instance this call runs."""
        invoke = torch.ops.higher_order.invoke_subgraph
        body = submodule(gm, call.args[0].target) if call.args[0].op == "get_attr" else None
        if not isinstance(body, torch.fx.GraphModule):
            return
        outer = [f for f, r in self._fqn_to_region.items() if r == region]
        for node in body.graph.nodes:
            if node.op != "call_function":
                continue
            found = stack_regions(node, self._fqn_to_region, prefix)
            traced, inner = found[-1] if found else ("?", None)
            owner = next((f for f in outer if traced.startswith(f + ".")), None)
            here = fqn + traced[len(owner) :] if owner is not None else traced
            if node.target is not invoke:
                if inner is not None and inner != region:  # inlined in the outer body
                    record.within.setdefault(inner, (region, set()))[1].add(here)
                continue
            inner = inner or "<unknown>"
            record.call_sites.setdefault(inner, []).append(here)
            record.subgraphs.setdefault(inner, set()).add(f"{record.index}:{node.args[1]}")
            self._nested_calls(body, node, here, inner, record, prefix)

    def frame_prefix(self) -> str:
        """The fqn that the module paths of the frame being compiled are relative to:
        after a graph break in the root's forward, Dynamo compiles a submodule's forward
        (BigBird's) as a frame of its own, whose ``L['self']`` is that submodule. Empty
        for the root and for a region's own frame."""
        frame = None if self.region_frame else self._frame_fqn()
        return frame if frame and frame not in self._fqn_to_region else ""

    def _standalone_region(self) -> str | None:
        """The region whose instance is the frame being compiled, if it is one.

        After a graph break outside the regions (say, in the loop over blocks), Dynamo
        compiles each block call as a frame of its own: no invoke_subgraph, but the frame's
        code is compiled once and reused by every instance.
        """
        fqn = self._frame_fqn()
        return self._fqn_to_region.get(fqn) if fqn is not None else None

    def _frame_fqn(self) -> str | None:
        """The fqn in the model of the module whose forward Dynamo is compiling now (its
        ``self``, or the first argument of a ``Module.__call__`` frame), if any."""
        model = self._model_ref() if self._model_ref is not None else None
        if model is None:
            return None
        f_locals = _compat.current_frame_locals()
        if f_locals is None:  # not inside a Dynamo frame compile: nothing to attribute
            return None
        candidates = [f_locals.get("self")]
        args = f_locals.get("args")
        if isinstance(args, tuple) and args:
            candidates.append(args[0])
        by_id = {id(m): f for f, m in model.named_modules()}
        for obj in candidates:
            fqn = by_id.get(id(obj))
            if fqn in self._fqn_to_region:
                return fqn
        return next((by_id[id(o)] for o in candidates if id(o) in by_id), None)


def _calls_regions(gm: torch.fx.GraphModule) -> bool:
    invoke = torch.ops.higher_order.invoke_subgraph
    return bool(gm.graph.find_nodes(op="call_function", target=invoke))


_COMPLEX = (
    "it handles complex tensors, and its backend is not one aotdist rebuilds: "
    "invoke_subgraph's backward would fail with \"could not find kernel for "
    'invoke_subgraph at dispatch key Conjugate" (torch). Fix: compile with '
    "backend='aot_eager' or 'inductor' (aotdist resolves the conjugate views before "
    "each region call), keep the complex math outside the region (pass real views, "
    "torch.view_as_real), or accept it compiled inline"
)


def _complex_regions(gm: torch.fx.GraphModule, node_regions: dict[str, str]) -> list[str]:
    """Regions whose ``invoke_subgraph`` call takes, returns or computes a complex tensor
    (e.g. Llama 4's complex rotary embedding). Their backward call fails at run time, after
    the forward ran, where no retry can demote them, unless aotdist's rebuilt backend
    resolves the conjugate views first; under any other backend they are demoted here."""
    found: list[str] = []
    for node in gm.graph.nodes:
        region = node_regions.get(node.name)
        if region is None or region in found or region == "<unknown>":
            continue
        nodes = [node, *(a for a in node.args[2:] if isinstance(a, torch.fx.Node))]
        body = node.args[0]
        if isinstance(body, torch.fx.Node) and body.op == "get_attr":
            sub = submodule(gm, body.target)
            if isinstance(sub, torch.fx.GraphModule):
                nodes += list(sub.graph.nodes)
        if any(_has_complex(n.meta.get("example_value", n.meta.get("val"))) for n in nodes):
            found.append(region)
    return found


def _has_complex(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_complex()
    return isinstance(value, (list, tuple)) and any(_has_complex(v) for v in value)


_NESTED = (
    "torch cannot trace this region's subgraph inside another region's here (its "
    "subgraph nested in a subgraph is looked up by a dotted name: "
)


def _nested_regions_failing(exc: BaseException, plan: Any) -> list[str]:
    """The regions with an instance inside another region's instance, when ``exc`` is torch
    failing to look up a subgraph nested in a subgraph (torch 2.14's AOT trace of nested
    ``invoke_subgraph``: ``no attribute 'repeated_subgraph7.repeated_subgraph1'``): those
    are compiled inline in the outer region, which stays reused."""
    if plan is None or not any(
        re.search(r"has no attribute '\w+\.\w+'", str(e)) for e in exception_chain(exc)
    ):
        return []
    outer = [f for r in plan for f in r.fqns]
    return [r.name for r in plan if any(f.startswith(o + ".") for f in r.fqns for o in outer)]


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


def _warn_autograd_function_splits(gm: torch.fx.GraphModule, node_regions: dict[str, str]) -> None:
    """Warns (once per graph and region) when a region's call sites got distinct subgraphs
    because its forward calls a ``torch.autograd.Function`` (traced as a fresh trampoline
    per call site on some torch releases: correct, but not reused; docs/internals.md)."""
    bodies: dict[str, set[str]] = {}
    for node in gm.graph.nodes:
        region = node_regions.get(node.name)
        if region is not None and region != "<unknown>":
            bodies.setdefault(region, set()).add(str(node.args[0].target))
    for region, names in bodies.items():
        if len(names) < 2:
            continue
        graphs = [
            b.graph for name in names if isinstance(b := submodule(gm, name), torch.fx.GraphModule)
        ]
        if not any(
            "trampoline_autograd_apply" in getattr(n.target, "__name__", "")
            for g in graphs
            for n in g.nodes
            if n.op == "call_function"
        ):
            continue
        rank_zero_warn(
            f"aotdist region {region!r}: its call sites compiled as {len(names)} distinct "
            "subgraphs, not one: its forward calls a torch.autograd.Function (e.g. "
            f"torchao Float8Linear), and torch {torch.__version__} cannot reuse a subgraph "
            "that does (each trace gets a fresh autograd-function trampoline). Results are "
            "correct; compile time grows with the call sites. torch 2.15 reuses it.",
            RegionCompileWarning,
            stacklevel=3,
        )
