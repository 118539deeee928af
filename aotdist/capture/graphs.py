"""Reading AOTAutograd graphs: inputs and outputs classified, ops, saved tensors, mutations.

Used by :mod:`aotdist.capture`. Inputs are classified from the descriptors AOTAutograd
attaches to placeholders and outputs (``node.meta["desc"]``, torch >= 2.9:
``PlainAOTInput``, ``TangentAOTInput``, ``SubclassGetAttrAOTInput``,
``SavedForBackwardsAOTOutput``...). Without them (older torch) the placeholder names
(``primals_N``, ``tangents_N``) are used, and what cannot be told is reported as
``"unknown"``, never guessed.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from aotdist._compat.ops import op_schema

# Dynamo-level names of a graph's flat inputs: PlainAOTInput idx -> (kind, name)
InputNames = dict[int, tuple[str, str]]


@dataclass
class GraphCapture:
    """One graph AOTAutograd produced: a top-level graph or a region subgraph.

    Attributes:
        name: ``graph0.forward``, ``GPTBlock.backward``...
        kind: ``forward``, ``backward`` or ``inference``.
        gm: The ``GraphModule`` (not in :meth:`to_dict`).
        code: Its readable code.
        inputs: One dict per placeholder: ``index``, ``name``, ``kind`` (``parameter``,
            ``buffer``, ``input``, ``tangent``, ``saved``, ``activation``, ``rng``,
            ``token``, ``symint``, ``unknown``), ``shape``, ``dtype``, ``nbytes``.
        outputs: One dict per output: ``index``, ``kind`` (``output``, ``saved``,
            ``mutated_input``, ``grad``, ``token``, ``rng``, ``none``...), ``name``...
        op_counts: Call counts by op target.
        saved_count: Tensors this forward graph saves for backward.
        saved_bytes: Their bytes (``numel * itemsize``).
        storage_resizes: ``{"input", "nbytes"}`` per ``resize_storage_bytes_`` of an input.
        mutated_inputs: Inputs an op of the graph mutates in place (``copy_``...).
    """

    name: str
    kind: str
    gm: Any = field(repr=False, compare=False)
    code: str = field(repr=False)
    inputs: list[dict] = field(default_factory=list)
    outputs: list[dict] = field(default_factory=list)
    op_counts: dict[str, int] = field(default_factory=dict)
    saved_count: int = 0
    saved_bytes: int = 0
    storage_resizes: list[dict] = field(default_factory=list)
    mutated_inputs: list[str] = field(default_factory=list)

    @property
    def num_ops(self) -> int:
        return sum(self.op_counts.values())

    @property
    def collectives(self) -> dict[str, int]:
        """Functional collectives in the graph (graph-mode FSDP's all-gathers and
        reduce-scatters), by op name without the namespace, ``wait_tensor`` left out."""
        out: dict[str, int] = {}
        for target, n in self.op_counts.items():
            if "_c10d_functional" in target and "wait_tensor" not in target:
                key = target.split(".")[-2] if target.count(".") >= 2 else target
                out[key] = out.get(key, 0) + n
        return out

    @property
    def gathered_bytes(self) -> int:
        """Bytes the graph's own all-gathers gather (their outputs: the unsharded side;
        ``float8.fsdp_all_gather`` weights at 1 byte per element)."""
        total = 0
        for node in self.gm.graph.nodes if self.gm is not None else ():
            val = node.meta.get("val") if node.op == "call_function" else None
            target = str(node.target)  # the collective, not a bucket's copy-in op
            if (
                "_c10d_functional" in target
                and "all_gather" in target
                and isinstance(val, torch.Tensor)
            ):
                total += val.numel() * val.element_size()
        return total

    def to_dict(self) -> dict:
        """JSON-able copy without the ``GraphModule`` (``code`` is kept)."""
        return {k: v for k, v in vars(self).items() if k != "gm"}


_NAMED_KINDS = ("parameter", "buffer", "input", "activation")


def name_code(cap: GraphCapture) -> None:
    """Writes the inputs' names into ``cap.code`` in place of AOTAutograd's placeholder
    names (``primals_1`` -> ``ln1_weight``, ``blocks_0_ln1_weight``; a backward graph's
    saved inputs after the forward's), once every name is known. Only the graph's own
    code: a nested subgraph's class below it keeps its names. ``cap.gm`` keeps torch's
    names, and each input's ``placeholder`` says which was renamed."""
    lines = cap.code.splitlines(keepends=True)
    own = []  # the top-level class's lines, not those of a subgraph's class printed in it
    nested = False
    for line in lines:
        if re.match(r"    \S", line):
            nested = line.startswith("    class ")
        own.append(not nested)
    taken = set(re.findall(r"\w+", re.sub(r"#.*", "", cap.code)))  # comments quote source
    renames: dict[str, str] = {}
    for inp in cap.inputs:
        old, name = inp.get("placeholder"), inp.get("name") or ""
        kind = inp.get("saved_kind", inp.get("kind"))
        if not old or name == old or kind not in _NAMED_KINDS:
            continue
        ident = re.sub(r"\W+", "_", name.split(" | ")[0]).strip("_")
        if not ident or ident[0].isdigit():
            ident = f"_{ident}"
        new, n = ident, 1
        while new in taken:
            new, n = f"{ident}_{n}", n + 1
        taken.add(new)
        renames[old] = new
    if not renames:
        return
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, renames)) + r")\b")
    cap.code = "".join(
        pattern.sub(lambda m: renames[m.group(1)], line) if mine else line
        for line, mine in zip(lines, own, strict=True)
    )


