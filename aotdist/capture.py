"""``aotdist.capture``: what AOTAutograd saw, region by region, in one report.

One forward (and backward) step of the model runs through ``torch.compile`` with a
backend built on AOTAutograd (:func:`aotdist.aot.aot_backend`): Dynamo's graph is
recorded first (input sources, tensor subclasses, storage resizes), then every forward,
backward and region subgraph AOTAutograd produces, before the chosen backend compiles
it, so the step runs as it would in training.

- Without FSDP2 the whole model is one graph and each region is an ``invoke_subgraph``
  call: a region's subgraphs are the ``partitioned_fw/bw_subgraph`` modules those calls
  name, its call sites the instances whose calls they are.
- With FSDP2 (``frames`` mode, see :mod:`aotdist.compile`) each region's forward is
  compiled as a graph of its own inside FSDP's hooks; its call sites are the instances
  that ran it, its subgraphs the graphs compiled for it.

Compile state is left as it was: the step is compiled from fresh code objects (no
``torch._dynamo.reset()``, the user's other compiled functions keep their caches),
aotdist's own compiled forwards are put back, and the gradients and buffers the step
changed are restored.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aotdist.aot import aot_backend, backend_name, storage_resized_inputs
from aotdist.compile import STATE_ATTR, _copy_function, mark_regions, unmark_regions
from aotdist.errors import ConfigError, OrderingError
from aotdist.graphs import GraphCapture, analyse_graph, tensor_info
from aotdist.metrics import CompileMetrics, RecordingBackend, module_path_to_fqn, track

__all__ = ["Capture", "RegionCapture", "capture"]


@dataclass
class RegionCapture:
    """What was captured for one region.

    Attributes:
        name: The region's name in the plan.
        module_type: Qualified name of its class.
        instances: FQNs of its instances (from the plan).
        call_sites: FQNs of the instances whose calls reached its compiled subgraph(s).
        num_subgraphs: Distinct forward subgraphs produced for it (1 is the goal).
        inlined: Instances whose ops Dynamo inlined into the surrounding graph instead.
        forward: One :class:`GraphCapture` per distinct forward subgraph.
        backward: One per distinct backward subgraph.
    """

    name: str
    module_type: str
    instances: list[str]
    call_sites: list[str] = field(default_factory=list)
    num_subgraphs: int = 0
    inlined: int = 0
    forward: list[GraphCapture] = field(default_factory=list)
    backward: list[GraphCapture] = field(default_factory=list)

    @property
    def forward_gm(self) -> torch.fx.GraphModule | None:
        return self.forward[0].gm if self.forward else None

    @property
    def backward_gm(self) -> torch.fx.GraphModule | None:
        return self.backward[0].gm if self.backward else None

    @property
    def forward_code(self) -> str:
        return self.forward[0].code if self.forward else ""

    @property
    def backward_code(self) -> str:
        return self.backward[0].code if self.backward else ""

    def to_dict(self) -> dict:
        d = {k: v for k, v in vars(self).items() if k not in ("forward", "backward")}
        d["forward"] = [g.to_dict() for g in self.forward]
        d["backward"] = [g.to_dict() for g in self.backward]
        return d


@dataclass
class Capture:
    """The report of :func:`capture`.

    Attributes:
        regions: Region name -> :class:`RegionCapture`.
        graphs: Every top-level graph, in compile order (``graphN.forward``/``.backward``).
        mutations: Input mutations found: ``graph``, ``input``, ``kind`` (``data``,
            ``metadata``, ``storage_resize``, ``storage_metadata``, ``backward_data``)...
        subclass_inputs: Tensor-subclass inputs: ``graph``, ``input``, ``type``, ``inner``.
        fsdp_inputs: FSDP2-managed inputs: ``input``, ``param``, sharded and unsharded shapes.
        fixes: What aotdist repaired in the graphs (storage resizes).
        metrics: Compile metrics of the step (graph breaks, recompiles, times).
        mode: ``graph`` or ``frames``.
        backend: The backend the step was compiled with.
    """

    regions: dict[str, RegionCapture] = field(default_factory=dict)
    graphs: list[GraphCapture] = field(default_factory=list)
    mutations: list[dict] = field(default_factory=list)
    subclass_inputs: list[dict] = field(default_factory=list)
    fsdp_inputs: list[dict] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    metrics: CompileMetrics = field(default_factory=CompileMetrics)
    mode: str = "graph"
    backend: str = ""

    def to_dict(self) -> dict:
        """JSON-able copy (no tensors, no graph modules; readable code included)."""
        return {
            "mode": self.mode, "backend": self.backend,
            "regions": {n: r.to_dict() for n, r in self.regions.items()},
            "graphs": [g.to_dict() for g in self.graphs],
            "mutations": self.mutations, "subclass_inputs": self.subclass_inputs,
            "fsdp_inputs": self.fsdp_inputs, "fixes": self.fixes,
            "metrics": self.metrics.to_dict(),
        }

    def summary(self) -> str:
        """A compact text table: regions, graphs, mutations, subclasses, FSDP, breaks."""
        m = self.metrics
        lines = [f"capture: mode {self.mode}, backend {self.backend}, {len(self.graphs)} "
                 f"graphs, graph breaks {m.num_graph_breaks}, recompiles {len(m.recompiles)}",
                 f"{'region':<18}{'inst':>5}{'sites':>6}{'subgr':>6}{'fw ops':>7}"
                 f"{'bw ops':>7}{'saved':>6}{'saved B':>10}{'inl':>4}  params"]
        for r in self.regions.values():
            fw = r.forward[0] if r.forward else None
            params = sum(1 for i in (fw.inputs if fw else []) if i["kind"] == "parameter")
            bw_ops = r.backward[0].num_ops if r.backward else 0
            lines.append(f"{r.name:<18}{len(r.instances):>5}{len(r.call_sites):>6}"
                         f"{r.num_subgraphs:>6}{fw.num_ops if fw else 0:>7}{bw_ops:>7}"
                         f"{fw.saved_count if fw else 0:>6}{fw.saved_bytes if fw else 0:>10}"
                         f"{r.inlined:>4}  {params}")
        for g in self.graphs:
            kinds: dict[str, int] = {}
            for i in g.inputs:
                kinds[i["kind"]] = kinds.get(i["kind"], 0) + 1
            lines.append(f"  {g.name}: {g.num_ops} ops, saved {g.saved_count} "
                         f"({g.saved_bytes} B), inputs {kinds}"
                         + (f", collectives {g.collectives}" if g.collectives else ""))
        lines += [f"  mutation: {x['graph']} {x['input']} {x['kind']}" for x in self.mutations]
        lines += [f"  subclass input: {x['graph']} {x['input']} {x['type']} "
                  f"inner {list(x['inner'])}" for x in self.subclass_inputs]
        lines += [f"  fsdp input: {x['graph']} {x['param']} sharded {x['sharded_shape']} "
                  f"unsharded {x['unsharded_shape']}" for x in self.fsdp_inputs]
        lines += [f"  fixed: {x}" for x in self.fixes]
        lines += [f"  graph break x{n}: {r.splitlines()[0][:140]}"
                  for r, n in m.graph_breaks.items()]
        lines += [f"  recompile: {r.splitlines()[0][:140]}" for r in m.recompiles]
        return "\n".join(lines)

    def save(self, directory: str | Path) -> list[Path]:
        """Writes ``capture.json`` and one ``.py`` of readable code per graph.

        Returns:
            The files written.
        """
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        written = [out / "capture.json"]
        written[0].write_text(json.dumps(self.to_dict(), indent=1, default=str))
        graphs = list(self.graphs) + [g for r in self.regions.values()
                                      for g in (*r.forward, *r.backward)]
        for g in graphs:
            path = out / (re.sub(r"[^\w.-]+", "_", g.name) + ".py")
            path.write_text(f"# {g.name} ({g.kind})\n{g.code}")
            written.append(path)
        return written


@dataclass
class _DynamoGraph:
    index: int
    names: dict[int, tuple[str, str]]
    examples: list[Any]
    region: str | None = None  # frames mode: the region this graph is the forward of
    fw_metadata: Any = None
    forward: GraphCapture | None = None


class _Recorder:
    """Receives Dynamo's graphs, then AOTAutograd's, and builds the report as they come."""

    def __init__(self, model: nn.Module, plan, report: Capture):
        self.model = model
        self.report = report
        self.fqn_to_region = {f: r.name for r in plan for f in r.fqns}
        self.dynamo: list[_DynamoGraph] = []
        self.by_context: dict[int, _DynamoGraph] = {}
        self.current: _DynamoGraph | None = None
        self.recording: RecordingBackend | None = None
        self.subgraphs: dict[int, GraphCapture] = {}  # id(sub gm) -> its capture

    # Dynamo level ---------------------------------------------------------------------
    def dynamo_backend(self, aot):
        def backend(gm, example_inputs):
            entry = self._dynamo_graph(gm)
            self.current = entry
            try:
                return aot(gm, example_inputs)
            finally:
                self.current = None

        backend._aotdist_fixes_resizes = True  # RecordingBackend: no second repair
        return backend

    def _tensor_names(self) -> dict[int, tuple[str, str]]:
        names = {id(p): ("parameter", n) for n, p in
                 self.model.named_parameters(remove_duplicate=False)}
        names.update({id(b): ("buffer", n) for n, b in
                      self.model.named_buffers(remove_duplicate=False)})
        for fqn, info in _fsdp_params(self.model).items():
            names[id(info.pop("unsharded"))] = ("parameter", fqn)
        return names

    def _dynamo_graph(self, gm: torch.fx.GraphModule) -> _DynamoGraph:
        known = self._tensor_names()
        entry = _DynamoGraph(index=len(self.dynamo), names={}, examples=[])
        if self.recording is not None:
            entry.region = self.recording._standalone_region()
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for i, node in enumerate(placeholders):
            grapharg = node.meta.get("grapharg")
            example = getattr(grapharg, "example", None)
            entry.examples.append(example)
            if example is not None and id(example) in known:
                entry.names[i] = known[id(example)]
            elif grapharg is not None:
                entry.names[i] = _source_kind_name(grapharg.source)
            else:
                entry.names[i] = ("input", node.name)
            if _is_subclass(example):
                attrs, _ = example.__tensor_flatten__()
                self.report.subclass_inputs.append({
                    "graph": f"graph{entry.index}", "input": entry.names[i][1],
                    "type": f"{type(example).__module__}.{type(example).__qualname__}",
                    "inner": {a: tensor_info(getattr(example, a)) for a in attrs},
                })
        index = {node.name: i for i, node in enumerate(placeholders)}
        for placeholder in storage_resized_inputs(gm):
            name = entry.names.get(index.get(placeholder, -1), ("", placeholder))[1]
            self.report.mutations.append({"graph": f"graph{entry.index}", "input": name,
                                          "kind": "storage_resize", "level": "dynamo"})
        self.dynamo.append(entry)
        return entry

    # AOTAutograd level ------------------------------------------------------------------
    def on_graph(self, gm: torch.fx.GraphModule, kind: str) -> None:
        ctx = torch._guards.TracingContext.try_get()
        if kind != "backward":
            entry = self.current or (self.dynamo[-1] if self.dynamo else None)
            if entry is None:
                return
            if ctx is not None:
                self.by_context[id(ctx)] = entry
                entry.fw_metadata = getattr(ctx, "fw_metadata", None)
        else:
            entry = self.by_context.get(id(ctx)) if ctx is not None else None
            entry = entry or next((e for e in reversed(self.dynamo) if e.forward), None)
            if entry is None:
                return
        self.report.fixes += [f"graph{entry.index}.{kind}: final storage resize of {n} "
                              "applied to the input, not its functional copy"
                              for n in gm.meta.get("aotdist_fixed_resizes", [])]
        md = entry.fw_metadata
        cap = analyse_graph(
            gm, name=f"graph{entry.index}.{kind}", kind=kind, names=entry.names,
            num_user_outputs=getattr(md, "num_forward_returns", None),
        )
        if kind == "backward" and entry.forward is not None:
            _name_saved_inputs(cap, entry.forward)
        else:
            entry.forward = cap
            self._mutations_from_metadata(cap, md, entry.names)
        self.report.graphs.append(cap)
        self._mutations_from_graph(cap)
        if entry.region is not None:  # frames mode: this graph is the region's own
            region = self.report.regions.get(entry.region)
            if region is not None:
                (region.backward if kind == "backward" else region.forward).append(cap)
        self._region_calls(gm, cap, entry)

    def _mutations_from_metadata(self, cap: GraphCapture, md: Any, names: dict) -> None:
        # input_info is indexed like Dynamo's flat inputs (PlainAOTInput.idx)
        for idx, info in enumerate(getattr(md, "input_info", None) or []):
            flags = {
                "data": getattr(info, "mutates_data", False),
                "metadata": getattr(info, "mutates_metadata", False),
                "storage_resize": getattr(info, "mutation_inductor_storage_resize", False),
                "storage_metadata": getattr(info, "mutates_storage_metadata", False),
            }
            for kind, on in flags.items():
                if on:
                    self.report.mutations.append({
                        "graph": cap.name, "input": names.get(idx, ("", f"input {idx}"))[1],
                        "kind": kind, "under_no_grad": bool(getattr(
                            info, "mutations_under_no_grad_or_inference_mode", False)),
                    })

    def _mutations_from_graph(self, cap: GraphCapture) -> None:
        for r in cap.storage_resizes:
            self.report.mutations.append({"graph": cap.name, "input": r["input"],
                                          "kind": "storage_resize", "nbytes": r["nbytes"]})
        if cap.kind == "backward":
            for name in cap.mutated_inputs:
                self.report.mutations.append({"graph": cap.name, "input": name,
                                              "kind": "backward_data"})

    def _region_calls(self, gm: torch.fx.GraphModule, cap: GraphCapture,
                      entry: _DynamoGraph) -> None:
        """Region subgraphs called by ``gm`` (``invoke_subgraph``), per call site."""
        invoke = getattr(torch.ops.higher_order, "invoke_subgraph", None)
        by_placeholder = {i["placeholder"]: i for i in cap.inputs}
        for node in gm.graph.nodes:
            if invoke is None or node.target is not invoke:
                continue
            sub = getattr(gm, str(node.args[0].target), None)
            stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
            fqns = [module_path_to_fqn(v[0]) for v in stack.values() if isinstance(v, tuple)]
            fqns = [f for f in fqns if f in self.fqn_to_region]
            region = self.report.regions.get(self.fqn_to_region[fqns[-1]]) if fqns else None
            if region is None or not isinstance(sub, torch.fx.GraphModule):
                continue
            site = fqns[-1]
            sub_cap = self.subgraphs.get(id(sub))
            if sub_cap is None:
                graphs = region.backward if cap.kind == "backward" else region.forward
                sub_cap = analyse_graph(sub, name=f"{region.name}.{cap.kind}{len(graphs)}",
                                        kind=cap.kind)
                self.subgraphs[id(sub)] = sub_cap
                graphs.append(sub_cap)
                if cap.kind == "backward" and region.forward:
                    _name_saved_inputs(sub_cap, region.forward[0], relative=True)
            if cap.kind != "backward":
                region.call_sites.append(site)
                _name_operands(sub_cap, node.args[2:], by_placeholder, site)


def _name_operands(sub_cap: GraphCapture, operands, by_placeholder: dict, site: str) -> None:
    """A region subgraph's inputs named after what one call site passes."""
    for inp, arg in zip(sub_cap.inputs, operands, strict=False):
        if isinstance(arg, torch.fx.Node) and arg.name in by_placeholder:
            top = by_placeholder[arg.name]
            kind, full = top["kind"], top["name"]
        else:
            kind, full = "activation", getattr(arg, "name", str(arg))
        rel = (full[len(site) + 1:] if full.startswith(site + ".")
               else "activation" if kind == "activation" else full)
        if "sources" not in inp:
            inp.update(kind=kind, name=rel, sources=[])
        elif inp["name"] != rel:
            inp["name"] = f"{inp['name']} | {rel}"
        inp["sources"].append(full)


