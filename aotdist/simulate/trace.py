"""The pieces of a simulated step shared by plain and pipelined jobs: the fake world,
the memory a rank holds, the collectives of the compiled graphs and of FSDP2's units."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from aotdist._compat.distributed import fake_store
from aotdist.errors import ConfigError
from aotdist.simulate.report import OPTIMIZER_STATES, Collective, Plan, StagePlan

_KINDS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


@contextlib.contextmanager
def _fake_world(world: int, rank: int = 0) -> Iterator[None]:
    import torch.distributed as dist

    if dist.is_initialized():
        raise ConfigError(
            "plan: this process already has a process group; run aotdist plan "
            "in a process of its own (it makes a fake world of --world ranks)"
        )
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _spans_nodes(mesh: tuple[int, ...], i: int, per_node: int) -> bool:
    """Whether the groups of mesh dimension ``i`` (row-major ranks) span nodes."""
    stride = math.prod(mesh[i + 1 :])
    return stride * (mesh[i] - 1) >= per_node or (mesh[i] > per_node)


def _mean_of_first(out: Any) -> torch.Tensor:
    t = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if t is None:
        t = out[0]
    return t.float().mean()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _memory(out: Plan, model: nn.Module, optimizer: str) -> None:
    params = {id(p): _local(p) for p in model.parameters()}
    out.param_bytes = sum(t.numel() * t.element_size() for t in params.values())
    trained = [
        t for p, t in zip(model.parameters(), params.values(), strict=False) if p.requires_grad
    ]
    out.grad_bytes = sum(t.numel() * t.element_size() for t in trained)
    out.optimizer_bytes = OPTIMIZER_STATES[optimizer] * sum(4 * t.numel() for t in trained)


def _graph_collectives(
    out: Plan, graphs: list, groups: dict[str, str], span: dict[str, bool]
) -> None:
    """The collectives of the job's bucketed forward and backward graphs, a region
    subgraph's once per call."""
    found: dict[tuple[str, str], Collective] = {}

    def walk(gm: torch.fx.GraphModule, times: int) -> None:
        for node in gm.graph.nodes:
            target = str(node.target) if node.op == "call_function" else ""
            if node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph:
                walk(getattr(gm, node.args[0].target), times)
                continue
            kind = next((k for k in _KINDS if f"_c10d_functional.{k}" in target), None)
            if kind is None:
                continue
            dim = groups.get(str(node.args[-1]), str(node.args[-1]))
            val = node.meta.get("val")
            nbytes = val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0
            if kind == "reduce_scatter_tensor":  # its input is the unsharded side
                arg = node.args[0].meta.get("val")
                nbytes = arg.numel() * arg.element_size() if arg is not None else nbytes
            name = kind.split("_into")[0].removesuffix("_tensor")
            if name == "all_gather":  # a bucket gathered at once: in use while the next arrives
                out.gathered_unit_bytes = max(out.gathered_unit_bytes, nbytes)
            c = found.setdefault((name, dim), Collective(name, dim, network=span.get(dim, False)))
            c.count += times
            c.bytes += times * nbytes

    for gm in graphs:
        walk(gm, 1)
    out.collectives = list(found.values())


def _float8_scale_all_reduce(
    out: Plan | StagePlan, model: nn.Module, dim: str, span: dict[str, bool], times: int = 1
) -> None:
    """Graph mode with ``float8.fsdp_all_gather``: before each forward (``times`` per
    step), one all-reduce of the float8 weights' amaxes (float32), outside the graphs."""
    from aotdist.fsdp.graph import float8_gathered

    n = len(float8_gathered(model))
    if not n:
        return
    c = next((c for c in out.collectives if c.kind == "all_reduce" and c.dim == dim), None)
    if c is None:
        c = Collective("all_reduce", dim, network=span.get(dim, False))
        out.collectives.append(c)
    c.count, c.bytes = c.count + times, c.bytes + times * 4 * n


def _unit_collectives(
    out: Plan, model: nn.Module, dims: tuple[str, ...], span: dict[str, bool], fsdp: Any
) -> None:
    """Hooks mode: per FSDP2 unit, one all-gather in the forward and, resharded after it,
    one in the backward; one reduce-scatter of its gradients; HSDP: one all-reduce. In
    ``fsdp.param_dtype`` / ``fsdp.reduce_dtype`` where set (FSDP2's mixed precision)."""
    from aotdist.config import torch_dtype
    from aotdist.float8 import float8_linears
    from aotdist.fsdp import fsdp_modules

    gather_dtype = torch_dtype(fsdp.param_dtype)
    reduce_dtype = torch_dtype(fsdp.reduce_dtype) or gather_dtype

    def size(p: torch.Tensor, dtype: torch.dtype | None) -> int:
        return (
            dtype.itemsize
            if dtype is not None and p.is_floating_point()
            else _local(p).element_size()
        )

    shard = dims[-1]
    ag = Collective("all_gather", shard, network=span[shard])
    rs = Collective("reduce_scatter", shard, network=span[shard])
    ar = Collective("all_reduce", dims[0], network=span[dims[0]]) if len(dims) == 2 else None
    units = {fqn: model.get_submodule(fqn) for fqn in fsdp_modules(model)}  # root: ""
    # torchao's weights with float8.fsdp_all_gather: FSDP2 gathers them at 1 byte per element
    float8 = {id(m.weight) for m in float8_linears(model) if m.config.enable_fsdp_float8_all_gather}
    for fqn, unit in units.items():
        nested = {
            id(q) for other in units.values() if _inside(other, unit) for q in other.parameters()
        }
        # fsdp.expert_params: each rank's experts, FSDP2's ignored_params, never gathered
        own = [p for p in unit.parameters() if id(p) not in nested and hasattr(p, "to_local")]
        full = sum(_padded(p) * (1 if id(p) in float8 else size(p, gather_dtype)) for p in own)
        grads = sum(_padded(p) * size(p, reduce_dtype) for p in own if p.requires_grad)
        shard_bytes = sum(_local(p).numel() * size(p, reduce_dtype) for p in own if p.requires_grad)
        out.gathered_unit_bytes = max(out.gathered_unit_bytes, full)
        gathers = 1 + (1 if fsdp.reshard_after_forward and fqn != "" else 0)
        ag.count, ag.bytes = ag.count + gathers, ag.bytes + gathers * full
        rs.count, rs.bytes = rs.count + 1, rs.bytes + grads
        if ar is not None:
            ar.count, ar.bytes = ar.count + 1, ar.bytes + shard_bytes
    out.collectives = [c for c in (ag, rs, ar) if c is not None and c.count]


def _padded(p: torch.Tensor) -> int:
    """Elements FSDP2 gathers for ``p``: dim 0 padded to a multiple of the shard count."""
    if not hasattr(p, "to_local") or p.dim() == 0:
        return p.numel()
    shards = p.device_mesh.size(-1)
    rows = -(-p.shape[0] // shards) * shards
    return rows * (p.numel() // max(p.shape[0], 1)) if p.shape[0] else 0


def _inside(inner: nn.Module, outer: nn.Module) -> bool:
    return inner is not outer and any(m is inner for m in outer.modules())
