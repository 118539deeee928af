"""``aotdist plan`` for a pipelined job (``pipeline.enabled``): each stage's first rank
traced in a fake world of its own through ``aotdist.pipeline`` and its schedule's steps."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable

import torch
from torch import nn

from aotdist._compat.distributed import fake_tensor_mode, group_of, ops_observed
from aotdist.bench.saved import SavedBytes
from aotdist.errors import ConfigError
from aotdist.simulate.report import Collective, PipelinePlan, Plan, StagePlan
from aotdist.simulate.trace import (
    _fake_world,
    _float8_scale_all_reduce,
    _graph_collectives,
    _memory,
    _spans_nodes,
)


def _stages_asked(config: dict) -> int:
    """The pipeline stages ``config`` asks for (1: not pipelined)."""
    pp = config.get("pipeline") or {}
    if not pp.get("enabled"):
        return 1
    if int(pp.get("degree", 0)) < 2:
        raise ConfigError(
            "plan: pipeline.enabled without pipeline.degree: the plan has no mesh to take "
            "the stages from. Fix: --pp STAGES (or pipeline.degree in the config)"
        )
    return int(pp["degree"])


def _pipeline_plan(
    build: Callable[[], tuple[nn.Module, tuple]],
    world: int,
    mesh: tuple[int, ...],
    dims: tuple[str, ...],
    config: dict,
    optimizer: str,
    loss_of: Callable,
    gpus_per_node: int,
) -> Plan:
    """Each stage's first rank traced in a fake world of its own, in stage order: the
    job's ``aotdist.pipeline`` (split, FSDP2 over the rest of the mesh, compile) and its
    schedule's steps on fake tensors; a stage's input shape is the last one's output."""
    from aotdist.config import as_config

    cfg = as_config(config)
    degree, micro = cfg.pipeline.degree, cfg.pipeline.microbatches
    per_rank = cfg.pipeline.local_stages
    full = (degree, *mesh)
    per_stage = math.prod(mesh)
    span = {d: _spans_nodes(full, i + 1, gpus_per_node) for i, d in enumerate(dims)}
    pp = PipelinePlan(
        degree=degree,
        schedule=cfg.pipeline.schedule,
        microbatches=micro,
        # v stages per rank shorten the fill and drain v-fold (Megatron's interleaving)
        bubble_fraction=(degree - 1) / (per_rank * micro + degree - 1),
        network=_spans_nodes(full, 0, gpus_per_node),
        stages_per_rank=per_rank,
    )
    received: dict = {}  # stage -> its input's (shape, dtype)
    if per_rank > 1:  # rank 0's second stage follows the last rank's first: found up front
        received = _stage_inputs(build, cfg, world, degree * per_rank)
    for index in range(degree):
        ranks = (index * per_stage, (index + 1) * per_stage - 1)
        with _fake_world(world, rank=ranks[0]):
            stage, outputs = _trace_stage(
                build, cfg, full, dims, span, loss_of, optimizer, received
            )
        received.update({s + 1: out for s, out in outputs.items()})
        stage.index, stage.ranks = index, ranks
        if per_rank == 1:
            stage.in_flight = micro if pp.schedule == "GPipe" else min(micro, degree - index)
        stage.activation_bytes = stage.microbatch_activation_bytes * stage.in_flight
        pp.stages.append(stage)
    top = max(pp.stages, key=lambda st: st.peak_bytes)  # the rank that binds
    out = Plan(
        world=world,
        mesh=full,
        mesh_dims=("pp", *dims),
        fsdp_mode=cfg.fsdp.mode,
        optimizer=optimizer,
        pipeline=pp,
    )
    for name in (
        "param_bytes",
        "grad_bytes",
        "optimizer_bytes",
        "activation_bytes",
        "gathered_unit_bytes",
        "collectives",
        "regions",
    ):
        setattr(out, name, getattr(top, name))
    return out


def _stage_inputs(build, cfg, world: int, stages: int) -> dict:
    """Each stage's input ``(shape, dtype)`` after the first, from one build."""
    from aotdist.pipelining import _stage_inputs as inputs_of

    with _fake_world(world), fake_tensor_mode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        model, inputs = build()
        microbatch = tuple(t.chunk(cfg.pipeline.microbatches)[0] for t in inputs)
        return inputs_of(model, microbatch, cfg, stages)