def _name_saved_inputs(bw: GraphCapture, fw: GraphCapture, *, relative: bool = False) -> None:
    """Backward inputs that are forward inputs saved as they are get the forward's name."""
    fw_names = {i["placeholder"]: i for i in fw.inputs}
    for inp in bw.inputs:
        src = fw_names.get(inp["placeholder"])
        if src is not None and inp["kind"] != "tangent":
            inp["name"] = src["name"]
            inp["saved_kind"] = src["kind"]
    if relative:
        bw.mutated_inputs = [fw_names.get(n, {}).get("name", n) for n in bw.mutated_inputs]


def _source_kind_name(source: Any) -> tuple[str, str]:
    text = source.name() if callable(getattr(source, "name", None)) else str(source.name)
    kind = ("parameter" if "_parameters[" in text else
            "buffer" if "_buffers[" in text else "input")
    if kind == "input":
        return kind, re.sub(r"^L\[['\"](\w+)['\"]\]", r"\1", text)
    path = re.sub(r"\._(?:modules|parameters|buffers)\[(['\"])(.*?)\1\]", r".\2", text)
    return kind, module_path_to_fqn(path)


def _is_subclass(t: Any) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t)


def _fsdp_params(model: nn.Module) -> dict[str, dict]:
    """FQN -> sharded/unsharded shapes (and the unsharded tensor) of FSDP2 parameters."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return {}
    fqn_of = {id(m): f for f, m in model.named_modules()}
    found = {}
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
        for fp in getattr(group, "fsdp_params", None) or []:
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is None:
                continue
            info = fp._module_info
            fqn = ".".join(x for x in (fqn_of.get(id(info.module), "?"), info.param_name) if x)
            found[fqn] = {"unsharded": unsharded,
                          "sharded_shape": list(getattr(fp, "sharded_size", ())),
                          "unsharded_shape": list(getattr(fp, "_orig_size", ())),
                          "storage_nbytes_now": unsharded.untyped_storage().nbytes()}
    return found


def _runner():
    def run(model, args, kwargs):
        return model(*args, **kwargs)

    return _copy_function(run, new_code=True)  # a fresh code object: a Dynamo cache of its own


def _install_frames(model: nn.Module, state, backend, calls: dict) -> dict[type, Any]:
    """Frames mode: each region class's forward compiled on its own; returns the old ones."""
    fqn_of = {id(m): f for f, m in model.named_modules()}
    old = {}
    for region in state.plan:
        cls = state.classes[region.name]
        old[cls] = cls.__dict__.get("forward")
        fn = torch.compile(_copy_function(cls._aotdist_plain_forward, new_code=True),
                           backend=backend)

        def forward(self, *args, _fn=fn, _name=region.name, **kwargs):
            calls.setdefault(_name, []).append(fqn_of.get(id(self), "?"))
            return _fn(self, *args, **kwargs)

        cls.forward = forward
    return old