def _dim(d) -> int | str:
    try:
        return int(d)
    except Exception:  # noqa: BLE001 - a symbolic size without a hint
        return str(d)


def tensor_info(val: Any) -> dict:
    """``shape``, ``dtype`` and ``nbytes`` of a (fake) tensor; ``{}`` for anything else."""
    if not isinstance(val, torch.Tensor):
        return {"value": str(val)} if val is not None else {}
    shape = [_dim(d) for d in val.shape]
    nbytes = (
        math.prod(shape) * val.element_size() if all(isinstance(d, int) for d in shape) else None
    )
    return {"shape": shape, "dtype": str(val.dtype).removeprefix("torch."), "nbytes": nbytes}


def classify_desc(desc: Any, names: InputNames) -> tuple[str, str]:
    """``(kind, name)`` of an AOTAutograd input descriptor."""
    cls = type(desc).__name__
    if cls == "PlainAOTInput":
        return names.get(desc.idx, ("input", f"arg{desc.idx}"))
    if cls in ("ParamAOTInput", "BufferAOTInput"):
        return ("parameter" if cls == "ParamAOTInput" else "buffer"), desc.target
    if cls == "TangentAOTInput":
        return "tangent", desc.expr()
    if cls == "SubclassGetAttrAOTInput":
        kind, name = classify_desc(desc.base, names)
        return kind, f"{name}.{desc.attr}"
    if cls in ("SubclassSizeAOTInput", "SubclassStrideAOTInput"):
        return "symint", desc.expr()
    if cls in ("ViewBaseAOTInput", "SyntheticBaseAOTInput"):
        kind, name = classify_desc(desc.base_of, names)
        return kind, f"base of {name}"
    if cls.startswith("Philox"):
        return "rng", desc.expr()
    if "Token" in cls:
        return "token", desc.expr()
    return "unknown", getattr(desc, "expr", lambda: repr(desc))()