def _trace_stage(build, cfg, full, dims, span, loss_of, optimizer, received):
    """(this rank's :class:`StagePlan`, its stages' outputs' ``(shape, dtype)`` by stage)."""
    from torch.distributed.device_mesh import init_device_mesh

    import aotdist
    from aotdist.backends.bucketing import graphs_observed
    from aotdist.pipelining import _pipeline

    device_mesh = init_device_mesh("cpu", full, mesh_dim_names=("pp", *dims))
    micro = cfg.pipeline.microbatches
    with fake_tensor_mode(), warnings.catch_warnings():
        # the split's deepcopy asks fake tensors for a data pointer: not the user's concern
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        model, inputs = build()
        microbatch = tuple(t.chunk(micro)[0] for t in inputs)
        pipe, outputs = _pipeline(
            model,
            microbatch,
            lambda out, target: loss_of(out),
            cfg,
            device_mesh,
            received=received,
        )

        def step() -> None:
            if pipe.is_first:
                pipe.step(*inputs)
            else:  # the loss ignores the target: any tensor of the batch's rows
                pipe.step(target=inputs[0], losses=[]) if pipe.is_last else pipe.step()

        with graphs_observed() as graphs, contextlib.ExitStack() as stack:
            tracked = [stack.enter_context(aotdist.metrics.track(m)) for m in pipe.modules]
            step()  # the compile, as the job's first step
        held = [*pipe.module.parameters(), *pipe.module.buffers()]
        with SavedBytes(exclude=held) as saved:  # the steady step's, every micro-batch's
            step()
        names = {device_mesh.get_group(d).group_name: d for d in dims}
        names[device_mesh.get_group("pp").group_name] = "pp"
        with _CountedCollectives(names) as counted:
            step()
    out = StagePlan(index=0, ranks=(0, 0), units=pipe.units, stages=pipe.stage_indices)
    _memory(out, pipe.module, optimizer)
    # with several stages per rank: one stage's micro-batch, the mean over the rank's stages
    out.microbatch_activation_bytes = saved.activation_bytes // (micro * len(pipe.modules))
    if len(pipe.modules) > 1:
        out.in_flight = _in_flight(pipe.schedule.pipeline_order[pipe.stage_index])
    out.sends, out.recvs = counted.sends, counted.recvs
    if cfg.fsdp.mode == "graph":  # each micro-batch runs the stage's graphs once
        _graph_collectives(out, graphs, names, span)
        for c in out.collectives:
            c.count, c.bytes = c.count * micro, c.bytes * micro
        _float8_scale_all_reduce(out, pipe.module, dims[-1], span, times=micro)
    else:  # FSDP2's, as torch's pipelining issues them (its gradient sync deferred)
        out.collectives = [
            Collective(kind, dim, count, nbytes, network=span.get(dim, False))
            for (kind, dim), (count, nbytes) in sorted(counted.collectives.items())
        ]
        out.gathered_unit_bytes = counted.largest_gather
    for m in tracked:  # the rank's stages together
        for name, r in m.regions.items():
            held = out.regions.setdefault(name, {"call_sites": 0, "subgraphs": 0})
            held["call_sites"] += r.call_sites
            held["subgraphs"] += r.subgraphs
    return out, {s: (tuple(t.shape), t.dtype) for s, t in outputs.items()}


def _in_flight(actions: list) -> int:
    """The most stage micro-batches whose forward ran and backward did not, at once, in
    one rank's order of actions (torch's own schedule: ``pipeline_order``)."""
    live = peak = 0
    for action in actions:
        if action is None:  # a bubble
            continue
        kind = action.computation_type
        live += 1 if kind == "F" else -1 if kind in ("B", "I") else 0
        peak = max(peak, live)
    return peak


class _CountedCollectives:
    """Within: the ``c10d`` collectives and point-to-point transfers that run, counted by
    kind and mesh dimension (bytes: the unsharded side, the largest tensor of the call)."""

    _KINDS = {
        "allgather": "all_gather",
        "reducescatter": "reduce_scatter",
        "allreduce": "all_reduce",
    }

    def __init__(self, names: dict[str, str]):
        self.names = names
        self.collectives: dict[tuple[str, str], tuple[int, int]] = {}
        self.sends, self.recvs = [0, 0], [0, 0]
        self.largest_gather = 0

    def __enter__(self) -> _CountedCollectives:
        self._observed = ops_observed(self._count)
        self._observed.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._observed.__exit__(*exc)

    def _count(self, name: str, leaves: list) -> None:
        space, _, op = name.partition("::")
        if space != "c10d":
            return
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        nbytes = max((t.numel() * t.element_size() for t in tensors), default=0)
        if op in ("send", "recv_"):
            side = self.sends if op == "send" else self.recvs
            side[0], side[1] = side[0] + 1, side[1] + nbytes
            return
        kind = next((v for k, v in self._KINDS.items() if k in op.replace("_", "")), None)
        if kind is None:
            return
        group = group_of(leaves)
        key = (kind, self.names.get(group.group_name, group.group_name))
        count, total = self.collectives.get(key, (0, 0))
        self.collectives[key] = (count + 1, total + nbytes)
        if kind == "all_gather":
            self.largest_gather = max(self.largest_gather, nbytes)