def capture(model: nn.Module, *args, loss_fn=None, plan=None, backend: str = "aot_eager",
            **kwargs) -> Capture:
    """Runs one step of ``model`` through AOTAutograd and reports what was captured.

    Args:
        model: The model; regions are marked for the step if aotdist has not marked them.
            It may be sharded with FSDP2 (by ``aotdist.parallelize``) and use Float8.
        *args: Positional inputs of ``model``.
        loss_fn: ``loss_fn(output) -> scalar``; backward runs on it. Without it, backward
            runs when the output is a scalar that requires grad.
        plan: Regions to use; ``aotdist.find_regions(model)`` when ``None`` (a model aotdist
            marked already keeps its plan).
        backend: ``"aot_eager"`` or ``"inductor"``: the recorded graphs are then compiled
            by it, so the step runs as in training.
        **kwargs: Keyword inputs of ``model``.

    Returns:
        A :class:`Capture`.

    Raises:
        ConfigError: ``backend`` is not one aotdist can rebuild on AOTAutograd, or ``plan``
            differs from the plan the model was marked with.
        OrderingError: The model holds FSDP2 units but aotdist did not mark its regions
            before sharding.
    """
    from aotdist.fsdp import fsdp_modules

    report = Capture(backend=str(backend_name(backend) or backend))
    state = vars(model).get(STATE_ATTR)
    frames = bool(fsdp_modules(model))
    if state is None and frames:
        raise OrderingError(
            "this model holds FSDP2 units but aotdist has not marked its regions; marking "
            "after fully_shard would drop FSDP's class. Fix: build it with "
            "aotdist.parallelize(model, config), which marks before sharding."
        )
    if state is not None and plan is not None and plan is not state.plan:
        raise ConfigError(
            "capture(plan=...) differs from the plan this model was marked with. Fix: pass "
            "plan=None to use the model's plan, or aotdist.restore(model) first."
        )
    marked_here = state is None
    state = mark_regions(model, plan) if marked_here else state
    recorder = _Recorder(model, state.plan, report)
    aot = aot_backend(backend, on_graph=recorder.on_graph)
    if aot is None:
        if marked_here:
            _unmark(model)
        raise ConfigError(
            f"capture(backend={backend!r}): the capture pipeline rebuilds the backend on "
            "AOTAutograd and knows 'aot_eager' and 'inductor'. Fix: pass one of those."
        )
    report.mode = "frames" if frames else "graph"
    for region in state.plan:
        report.regions[region.name] = RegionCapture(
            name=region.name, instances=list(region.fqns),
            module_type=f"{region.module_type.__module__}.{region.module_type.__qualname__}")
    recording = RecordingBackend(recorder.dynamo_backend(aot), model=model, plan=state.plan)
    recorder.recording = recording
    grads = {p: p.grad for p in model.parameters()}
    buffers = _snapshot_buffers(model)
    calls: dict[str, list[str]] = {}
    compiled_call, old_forwards = model._compiled_call_impl, {}
    try:
        model._compiled_call_impl = None
        for p in grads:
            p.grad = None
        with track(model) as metrics:
            if frames:
                old_forwards = _install_frames(model, state, recording, calls)
                out = model(*args, **kwargs)
            else:
                from aotdist.graph_fsdp import local_shards

                with local_shards(model):  # graph-mode FSDP: regions read local shards
                    out = torch.compile(_runner(), backend=recording)(model, args, kwargs)
            loss = loss_fn(out) if loss_fn is not None else out
            if (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
                loss.backward()
    finally:
        for cls, fwd in old_forwards.items():
            cls.forward = fwd
        model._compiled_call_impl = compiled_call
        for p, g in grads.items():
            p.grad = g
        _restore_buffers(model, buffers)
        if marked_here:
            _unmark(model)
    report.metrics = metrics
    _finish(report, recorder, calls, model)
    return report


def _unmark(model: nn.Module) -> None:
    unmark_regions(model)
    del model.__dict__[STATE_ATTR]


def _snapshot_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    saved = {}
    for name, b in model.named_buffers():
        needed = b.numel() * b.element_size()
        if type(b) is torch.Tensor and b.untyped_storage().nbytes() >= needed:
            saved[name] = b.detach().clone()
    return saved


@torch.no_grad()
def _restore_buffers(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    for name, b in model.named_buffers():
        if name in saved and b.untyped_storage().nbytes() >= saved[name].nbytes:
            b.copy_(saved[name])


def _finish(report: Capture, recorder: _Recorder, calls: dict, model: nn.Module) -> None:
    fsdp = _fsdp_params(model)
    for region in report.regions.values():
        if report.mode == "frames":
            region.call_sites = list(calls.get(region.name, []))
        region.num_subgraphs = len(region.forward)
        stats = report.metrics.regions.get(region.name)
        region.inlined = stats.inlined if stats is not None else 0
        for g in region.forward if report.mode == "frames" else ():
            for inp in g.inputs:  # named after the instance compiled first: make relative
                if inp["kind"] not in ("parameter", "buffer"):
                    continue
                site = next((s for s in region.instances if inp["name"].startswith(s + ".")),
                            None)
                rel = inp["name"][len(site) + 1:] if site else inp["name"]
                inp.update(name=rel, sources=[f"{s}.{rel}" for s in region.call_sites])
    for entry in recorder.dynamo:
        for i, example in enumerate(entry.examples):
            kind, name = entry.names.get(i, ("", ""))
            info = fsdp.get(name) if kind == "parameter" else None
            if info is not None and example is info["unsharded"]:
                report.fsdp_inputs.append({
                    "graph": f"graph{entry.index}", "input": name, "param": name,
                    **{k: v for k, v in info.items() if k != "unsharded"}})
        entry.examples = []
