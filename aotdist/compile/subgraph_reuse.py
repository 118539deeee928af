"""Why a region has more than one subgraph: the per-instance values Dynamo guards on.

Dynamo specializes a region's subgraph on the Python constants its forward reads (a
per-layer index, a layer name, a stochastic-depth probability): instances whose values
differ cannot share one subgraph. After the first compiled call, a region with more
distinct subgraphs than one is reported with torch's own reason where it logged one
(torch 2.14+: an argument it cannot compare between calls), else with the attributes that
differ between its instances, and the fix, in a ``RegionCompileWarning`` and in
``metrics`` (``reuse``).
"""

from __future__ import annotations

from torch import nn

from aotdist import _compat
from aotdist._compat.modules import forward_hooks
from aotdist.compile.state import HOST_SCALARS, RegionState
from aotdist.errors import RegionCompileWarning
from aotdist.log import rank_zero_warn

_SCALARS = (bool, int, float, str, type(None))


def report_reuse(
    model: nn.Module, state: RegionState, records=None, found: dict[str, str] | None = None
) -> dict[str, str]:
    """Warns about each region of ``model`` compiled into more than one subgraph, or
    inlined; returns ``found`` (``state.log.reuse`` unless given), region -> why.

    ``records``: the recording backend's graphs (``state.backend``'s unless given).
    """
    found = state.log.reuse if found is None else found
    if records is None:
        records = getattr(state.backend, "records", None) or []
    most: dict[str, int] = {}  # per graph: a graph break or a recompile makes graphs anew
    inlined: dict[str, set[str]] = {}
    standalone: dict[str, int] = {}
    for rec in records:
        if rec.standalone is not None:  # FSDP hooks mode: a region's frame compiled again
            standalone[rec.standalone] = standalone.get(rec.standalone, 0) + 1
        for name, ids in rec.subgraphs.items():
            most[name] = max(most.get(name, 0), len(ids))
        for name, fqns in rec.inlined.items():
            inlined.setdefault(name, set()).update(fqns)
    for region in state.plan:
        n = max(most.get(region.name, 0), standalone.get(region.name, 0))
        lost = len(inlined.get(region.name, ()))  # torch inlines a subgraph used once
        if (n <= 1 and not lost) or region.name in state.applied.demoted or region.name in found:
            continue
        n += lost
        instances = [model.get_submodule(f) for f in region.fqns]
        differ = differing_attributes(instances)
        meshes = distinct_meshes(instances)
        refused = next(
            (
                why
                for code, why in state.log.refusals.items()
                if _compat.is_region_code(code, region.name)
            ),
            None,
        )
        refused = refused or _observed_mismatch(records, region.name)  # torch < 2.14
        # torch's own reason (torch 2.14+) for skipping its reuse check: the cause when its
        # fallback, comparing each traced body, also merged none (Gemma 4); where it merged
        # some, what differs between the rest is something else. An input that differed
        # at one call site explains one split only: constants that differ come first.
        mismatch = refused is not None and "tensor metadata mismatch" in refused
        if mismatch and (differ or meshes) and n > 2:
            differ, refused = differ + [("an input at one call site", "torch", refused)], None
        if refused is not None and (n >= region.count or mismatch):
            cause, fix = _refused(refused)
            if differ:
                cause += (
                    "; its instances also differ in Python constants the forward may "
                    f"read: {'; '.join(f'{p} ({k}: {v})' for p, k, v in differ[:2])}"
                )
        elif meshes:
            cause = (
                f"its instances hold {meshes[1]} distinct DeviceMesh objects where "
                f"one is expected (at {meshes[0]}), and torch.compile guards on the "
                "object: tensor parallelism applied with the mesh sliced anew for each "
                "layer (mesh['tp'] makes a new object per call)"
            )
            fix = (
                "slice the mesh once, tp_mesh = mesh['tp'], and pass that one object to "
                "every parallelize_module call"
            )
        elif differ and _writes_kv_cache(model, differ):
            cause = (
                "the model builds a KV cache in training (transformers' default "
                "config.use_cache=True) and each layer writes its own slot of it "
                f"({next(p for p, _, _ in differ if p.endswith('layer_idx'))}: "
                f"{next(v for p, _, v in differ if p.endswith('layer_idx'))}), so each "
                "layer's frame is specialised on its index; training reads no cache"
            )
            fix = (
                "model.config.use_cache = False before training (or call the model with "
                "use_cache=False)"
            )
        elif differ:
            shown = "; ".join(f"{path} ({kind}: {values})" for path, kind, values in differ[:4])
            cause = f"its instances differ in Python constants the forward may read: {shown}"
            fix = (
                "make such a value a tensor buffer, or pass it as an input, so that one "
                "subgraph serves every instance; exclude the region if it must differ. "
                "TORCH_LOGS=+hierarchical_compile shows torch's own reason: 'unsupported "
                "input VT types' is an argument it cannot compare between calls instead, "
                "such as a dict subclass made in the forward (Gemma 4's "
                "shared_kv_states): make it outside the compiled call and pass it in"
            )
        elif (
            state.applied.fixes.get(region.name) == HOST_SCALARS
            and _compat.reuses_by_comparing_bodies()
        ):
            cause = (
                "it reads values on the host (.tolist(), .item()), traced as new symbolic "
                "values at each call site, and this torch reuses a subgraph only where the "
                "traced bodies compare equal, comparing the symbolic inputs of a nested "
                "body (an autograd.Function's forward and backward, such as an all-to-all "
                "taking the split sizes) by identity: no two call sites match. torch's "
                "gap: torch 2.14's reuse check guards the region's inputs instead; each "
                "call site's subgraph trains correctly"
            )
            fix = (
                "torch 2.14 or newer compiles the region once; on this torch, nothing "
                "to change for correctness (compile time grows with the call sites)"
            )
        else:
            cause = (
                "the region's inputs differ between call sites (an input's strides, "
                "dtype, shape or requires_grad: e.g. a transposed layout from the block "
                "before, or a first block fed data that needs no gradient)"
            )
            fix = (
                "hand every instance inputs of one layout (.contiguous()); "
                "TORCH_LOGS=+hierarchical_compile shows the guard that failed"
            )
        why = f"{n} distinct subgraphs for {region.count} instances: {cause}"
        found[region.name] = why
        rank_zero_warn(
            f"aotdist region {region.name!r} is compiled {n} times, not once: {why}. Fix: {fix}.",
            RegionCompileWarning,
            stacklevel=4,
        )
    return found


