"""The report :func:`aotdist.capture` returns: :class:`Capture` and :class:`RegionCapture`.

Plain dataclasses: JSON-able with ``to_dict()``, a text table with ``summary()``, files
with ``save(dir)``. Filled by the recorder (:mod:`aotdist.capture.recorder`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aotdist.capture.graphs import GraphCapture
from aotdist.compile.state import CompileMode
from aotdist.metrics import CompileMetrics


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
        demoted: Why the region could not be a reusable subgraph (it was compiled inline
            instead, as ``compile_regions`` does), or ``None``.
    """

    name: str
    module_type: str
    instances: list[str]
    call_sites: list[str] = field(default_factory=list)
    num_subgraphs: int = 0
    inlined: int = 0
    forward: list[GraphCapture] = field(default_factory=list)
    backward: list[GraphCapture] = field(default_factory=list)
    demoted: str | None = None

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
        demoted: Region name -> why it was compiled inline instead of as a reusable
            subgraph (e.g. an in-place buffer update in training other than BatchNorm's).
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
    demoted: dict[str, str] = field(default_factory=dict)
    metrics: CompileMetrics = field(default_factory=CompileMetrics)
    mode: CompileMode = CompileMode.GRAPH
    backend: str = ""

    def to_dict(self) -> dict:
        """JSON-able copy (no tensors, no graph modules; readable code included)."""
        return {
            "mode": str(self.mode),
            "backend": self.backend,
            "regions": {n: r.to_dict() for n, r in self.regions.items()},
            "graphs": [g.to_dict() for g in self.graphs],
            "mutations": self.mutations,
            "subclass_inputs": self.subclass_inputs,
            "fsdp_inputs": self.fsdp_inputs,
            "fixes": self.fixes,
            "demoted": self.demoted,
            "metrics": self.metrics.to_dict(),
        }

    def summary(self) -> str:
        """A compact text table: regions, graphs, mutations, subclasses, FSDP, breaks."""
        m = self.metrics
        lines = [
            f"capture: mode {self.mode}, backend {self.backend}, {len(self.graphs)} "
            f"graphs, graph breaks {m.num_graph_breaks}, recompiles {len(m.recompiles)}",
            f"{'region':<18}{'inst':>5}{'sites':>6}{'subgr':>6}{'fw ops':>7}"
            f"{'bw ops':>7}{'saved':>6}{'saved B':>10}{'inl':>4}  params",
        ]
        for r in self.regions.values():
            fw = r.forward[0] if r.forward else None
            params = sum(1 for i in (fw.inputs if fw else []) if i["kind"] == "parameter")
            bw_ops = r.backward[0].num_ops if r.backward else 0
            lines.append(
                f"{r.name:<18}{len(r.instances):>5}{len(r.call_sites):>6}"
                f"{r.num_subgraphs:>6}{fw.num_ops if fw else 0:>7}{bw_ops:>7}"
                f"{fw.saved_count if fw else 0:>6}{fw.saved_bytes if fw else 0:>10}"
                f"{r.inlined:>4}  {params}"
            )
        for g in self.graphs:
            kinds: dict[str, int] = {}
            for i in g.inputs:
                kinds[i["kind"]] = kinds.get(i["kind"], 0) + 1
            lines.append(
                f"  {g.name}: {g.num_ops} ops, saved {g.saved_count} "
                f"({g.saved_bytes} B), inputs {kinds}"
                + (
                    f", collectives {g.collectives}, gathered {g.gathered_bytes} B"
                    if g.collectives
                    else ""
                )
            )
        lines += [f"  mutation: {x['graph']} {x['input']} {x['kind']}" for x in self.mutations]
        lines += [
            f"  subclass input: {x['graph']} {x['input']} {x['type']} inner {list(x['inner'])}"
            for x in self.subclass_inputs
        ]
        lines += [
            f"  fsdp input: {x['graph']} {x['param']} sharded {x['sharded_shape']} "
            f"unsharded {x['unsharded_shape']}"
            for x in self.fsdp_inputs
        ]
        lines += [f"  fixed: {x}" for x in self.fixes]
        lines += [
            f"  demoted: {n} compiled inline, not a reusable subgraph: {r}"
            for n, r in self.demoted.items()
        ]
        lines += [f"  reuse: {n}: {why[:160]}" for n, why in m.reuse.items()]
        lines += [
            f"  graph break x{n}: {r.splitlines()[0][:140]}" for r, n in m.graph_breaks.items()
        ]
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
        graphs = list(self.graphs) + [
            g for r in self.regions.values() for g in (*r.forward, *r.backward)
        ]
        for g in graphs:
            path = out / (re.sub(r"[^\w.-]+", "_", g.name) + ".py")
            path.write_text(f"# {g.name} ({g.kind})\n{g.code}")
            written.append(path)
        return written
