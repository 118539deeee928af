"""``aotdist plan``: what one rank of a job holds and sends at N ranks, from the compile
the job runs, traced on this CPU.

:func:`plan` runs the job's own set-up and compile under fake tensors (no memory, no
weights) in a world of torch's ``fake`` process group: ``parallelize``, a step that
compiles (``aot_eager``), a steady step. Per rank: parameter, gradient and optimizer bytes,
what autograd saves in the steady step (as ``SavedBytes`` measures a real one), and the
collectives per step by kind and mesh dimension (graph mode: the bucketed graphs the job
compiles, a region's subgraph once per call; hooks mode: FSDP2's padded units). The peak
is an estimate: held state, saved activations, the largest gathered unit or bucket twice.
Method, checks against real runs and worked examples: docs/scale.md.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from aotdist._compat.distributed import fake_store, fake_tensor_mode
from aotdist.bench.saved import SavedBytes
from aotdist.errors import ConfigError

# optimizer -> float32 state tensors per parameter element
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1}
_KINDS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


@dataclass
class Collective:
    """The collectives of one kind over one mesh dimension in a training step, per rank.

    Attributes:
        kind: ``all_gather``, ``reduce_scatter`` or ``all_reduce``.
        dim: The mesh dimension (``dp_shard``, ``dp_replicate``) or process group.
        count: How many per step.
        bytes: Their unsharded bytes (a gather's output, a reduce-scatter's input).
        network: Whether the dimension crosses nodes (``gpus_per_node``).
    """

    kind: str
    dim: str
    count: int = 0
    bytes: int = 0
    network: bool = False


@dataclass
class Plan:
    """Per-rank memory and per-step collectives of one configuration (see :func:`plan`)."""

    world: int
    mesh: tuple[int, ...]
    mesh_dims: tuple[str, ...]
    fsdp_mode: str
    optimizer: str
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    activation_bytes: int = 0
    gathered_unit_bytes: int = 0
    collectives: list[Collective] = field(default_factory=list)
    regions: dict[str, dict] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        """Estimate: held state, saved activations, the largest unit gathered twice."""
        return (
            self.param_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.activation_bytes
            + 2 * self.gathered_unit_bytes
        )

    def to_json(self) -> str:
        """The plan as JSON (tools read this)."""
        return json.dumps({**asdict(self), "peak_bytes": self.peak_bytes}, indent=2)

    def table(self) -> str:
        """The plan as a short table (people read this)."""
        mesh = "x".join(map(str, self.mesh))
        lines = [
            f"plan: {self.world} ranks, mesh {mesh} ({', '.join(self.mesh_dims)}), "
            f"FSDP {self.fsdp_mode}, optimizer {self.optimizer} (per rank; simulated)",
            f"  parameters   {_mib(self.param_bytes)}",
            f"  gradients    {_mib(self.grad_bytes)}",
            f"  optimizer    {_mib(self.optimizer_bytes)}",
            f"  activations  {_mib(self.activation_bytes)} saved for backward",
            f"  peak (est.)  {_mib(self.peak_bytes)}",
            "  collectives per step:",
        ]
        for c in self.collectives:
            where = "network" if c.network else "within a node"
            lines.append(
                f"    {c.kind:<15}{c.dim:<14}{c.count:>5} x  {_mib(c.bytes)} unsharded ({where})"
            )
        for name, r in self.regions.items():
            lines.append(
                f"  region {name}: {r['call_sites']} call sites, {r['subgraphs']} subgraph(s)"
            )
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:10.1f} MiB"


def plan(
    build: Callable[[], tuple[nn.Module, tuple]],
    *,
    world: int,
    mesh: tuple[int, ...] | None = None,
    config: dict | None = None,
    optimizer: str = "adamw",
    loss_fn: Callable | None = None,
    gpus_per_node: int = 8,
) -> Plan:
    """Traces one training step of the job at ``world`` ranks and returns its :class:`Plan`.

    Args:
        build: ``build() -> (model, inputs)``, called under fake tensors (no memory).
        world: Ranks.
        mesh: ``(shard,)`` or ``(replicate, shard)`` (HSDP); default ``(world,)``.
        config: The aotdist config of the job (``fsdp`` is turned on; it compiles with
            ``aot_eager``: the same graphs, nothing lowered).
        optimizer: ``adamw``, ``adam``, ``sgd`` or ``sgd-momentum`` (its state bytes).
        loss_fn: ``loss_fn(output) -> scalar``; default the mean of the first output.
        gpus_per_node: Ranks per node: a mesh dimension whose groups span nodes crosses
            the network.

    Raises:
        ConfigError: A mesh that does not multiply to ``world``, an unknown optimizer, a
            process group already initialized in this process, a config that cannot run.
    """
    mesh = tuple(mesh or (world,))
    if world < 1 or math.prod(mesh) != world or len(mesh) not in (1, 2):
        raise ConfigError(
            f"plan: mesh {'x'.join(map(str, mesh))} does not give {world} "
            "ranks. Fix: --mesh SHARD or REPLICATExSHARD, multiplying to --world."
        )
    if optimizer not in OPTIMIZER_STATES:
        raise ConfigError(
            f"plan: unknown optimizer {optimizer!r}; one of {', '.join(OPTIMIZER_STATES)}"
        )
    config = dict(config or {})
    config["fsdp"] = {**config.get("fsdp", {}), "enabled": True}
    # the job's compile, with aot_eager: the same graphs, nothing lowered
    config["compile"] = {**config.get("compile", {}), "enabled": True, "backend": "aot_eager"}
    dims = ("dp_shard",) if len(mesh) == 1 else ("dp_replicate", "dp_shard")
    with _fake_world(world):
        from torch.distributed.device_mesh import init_device_mesh

        import aotdist
        from aotdist.backends.bucketing import graphs_observed

        device_mesh = init_device_mesh("cpu", mesh, mesh_dim_names=dims)
        with fake_tensor_mode():
            model, inputs = build()
            aotdist.parallelize(model, config=config, mesh=device_mesh)
            loss_of = loss_fn or _mean_of_first
            with graphs_observed() as graphs, aotdist.metrics.track(model) as m:
                loss_of(model(*inputs)).backward()  # the compile, as the job's first step
            held = [*model.parameters(), *model.buffers()]
            # the steady step: what autograd saves once everything is compiled
            with SavedBytes(exclude=held) as saved:
                loss = loss_of(model(*inputs))
            loss.backward()
        info = aotdist.parallelize_info(model)
        mode = info.config.fsdp.mode
        out = Plan(world=world, mesh=mesh, mesh_dims=dims, fsdp_mode=mode, optimizer=optimizer)
        _memory(out, model, optimizer)
        groups = {device_mesh.get_group(d).group_name: d for d in dims}
        span = {d: _spans_nodes(mesh, i, gpus_per_node) for i, d in enumerate(dims)}
        if mode == "graph":
            _graph_collectives(out, graphs, groups, span)
            _float8_scale_all_reduce(out, model, dims[-1], span)
        else:
            _unit_collectives(out, model, dims, span, info.config.fsdp)
        out.activation_bytes = saved.activation_bytes
        out.regions = {
            name: {"call_sites": r.call_sites, "subgraphs": r.subgraphs}
            for name, r in m.regions.items()
        }
    return out


@contextlib.contextmanager
def _fake_world(world: int) -> Iterator[None]:
    import torch.distributed as dist

    if dist.is_initialized():
        raise ConfigError(
            "plan: this process already has a process group; run aotdist plan "
            "in a process of its own (it makes a fake world of --world ranks)"
        )
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world)
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


def _float8_scale_all_reduce(out: Plan, model: nn.Module, dim: str, span: dict[str, bool]) -> None:
    """Graph mode with ``float8.fsdp_all_gather``: before each forward, one all-reduce of
    the float8 weights' amaxes (float32), outside the graphs."""
    from aotdist.fsdp.graph import float8_gathered

    n = len(float8_gathered(model))
    if not n:
        return
    c = next((c for c in out.collectives if c.kind == "all_reduce" and c.dim == dim), None)
    if c is None:
        c = Collective("all_reduce", dim, network=span.get(dim, False))
        out.collectives.append(c)
    c.count, c.bytes = c.count + 1, c.bytes + 4 * n


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
        own = [p for p in unit.parameters() if id(p) not in nested]
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