def _writes_kv_cache(model: nn.Module, differ: list[tuple[str, str, str]]) -> bool:
    """A transformers model (``model`` or one inside it) whose config asks for a KV cache,
    its layers differing in the index they write the cache at (``self_attn.layer_idx``)."""
    return any(path.endswith("layer_idx") for path, _, _ in differ) and any(
        getattr(getattr(m, "config", None), "use_cache", False) is True for m in model.modules()
    )


# torch's reasons for not reusing a traced region body -> (what it means, the fix)
_REFUSALS = {
    "unsupported input VT types": (
        "torch cannot compare one of its arguments between calls, so it cannot reuse the "
        "subgraph: a Python object that is not a tensor, number, string or module, "
        "typically one made inside the compiled forward (Gemma 4's shared_kv_states, a "
        "dict subclass)",
        "make that object outside the compiled call and pass it in (a model argument), or "
        "hand the region tensors and numbers instead",
    ),
    "subgraph has side effects": (
        "its forward has a side effect torch must replay (it mutates a Python object or "
        "attribute), so torch does not reuse the subgraph",
        "move the mutation out of the region's forward, or return the value instead",
    ),
    "output contains non-tensor types": (
        "it returns values that are not tensors, so torch does not reuse the subgraph",
        "return tensors only (a tensor or a tuple of tensors)",
    ),
    "is not tensor or tuple/list": (
        "it returns a value that is not a tensor or a tuple of tensors, so torch does not "
        "reuse the subgraph",
        "return tensors only (a tensor or a tuple of tensors)",
    ),
    "mutated sources detected": (
        "a Python value its forward reads is changed during the step, so torch cannot "
        "trust guards taken before it changed and does not reuse the subgraph",
        "keep the values the region reads fixed during the step, or pass them as inputs",
    ),
}