def _classify_output(desc: Any) -> tuple[str, str]:
    cls = type(desc).__name__
    if desc is None:
        return "none", ""
    expr = desc.expr() if hasattr(desc, "expr") else repr(desc)
    for marker, kind in (
        ("SavedForBackwards", "saved"),
        ("InputMutation", "mutated_input"),
        ("Grad", "grad"),
        ("Token", "token"),
        ("Philox", "rng"),
        ("IntermediateBase", "intermediate_base"),
        ("MetadataMutation", "mutated_input"),
        ("PlainAOTOutput", "output"),
    ):
        if marker in cls:
            return kind, expr
    return "unknown", expr


def _placeholder_kind(node: torch.fx.Node, names: InputNames, graph_kind: str) -> tuple[str, str]:
    desc = node.meta.get("desc")
    if desc is not None:
        return classify_desc(desc, names)
    if node.name.startswith("tangents"):
        return "tangent", node.name
    match = re.fullmatch(r"primals_(\d+)", node.name)
    if graph_kind == "backward":
        return "saved", node.name
    if match and names:  # top-level forward graphs number primals from 1
        return names.get(int(match.group(1)) - 1, ("unknown", node.name))
    return "unknown", node.name


def _is_mutating(node: torch.fx.Node) -> bool:
    schema = op_schema(node.target)
    return bool(schema is not None and schema.is_mutable)


def analyse_graph(
    gm: torch.fx.GraphModule,
    *,
    name: str,
    kind: str,
    names: InputNames | None = None,
    num_user_outputs: int | None = None,
) -> GraphCapture:
    """A :class:`GraphCapture` of ``gm``.

    Args:
        gm: A forward, backward or inference graph from AOTAutograd, or a region subgraph.
        name: The name to report.
        kind: ``forward``, ``backward`` or ``inference``.
        names: Dynamo-level names of the graph's flat inputs (top-level graphs).
        num_user_outputs: Without output descriptors, outputs past this many are counted
            as saved for backward (forward graphs only); ``None``: unknown, none counted.
    """
    names = names or {}
    code = gm.print_readable(print_output=False, include_stride=False, include_device=False)
    cap = GraphCapture(name=name, kind=kind, gm=gm, code=code)
    by_node: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            k, n = _placeholder_kind(node, names, kind)
            by_node[node.name] = n
            cap.inputs.append(
                {
                    "index": len(cap.inputs),
                    "placeholder": node.name,
                    "kind": k,
                    "name": n,
                    **tensor_info(node.meta.get("val")),
                }
            )
        elif node.op == "call_function":
            cap.op_counts[str(node.target)] = cap.op_counts.get(str(node.target), 0) + 1
            first = node.args[0] if node.args else None
            if isinstance(first, torch.fx.Node) and first.op == "placeholder":
                target = by_node.get(first.name, first.name)
                if "resize_storage_bytes_" in str(node.target):
                    cap.storage_resizes.append({"input": target, "nbytes": _dim(node.args[1])})
                elif _is_mutating(node) and target not in cap.mutated_inputs:
                    cap.mutated_inputs.append(target)
        elif node.op == "output":
            outs = node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
            descs = node.meta.get("desc") or [None] * len(outs)
            have_descs = any(d is not None for d in descs)
            for i, (out, desc) in enumerate(zip(outs, descs, strict=False)):
                k, n = _classify_output(desc)
                if not have_descs:
                    saved = (
                        kind == "forward" and num_user_outputs is not None and i >= num_user_outputs
                    )
                    k, n = ("saved" if saved else "unknown"), ""
                elif k == "none" and out is not None:
                    k = "output"  # a region subgraph's own outputs carry no descriptor
                val = out.meta.get("val") if isinstance(out, torch.fx.Node) else None
                cap.outputs.append({"index": i, "kind": k, "name": n, **tensor_info(val)})
    saved = [o for o in cap.outputs if o["kind"] == "saved" and o.get("nbytes") is not None]
    cap.saved_count = len(saved)
    cap.saved_bytes = sum(o["nbytes"] for o in saved)
    cap.op_counts = dict(Counter(cap.op_counts).most_common())
    return cap
