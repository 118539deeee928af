"""``aotdist plan``: what one rank of a job holds and sends at N ranks, from the compile
the job runs, traced on this CPU.

:func:`plan` runs the job's own set-up and compile under fake tensors (no memory, no
weights) in a world of torch's ``fake`` process group: ``parallelize``, a step that
compiles (``aot_eager``), a steady step. Per rank: parameter, gradient and optimizer bytes,
what autograd saves in the steady step, and the collectives per step by kind and mesh
dimension (graph mode: the bucketed graphs, a region's subgraph once per call; hooks mode:
FSDP2's padded units). The peak is an estimate: held state, saved activations, the largest
gathered unit or bucket twice. A pipelined job is traced stage by stage through
``aotdist.pipeline`` (:mod:`.pipeline`); an expert-parallel one (``fsdp.expert_params``)
adds each rank's experts and its all-to-alls under balanced routing (:mod:`.experts`,
:mod:`.routing`); a context-parallel one (``cp``) traces a rank's ``seq / cp`` tokens and
adds torch's ring-attention transfers per SDPA call (:mod:`.context`). Method, checks
against real runs and worked examples: docs/scale.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import nn

from aotdist._compat.distributed import fake_tensor_mode
from aotdist.bench.saved import SavedBytes
from aotdist.errors import ConfigError
from aotdist.simulate.context import (
    ROTATES,
    AttentionCalls,
    _check_cp,
    _cp_inputs,
    _name_flattened_shard_dim,
    _ring_attention,
    _sequence,
)
from aotdist.simulate.experts import _check_imbalance, _expert_parallel, _phase, _routing
from aotdist.simulate.pipeline import _pipeline_plan, _stages_asked
from aotdist.simulate.report import OPTIMIZER_STATES, Collective, PipelinePlan, Plan, StagePlan
from aotdist.simulate.trace import (
    _fake_world,
    _float8_scale_all_reduce,
    _graph_collectives,
    _mean_of_first,
    _memory,
    _spans_nodes,
    _unit_collectives,
)

__all__ = ["OPTIMIZER_STATES", "ROTATES", "Collective", "PipelinePlan", "Plan", "StagePlan", "plan"]


def plan(
    build: Callable[[], tuple[nn.Module, tuple]],
    *,
    world: int,
    mesh: tuple[int, ...] | None = None,
    config: dict | None = None,
    optimizer: str = "adamw",
    loss_fn: Callable | None = None,
    gpus_per_node: int = 8,
    expert_imbalance: float = 1.0,
    cp: int = 1,
    cp_rotate: str = "allgather",
) -> Plan:
    """Traces one training step of the job at ``world`` ranks and returns its :class:`Plan`.

    Args:
        build: ``build() -> (model, inputs)``, called under fake tensors (no memory).
        world: Ranks.
        mesh: ``(shard,)`` or ``(replicate, shard)`` (HSDP); default ``(world,)``, or
            ``(world // pipeline.degree,)`` per stage when pipelined, ``(world // cp,)``
            with context parallelism (the data-parallel dimensions; ``cp`` is the last).
        config: The aotdist config of the job (``fsdp`` is turned on; it compiles with
            ``aot_eager``: the same graphs, nothing lowered). With ``pipeline.enabled``
            and ``pipeline.degree``, the job is ``aotdist.pipeline``'s: ``pp`` is the
            mesh's first dimension, each stage's first rank is traced through its
            schedule's steps, and the plan's figures are the stage with the largest peak
            (all stages: :attr:`Plan.pipeline`). ``build``'s inputs are one step's batch.
            With ``fsdp.expert_params`` the job is expert-parallel: ``build`` runs in the
            fake world (a model sizes its experts from ``dist.get_world_size()``), token
            counts read on the host are those of balanced routing (:attr:`Plan.routing`),
            and the plan adds each rank's experts and the all-to-alls per step.
        optimizer: ``adamw``, ``adam``, ``sgd`` or ``sgd-momentum`` (its state bytes).
        loss_fn: ``loss_fn(output) -> scalar``; default the mean of the first output.
        gpus_per_node: Ranks per node: a mesh dimension whose groups span nodes crosses
            the network.
        expert_imbalance: With ``fsdp.expert_params``: the hottest rank's tokens over the
            mean (1 to ``world``); the plan is that rank's (its all-to-all bytes and
            activations): ``F / world`` of every rank's router choices go to its experts.
        cp: Context parallelism: ranks sharing each sequence (torch's ``context_parallel``,
            the mesh ``(dp_replicate, dp_shard, cp)``). Each rank is traced with
            ``seq / cp`` tokens (every input of two or more dimensions narrowed along
            dimension 1); FSDP2 shards over ``dp_shard x cp`` (``dp_shard_cp``); the plan
            adds, per SDPA call, the transfers of torch's ring attention
            (:attr:`Plan.context_parallel`) and its largest working set to the peak.
        cp_rotate: ``allgather`` (torch's default) or ``alltoall``
            (``set_rotate_method``): how the keys and values go around the ring.

    Raises:
        ConfigError: A mesh that does not multiply to ``world``, an unknown optimizer, a
            process group already initialized in this process, a config that cannot run;
            expert parallelism whose step sends no all-to-all, reads a value on the host
            that balanced routing does not give, or is pipelined; an
            ``expert_imbalance`` outside 1 to ``world``, or without expert parallelism;
            a ``cp`` that does not divide ``world`` or the sequence in ``2 * cp`` chunks,
            that is pipelined or expert-parallel, or a model whose step calls no SDPA kernel.
    """
    config = dict(config or {})
    stages = _stages_asked(config)
    _check_cp(config, world, cp, cp_rotate)
    mesh = tuple(mesh or (world // stages // cp,))
    if world < 1 or stages * cp * math.prod(mesh) != world or len(mesh) not in (1, 2):
        per = f" x {stages} pipeline stages" if stages > 1 else ""
        per += f" x cp {cp}" if cp > 1 else ""
        raise ConfigError(
            f"plan: mesh {'x'.join(map(str, mesh))}{per} does not give {world} "
            "ranks. Fix: --mesh SHARD or REPLICATExSHARD, multiplying (times --pp, times "
            "--cp) to --world."
        )
    if optimizer not in OPTIMIZER_STATES:
        raise ConfigError(
            f"plan: unknown optimizer {optimizer!r}; one of {', '.join(OPTIMIZER_STATES)}"
        )
    config["fsdp"] = {**config.get("fsdp", {}), "enabled": True}
    # the job's compile, with aot_eager: the same graphs, nothing lowered
    config["compile"] = {**config.get("compile", {}), "enabled": True, "backend": "aot_eager"}
    dims = ("dp_shard",) if len(mesh) == 1 else ("dp_replicate", "dp_shard")
    _check_imbalance(config, world, expert_imbalance)
    if stages > 1 and config["fsdp"].get("expert_params"):
        raise ConfigError(
            "plan: expert parallelism (fsdp.expert_params) in a pipelined job is not "
            "planned: each stage's trace has no balanced-routing values. Fix: plan the "
            "expert-parallel job without --pp (pipeline.enabled: false)"
        )
    if stages > 1:
        return _pipeline_plan(
            build, world, mesh, dims, config, optimizer, loss_fn or _mean_of_first, gpus_per_node
        )
    # context parallelism: cp is the mesh's last dimension; FSDP2 shards over dp_shard x cp
    full = (*mesh, cp) if cp > 1 else mesh
    simulated = (*mesh[:-1], mesh[-1] * cp)
    with _fake_world(world):
        from torch.distributed.device_mesh import init_device_mesh

        import aotdist
        from aotdist.backends.bucketing import graphs_observed

        device_mesh = init_device_mesh("cpu", simulated, mesh_dim_names=dims)
        groups = {device_mesh.get_group(d).group_name: d for d in dims}
        # expert parallelism: token counts read on the host, known under balanced routing
        routing = _routing(config, groups, world, gpus_per_node, expert_imbalance)
        attention = AttentionCalls() if cp > 1 else None
        with fake_tensor_mode(routing or attention):
            model, inputs = build()
            seq = _sequence(inputs)
            if cp > 1:  # each rank's share of the sequence
                inputs = _cp_inputs(inputs, cp)
            aotdist.parallelize(model, config=config, mesh=device_mesh)
            loss_of = loss_fn or _mean_of_first
            with graphs_observed() as graphs, aotdist.metrics.track(model) as m:
                loss_of(model(*inputs)).backward()  # the compile, as the job's first step
            held = [*model.parameters(), *model.buffers()]
            # the steady step: what autograd saves once everything is compiled
            with SavedBytes(exclude=held) as saved, _phase(routing or attention, "forward"):
                loss = loss_of(model(*inputs))
            with _phase(routing or attention, "backward"):
                loss.backward()
        info = aotdist.parallelize_info(model)
        mode = info.config.fsdp.mode
        out = Plan(
            world=world,
            mesh=full,
            mesh_dims=(*dims, "cp") if cp > 1 else dims,
            fsdp_mode=mode,
            optimizer=optimizer,
        )
        _memory(out, model, optimizer)
        span = {d: _spans_nodes(simulated, i, gpus_per_node) for i, d in enumerate(dims)}
        if mode == "graph":
            _graph_collectives(out, graphs, groups, span)
            _float8_scale_all_reduce(out, model, dims[-1], span)
        else:
            _unit_collectives(out, model, dims, span, info.config.fsdp)
        out.activation_bytes = saved.activation_bytes
        if attention is not None:
            out.cp, out.cp_rotate = cp, cp_rotate
            network = _spans_nodes(full, len(full) - 1, gpus_per_node)
            _ring_attention(out, attention, cp, cp_rotate, network, seq)
            _name_flattened_shard_dim(out, dims[-1])
        if routing is not None:
            spans = world > gpus_per_node
            _expert_parallel(out, model, routing, info.config.fsdp, span, spans, world)
        out.regions = {
            name: {"call_sites": r.call_sites, "subgraphs": r.subgraphs}
            for name, r in m.regions.items()
        }
    return out