# what differs in an input torch would not reuse the subgraph for -> the fix
_MISMATCH_FIXES = {
    "shape": (
        "a block applied at two sizes (feature maps of two resolutions) cannot share "
        "one subgraph: exclude the region (find_regions(model, exclude=[...])), and "
        "it compiles inline as in whole-model torch.compile, without this warning"
    ),
    "stride": (
        "hand every instance inputs of one layout (.contiguous()); aotdist does so "
        "itself only for inputs that need a gradient, not for buffers or data"
    ),
    "requires_grad": (
        "the first block is fed data that needs no gradient (a frozen "
        "embedding, as in LoRA fine-tuning), so it compiles once more, inline; "
        "this costs one block's trace and is usually the cheapest option "
        "(model.enable_input_require_grads() makes it reuse the subgraph but "
        "breaks the graph at the embedding, which costs more); otherwise let "
        "the first block compute its input from a tensor that needs a "
        "gradient"
    ),
}


def _refused(why: str) -> tuple[str, str]:
    if "tensor metadata mismatch" in why:
        fix = next(
            (
                f
                for field, f in _MISMATCH_FIXES.items()
                if f": {field} " in why or f"; {field} " in why
            ),
            "hand every instance inputs of one kind",
        )
        return (f"its call sites pass inputs that differ (torch: {why})", fix)
    for key, (cause, fix) in _REFUSALS.items():
        if key in why:
            return f"{cause} (torch: {why})", fix
    return (
        f"torch does not reuse its subgraph (torch: {why})",
        "TORCH_LOGS=+hierarchical_compile shows torch's reasoning",
    )


_KIND_FIELDS = ("shape", "dtype", "stride", "requires_grad")


def _observed_mismatch(records, region: str) -> str | None:
    """The first operand whose kind differs between the region's call sites in one graph,
    in torch's own words (torch 2.14+ logs them; older torch says nothing)."""
    for rec in records:
        sites = getattr(rec, "operands", {}).get(region, [])
        for i, kinds in enumerate(zip(*sites, strict=False)) if len(sites) > 1 else ():
            for field in ("requires_grad", "stride", "shape", "dtype"):
                seen = [k[_KIND_FIELDS.index(field)] for k in kinds if k is not None]
                if len(set(seen)) > 1:
                    return (
                        f"reuse failed -- input {i} tensor metadata mismatch: {field} "
                        f"{seen[0]} vs {next(v for v in seen if v != seen[0])}"
                    )
    return None


def differing_attributes(instances: list[nn.Module]) -> list[tuple[str, str, str]]:
    """``(path, type name, values)`` of each plain Python attribute (int, float, str,
    bool, None, or a list or tuple of those) whose value differs between ``instances``, by attribute path."""
    values: dict[str, list] = {}
    for inst in instances:
        for prefix, mod in inst.named_modules():
            for key, value in vars(mod).items():
                if isinstance(value, (list, tuple)) and all(isinstance(v, _SCALARS) for v in value):
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
            shown = ", ".join(repr(v) for v in distinct[:4]) + (
                ", ..." if len(distinct) > 4 else ""
            )
            out.append((path, kind, shown))
    return out


def distinct_meshes(instances: list[nn.Module]) -> tuple[str, int] | None:
    """``(where, count)`` when a ``DeviceMesh`` that a DTensor parameter or a module hook
    (tensor parallelism's input/output hooks) of ``instances`` holds is more than one
    object across them (equal meshes sliced separately); ``None`` otherwise."""
    from torch.distributed.device_mesh import DeviceMesh

    objects: dict[str, set[int]] = {}
    for inst in instances:
        for path, mod in inst.named_modules():
            held = [
                (f"{path}.{n}".lstrip("."), getattr(p, "device_mesh", None))
                for n, p in mod.named_parameters(recurse=False)
            ]
            hooks = forward_hooks(mod)
            held += [
                (f"{path or 'the block'}'s hook", cell.cell_contents)
                for hook in hooks
                for cell in (getattr(hook, "__closure__", None) or ())
                if _filled(cell)
            ]
            for where, mesh in held:
                if isinstance(mesh, DeviceMesh):
                    objects.setdefault(where, set()).add(id(mesh))
    split = [(where, len(ids)) for where, ids in objects.items() if len(ids) > 1]
    return split[0] if split else None


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell
        return False
    return True
