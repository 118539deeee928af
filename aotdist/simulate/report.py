"""``aotdist plan``'s result: per-rank memory, collectives per step, a pipelined job's
stages, as a table and as JSON (:mod:`aotdist.simulate`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

# optimizer -> float32 state tensors per parameter element
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1}


@dataclass
class Collective:
    """The collectives of one kind over one mesh dimension in a training step, per rank.

    Attributes:
        kind: ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``, or
            ``permute`` (context parallelism's ring: one peer's whole buffer).
        dim: The mesh dimension (``dp_shard``, ``dp_replicate``, ``dp_shard_cp``, ``cp``)
            or process group.
        count: How many per step.
        bytes: Their unsharded bytes (a gather's output, a reduce-scatter's input); an
            all-to-all's or a permute's: what this rank sends.
        network: Whether the dimension crosses nodes (``gpus_per_node``).
        phase: ``forward`` or ``backward`` for an all-to-all and context parallelism's
            transfers; empty for FSDP's (per step).
    """

    kind: str
    dim: str
    count: int = 0
    bytes: int = 0
    network: bool = False
    phase: str = ""


@dataclass
class StagePlan:
    """One pipeline stage's rank (an interleaved schedule's: its stages'): what it holds
    and what it sends per step.

    Attributes:
        index: The stage (interleaved: the pipeline rank).
        ranks: Its first and last global rank (the ``pp`` dimension is the mesh's first).
        units: The stage's modules (region instances and the modules around them).
        param_bytes, grad_bytes, optimizer_bytes: As :class:`Plan`'s, for this stage.
        activation_bytes: Saved for backward at the schedule's peak: one micro-batch's
            saved bytes times the micro-batches in flight (GPipe: all of them; 1F1B:
            ``stages - index``, at most all of them; interleaved: counted on torch's
            order of the rank's actions, a stage's micro-batch each).
        microbatch_activation_bytes: One micro-batch's saved bytes (interleaved: of one
            stage, the mean over the rank's stages).
        in_flight: Micro-batches whose activations the stage holds at once.
        stages: Interleaved: the stages the rank holds (``index``, ``index + degree``...).
        gathered_unit_bytes: The largest FSDP unit or bucket it gathers.
        sends, recvs: Point-to-point transfers per step (activations forward, gradients
            back): ``[count, bytes]``.
        collectives: Its FSDP collectives per step (every micro-batch's).
        regions: Call sites and subgraphs per region class, in this stage.
    """

    index: int
    ranks: tuple[int, int]
    units: tuple[str, ...]
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    activation_bytes: int = 0
    microbatch_activation_bytes: int = 0
    in_flight: int = 0
    gathered_unit_bytes: int = 0
    sends: list[int] = field(default_factory=lambda: [0, 0])
    recvs: list[int] = field(default_factory=lambda: [0, 0])
    collectives: list[Collective] = field(default_factory=list)
    regions: dict[str, dict] = field(default_factory=dict)
    stages: tuple[int, ...] = ()

    @property
    def peak_bytes(self) -> int:
        """Estimate, as :attr:`Plan.peak_bytes`, for this stage's rank."""
        return _peak(self)


@dataclass
class PipelinePlan:
    """A pipelined job's schedule and stages (:func:`plan` with ``pipeline.enabled``).

    Attributes:
        degree: Pipeline ranks (stages, with one per rank).
        schedule: ``1F1B``, ``GPipe``, ``Interleaved1F1B`` or ``LoopedBFS``.
        microbatches: Micro-batches per step.
        bubble_fraction: The share of a step each rank idles, ``(degree - 1) /
            (stages_per_rank * microbatches + degree - 1)`` for every schedule (forward
            and backward of a micro-batch taken as equal on every stage).
        network: Whether the stage-to-stage transfers cross nodes.
        stages: Each stage's (interleaved: each pipeline rank's) :class:`StagePlan`.
        stages_per_rank: Stages each rank holds (``pipeline.stages_per_rank``).
    """

    degree: int
    schedule: str
    microbatches: int
    bubble_fraction: float
    network: bool
    stages: list[StagePlan] = field(default_factory=list)
    stages_per_rank: int = 1


@dataclass
class Plan:
    """Per-rank memory and per-step collectives of one configuration (see :func:`plan`).

    An expert-parallel job (``fsdp.expert_params``) adds ``expert_param_bytes`` (this
    rank's experts, held whole; part of ``param_bytes``), ``all_to_all`` (per phase and
    mesh dimension: count and the bytes this rank sends, its own share included) and
    ``routing``, the assumption its token counts were read under.
    """

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
    pipeline: PipelinePlan | None = None
    expert_param_bytes: int = 0
    all_to_all: list[Collective] = field(default_factory=list)
    routing: str = ""
    cp: int = 1
    cp_rotate: str = ""
    cp_calls: int = 0
    cp_seq: int = 0
    cp_buffer_bytes: int = 0
    cp_note: str = ""
    context_parallel: list[Collective] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        """Estimate: held state, saved activations, the largest unit gathered twice (and
        with context parallelism, ring attention's working set of one call)."""
        return _peak(self) + self.cp_buffer_bytes

    def to_json(self) -> str:
        """The plan as JSON (tools read this)."""
        out = {**asdict(self), "peak_bytes": self.peak_bytes}
        if self.pipeline is not None:
            for stage, plan in zip(out["pipeline"]["stages"], self.pipeline.stages, strict=True):
                stage["peak_bytes"] = plan.peak_bytes
        return json.dumps(out, indent=2)

    def table(self) -> str:
        """The plan as a short table (people read this)."""
        mesh = "x".join(map(str, self.mesh))
        lines = [
            f"plan: {self.world} ranks, mesh {mesh} ({', '.join(self.mesh_dims)}), "
            f"FSDP {self.fsdp_mode}, optimizer {self.optimizer} (per rank; simulated)",
            f"  parameters   {_mib(self.param_bytes)}",
            *(
                [f"    experts    {_mib(self.expert_param_bytes)} this rank's, whole"]
                if self.routing
                else []
            ),
            f"  gradients    {_mib(self.grad_bytes)}",
            f"  optimizer    {_mib(self.optimizer_bytes)}",
            f"  activations  {_mib(self.activation_bytes)} saved for backward"
            + (
                f" (traced at {self.cp_seq // self.cp} of {self.cp_seq} tokens)"
                if self.cp > 1
                else ""
            ),
            *(
                [f"  ring buffers {_mib(self.cp_buffer_bytes)} one SDPA call's (projected)"]
                if self.cp > 1
                else []
            ),
            f"  peak (est.)  {_mib(self.peak_bytes)}",
            "  collectives per step:",
        ]
        for c in self.collectives:
            where = "network" if c.network else "within a node"
            lines.append(
                f"    {c.kind:<15}{c.dim:<14}{c.count:>5} x  {_mib(c.bytes)} unsharded ({where})"
            )
        if self.routing:
            lines.append(f"  all-to-all per step, assuming {self.routing}:")
        for c in self.all_to_all:
            where = "network" if c.network else "within a node"
            lines.append(
                f"    {c.phase:<15}{c.dim:<14}{c.count:>5} x  {_mib(c.bytes)} sent ({where})"
            )
        if self.cp > 1:
            lines.append(
                f"  ring attention per step, cp {self.cp}, rotate {self.cp_rotate}, "
                f"{self.cp_calls} SDPA calls (torch's ring functions, checked on gloo):"
            )
            if self.cp_note:
                lines.append(f"    note: {self.cp_note}")
        for c in self.context_parallel:
            where = "network" if c.network else "within a node"
            what = "gathered" if c.kind == "all_gather" else "sent"
            lines.append(
                f"    {c.phase:<9}{c.kind:<11}{c.dim:<9}{c.count:>6} x  {_mib(c.bytes)} "
                f"{what} ({where})"
            )
        for name, r in self.regions.items():
            lines.append(
                f"  region {name}: {r['call_sites']} call sites, {r['subgraphs']} subgraph(s)"
            )
        if self.pipeline is not None:
            lines += _pipeline_lines(self.pipeline)
        return "\n".join(lines)


def _peak(held: Plan | StagePlan) -> int:
    return (
        held.param_bytes
        + held.grad_bytes
        + held.optimizer_bytes
        + held.activation_bytes
        + 2 * held.gathered_unit_bytes
    )


def _pipeline_lines(pp: PipelinePlan) -> list[str]:
    where = "network" if pp.network else "within a node"
    per = pp.stages_per_rank
    held = f"{pp.degree} ranks x {per} stages" if per > 1 else f"{pp.degree} stages"
    lines = [
        f"  pipeline: {held}, {pp.schedule}, {pp.microbatches} micro-batches; "
        f"bubble {100 * pp.bubble_fraction:.1f}% of each step; the figures above are the "
        f"{'rank' if per > 1 else 'stage'} with the largest peak",
    ]
    for st in pp.stages:
        name = f"pp rank {st.index}, stages {', '.join(map(str, st.stages))}" if per > 1 else ""
        lines.append(
            f"    {name or f'stage {st.index}'} (ranks {st.ranks[0]}-{st.ranks[1]}, "
            f"{st.units[0]} .. "
            f"{st.units[-1]}): peak {_size(st.peak_bytes)}, parameters "
            f"{_size(st.param_bytes)}, activations {st.in_flight} x "
            f"{_size(st.microbatch_activation_bytes)}"
        )
        lines.append(
            f"      point-to-point per step: {st.sends[0]} sends, {_size(st.sends[1])}; "
            f"{st.recvs[0]} receives, {_size(st.recvs[1])} ({where})"
        )
    return lines


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _mib(n: int) -> str:
    return f"{n / 2**20:10.1f} MiB"
