"""The capture recorder: Dynamo's graphs, then AOTAutograd's, into a :class:`Capture`.

:class:`Recorder` is the backend chain :func:`aotdist.capture` compiles one step with:
its Dynamo-level backend names each graph input (parameters, buffers, FSDP2's unsharded
parameters, tensor subclasses, storage resizes); its AOTAutograd hook (``on_graph``)
analyses every forward, backward and region subgraph before the real backend compiles it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from aotdist import _compat
from aotdist.backends.aot import storage_resized_inputs
from aotdist.backends.recording import (
    RecordingBackend,
    module_path_to_fqn,
    stack_regions,
    submodule,
)
from aotdist.capture.graphs import GraphCapture, analyse_graph, tensor_info
from aotdist.capture.report import Capture
from aotdist.fsdp import fsdp_params


@dataclass
class _DynamoGraph:
    index: int
    names: dict[int, tuple[str, str]]
    examples: list[Any]
    region: str | None = None  # frames mode: the region this graph is the forward of
    prefix: str = ""  # the fqn the frame's module paths are relative to (frame_prefix)
    fw_metadata: Any = None
    forward: GraphCapture | None = None


class Recorder:
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

    def reset(self) -> None:
        """Forgets the graphs of a failed attempt (the step is traced again)."""
        self.dynamo.clear()
        self.by_context.clear()
        self.subgraphs.clear()
        self.current = None

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
        names = {
            id(p): ("parameter", n) for n, p in self.model.named_parameters(remove_duplicate=False)
        }
        names.update(
            {id(b): ("buffer", n) for n, b in self.model.named_buffers(remove_duplicate=False)}
        )
        for fqn, info in fsdp_params(self.model).items():
            names[id(info.pop("unsharded"))] = ("parameter", fqn)
        return names

    def _dynamo_graph(self, gm: torch.fx.GraphModule) -> _DynamoGraph:
        known = self._tensor_names()
        entry = _DynamoGraph(index=len(self.dynamo), names={}, examples=[])
        if self.recording is not None:
            entry.region = self.recording._standalone_region()
            entry.prefix = self.recording.frame_prefix()
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
                self.report.subclass_inputs.append(
                    {
                        "graph": f"graph{entry.index}",
                        "input": entry.names[i][1],
                        "type": f"{type(example).__module__}.{type(example).__qualname__}",
                        "inner": {a: tensor_info(getattr(example, a)) for a in attrs},
                    }
                )
        index = {node.name: i for i, node in enumerate(placeholders)}
        for placeholder in storage_resized_inputs(gm):
            name = entry.names.get(index.get(placeholder, -1), ("", placeholder))[1]
            self.report.mutations.append(
                {
                    "graph": f"graph{entry.index}",
                    "input": name,
                    "kind": "storage_resize",
                    "level": "dynamo",
                }
            )
        self.dynamo.append(entry)
        return entry

    # AOTAutograd level ------------------------------------------------------------------
    def on_graph(self, gm: torch.fx.GraphModule, kind: str) -> None:
        ctx = _compat.tracing_context()
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
        self.report.fixes += [
            f"graph{entry.index}.{kind}: final storage resize of {n} "
            "applied to the input, not its functional copy"
            for n in gm.meta.get("aotdist_fixed_resizes", [])
        ]
        md = entry.fw_metadata
        cap = analyse_graph(
            gm,
            name=f"graph{entry.index}.{kind}",
            kind=kind,
            names=entry.names,
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
                    self.report.mutations.append(
                        {
                            "graph": cap.name,
                            "input": names.get(idx, ("", f"input {idx}"))[1],
                            "kind": kind,
                            "under_no_grad": bool(
                                getattr(info, "mutations_under_no_grad_or_inference_mode", False)
                            ),
                        }
                    )

    def _mutations_from_graph(self, cap: GraphCapture) -> None:
        for r in cap.storage_resizes:
            self.report.mutations.append(
                {
                    "graph": cap.name,
                    "input": r["input"],
                    "kind": "storage_resize",
                    "nbytes": r["nbytes"],
                }
            )
        if cap.kind == "backward":
            for name in cap.mutated_inputs:
                self.report.mutations.append(
                    {"graph": cap.name, "input": name, "kind": "backward_data"}
                )

    def _region_calls(
        self, gm: torch.fx.GraphModule, cap: GraphCapture, entry: _DynamoGraph
    ) -> None:
        """Region subgraphs called by ``gm`` (``invoke_subgraph``), per call site."""
        invoke = getattr(torch.ops.higher_order, "invoke_subgraph", None)
        by_placeholder = {i["placeholder"]: i for i in cap.inputs}
        for node in gm.graph.nodes:
            if invoke is None or node.target is not invoke:
                continue
            sub = submodule(gm, node.args[0].target)
            found = stack_regions(node, self.fqn_to_region, entry.prefix)
            region = self.report.regions.get(found[-1][1]) if found else None
            if region is None or not isinstance(sub, torch.fx.GraphModule):
                continue
            site = found[-1][0]
            sub_cap = self.subgraphs.get(id(sub))
            if sub_cap is None:
                graphs = region.backward if cap.kind == "backward" else region.forward
                sub_cap = analyse_graph(
                    sub, name=f"{region.name}.{cap.kind}{len(graphs)}", kind=cap.kind
                )
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
        rel = (
            full[len(site) + 1 :]
            if full.startswith(site + ".")
            else "activation"
            if kind == "activation"
            else full
        )
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
    kind = "parameter" if "_parameters[" in text else "buffer" if "_buffers[" in text else "input"
    if kind == "input":
        return kind, re.sub(r"^L\[['\"](\w+)['\"]\]", r"\1", text)
    path = re.sub(r"\._(?:modules|parameters|buffers)\[(['\"])(.*?)\1\]", r".\2", text)
    return kind, module_path_to_fqn(path)


def _is_subclass(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and _compat.is_traceable_wrapper_subclass(t)
