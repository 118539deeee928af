"""Why a region has more than one subgraph: the per-instance values Dynamo guards on.

Dynamo specializes a region's subgraph on the Python constants its forward reads (a
per-layer index, a layer name, a stochastic-depth probability): instances whose values
differ cannot share one subgraph. After the first compiled call, a region with more
distinct subgraphs than one is reported with the attributes that differ between its
instances, and the fix, in a ``RegionCompileWarning`` and in ``metrics`` (``reuse``).
"""

from __future__ import annotations

from torch import nn

from aotdist.compile.state import RegionState
from aotdist.errors import RegionCompileWarning
from aotdist.log import rank_zero_warn

__all__ = ["differing_attributes", "report_reuse"]

_SCALARS = (bool, int, float, str, type(None))


def report_reuse(model: nn.Module, state: RegionState) -> None:
    """Warns about each region of ``model`` compiled into more than one subgraph."""
    backend = state.backend
    records = getattr(backend, "records", None) or []
    most: dict[str, int] = {}  # per graph: a graph break or a recompile makes graphs anew
    inlined: dict[str, set[str]] = {}
    for rec in records:
        for name, ids in rec.subgraphs.items():
            most[name] = max(most.get(name, 0), len(ids))
        for name, fqns in rec.inlined.items():
            inlined.setdefault(name, set()).update(fqns)
    for region in state.plan:
        n = most.get(region.name, 0)
        lost = len(inlined.get(region.name, ()))  # torch inlines a subgraph used once
        if (n <= 1 and not lost) or region.name in state.demoted or region.name in state.reuse:
            continue
        n += lost
        instances = [model.get_submodule(f) for f in region.fqns]
        differ = differing_attributes(instances)
        if differ:
            shown = "; ".join(f"{path} ({kind}: {values})" for path, kind, values in differ[:4])
            cause = f"its instances differ in Python constants the forward may read: {shown}"
            fix = ("make such a value a tensor buffer, or pass it as an input, so that one "
                   "subgraph serves every instance; exclude the region if it must differ")
        else:
            cause = ("the region's inputs differ between call sites (an input's strides, "
                     "dtype or shape: e.g. a transposed layout from the block before)")
            fix = ("hand every instance inputs of one layout (.contiguous()); "
                   "TORCH_LOGS=+hierarchical_compile shows the guard that failed")
        why = f"{n} distinct subgraphs for {region.count} instances: {cause}"
        state.reuse[region.name] = why
        rank_zero_warn(f"aotdist region {region.name!r} is compiled {n} times, not once: "
                       f"{why}. Fix: {fix}.", RegionCompileWarning, stacklevel=4)


def differing_attributes(instances: list[nn.Module]) -> list[tuple[str, str, str]]:
    """``(path, type name, values)`` of each plain Python attribute (int, float, str,
    bool, None, or a list or tuple of those) whose value differs between ``instances``, by attribute path."""
    values: dict[str, list] = {}
    for inst in instances:
        for prefix, mod in inst.named_modules():
            for key, value in vars(mod).items():
                if isinstance(value, (list, tuple)) and all(isinstance(v, _SCALARS)
                                                            for v in value):
                    value = tuple(value)  # e.g. Swin's shift_size: [0, 0] vs [4, 4]
                elif not isinstance(value, _SCALARS):
                    continue
                if key.startswith("_") or key == "training":
                    continue
                values.setdefault(f"{prefix}.{key}" if prefix else key, []).append(value)
    out = []
    for path, vals in values.items():
        distinct = list(dict.fromkeys(vals))
        if len(vals) == len(instances) and len(distinct) > 1:
            kind = type(next(v for v in distinct if v is not None)).__name__
            shown = ", ".join(repr(v) for v in distinct[:4]) + (", ..." if len(distinct) > 4
                                                                 else "")
            out.append((path, kind, shown))
    return out
