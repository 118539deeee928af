"""``aotdist.pipeline``: a model split into pipeline stages at region boundaries, each stage
parallelized by :func:`aotdist.parallelize`, run by a ``torch.distributed.pipelining``
schedule.

The split is torchtitan's: every rank builds the whole model, keeps its stage's modules and
drops the others (a block of a ``ModuleDict`` / ``ModuleList`` is deleted, keeping the
names of the rest; any other module is set to ``None``), so the model's ``forward`` must
skip what is ``None``, as torchtitan's models do. A stage's units are the region instances
and the modules outside them, in the order the model registers them. The shapes between
stages are found once, on meta tensors (torch 2.11 would otherwise run each stage on
zeros: BatchNorm's statistics move and a second graph compiles).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from aotdist._compat import fake_constant, fake_mode_of
from aotdist.config import AOTDistConfig, as_config, torch_dtype
from aotdist.config.validation import did_you_mean
from aotdist.errors import ConfigError
from aotdist.parallelize import parallelize, refuse_context_parallel
from aotdist.regions import find_regions

_SCHEDULES = {
    "1F1B": "Schedule1F1B",
    "GPipe": "ScheduleGPipe",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "LoopedBFS": "ScheduleLoopedBFS",
}
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
_DESCRIPTOR = 12  # dtype code, ndim, up to 10 sizes


@dataclass
class Pipeline:
    """This rank's stages of a pipelined model and the schedule that runs them.

    Attributes:
        module: The stage's modules, parallelized (build the optimizer on its parameters);
            with several stages per rank (an interleaved schedule), an ``nn.ModuleList`` of
            them (its names are prefixed by the stage's position: see ``modules``).
        stage_index: This rank's (first) stage.
        stages: How many stages, over all ranks.
        units: The modules of this rank's stages (region instances and modules outside
            the regions), in stage order.
        schedule: The ``torch.distributed.pipelining`` schedule.
        microbatches: Micro-batches per step.
        modules: Each of this rank's stages, in stage order, parallelized on its own; each
            keeps the whole model's names.
        stage_indices: Their stages: ``stage_index``, then every pipeline degree-th after it.
    """

    module: nn.Module
    stage_index: int
    stages: int
    units: tuple[str, ...]
    schedule: Any
    microbatches: int
    modules: tuple[nn.Module, ...] = ()
    stage_indices: tuple[int, ...] = ()

    @property
    def is_first(self) -> bool:
        return 0 in (self.stage_indices or (self.stage_index,))

    @property
    def is_last(self) -> bool:
        return self.stages - 1 in (self.stage_indices or (self.stage_index,))

    def step(self, *args: Any, target: Any = None, losses: list | None = None) -> Any:
        """One step of the schedule: the first stage takes the batch (``args``), the last
        the ``target`` and a list that receives each micro-batch's loss. Every rank may
        pass both (one loop for all ranks): a stage ignores what it does not take. Returns
        the last stage's output.

        Raises:
            ConfigError: The batch does not divide into ``microbatches``.
        """
        if not self.is_first:
            args = ()  # the stage's input comes from the stage before
        if not self.is_last:
            target = losses = None
        for value in (*args, target):
            if isinstance(value, torch.Tensor) and value.shape[0] % self.microbatches:
                raise ConfigError(
                    f"a batch of {value.shape[0]} rows does not divide into "
                    f"pipeline.microbatches = {self.microbatches}. Fix: make the batch size "
                    "a multiple of pipeline.microbatches, or change it"
                )
        if not self.is_last:
            return self.schedule.step(*args)
        return self.schedule.step(*args, target=target, losses=losses)


def pipeline(
    model: nn.Module,
    *,
    microbatch: Sequence[torch.Tensor],
    loss_fn: Callable,
    config: AOTDistConfig | Mapping | str | os.PathLike | None = None,
    mesh: Any = None,
) -> Pipeline:
    """Splits ``model`` into ``pipeline.degree`` stages (times ``pipeline.stages_per_rank``
    for an interleaved schedule), keeps this rank's, parallelizes each as
    :func:`aotdist.parallelize` does and builds the schedule.

    Args:
        model: The whole model, built the same on every rank; its ``forward`` skips the
            modules set to ``None`` on other stages.
        microbatch: One micro-batch of the first stage's inputs (its shapes and dtypes).
        loss_fn: ``loss_fn(output, target)`` of the last stage.
        config: As for :func:`aotdist.parallelize`, with ``pipeline.enabled``.
        mesh: A mesh with a ``pp`` dimension (its other dimensions but ``tp`` go to
            FSDP2; ``tp`` is the user's tensor parallelism, applied to ``model`` before
            this call), or ``None``: every rank is one stage.

    Returns:
        This rank's :class:`Pipeline`.

    Raises:
        ConfigError: No process group, a degree that is not the mesh's, a split point that
            names no unit (one inside a region: split at the region), a stage without
            parameters, fewer region instances than stages.
    """
    return _pipeline(model, microbatch, loss_fn, as_config(config), mesh)[0]


def _pipeline(
    model: nn.Module,
    microbatch: Sequence[torch.Tensor],
    loss_fn: Callable,
    config: AOTDistConfig,
    mesh: Any,
    received: Mapping[int, tuple[tuple[int, ...], torch.dtype]] | None = None,
) -> tuple[Pipeline, dict[int, torch.Tensor]]:
    """:func:`pipeline`, and each of its stages' micro-batch output (meta tensors) by stage.
    ``received``: the stages' inputs ``(shape, dtype)`` by stage, where the stages before
    did not run in this world (``aotdist plan`` traces one rank at a time): read there,
    nothing received or sent."""
    if not config.pipeline.enabled:
        raise ConfigError(
            "aotdist.pipeline needs pipeline.enabled: true. Fix: set it, or call "
            "aotdist.parallelize for a model that is not pipelined"
        )
    group, rank, degree, inner_mesh = _placement(config, mesh)
    pp = config.pipeline
    _check_rounds(pp.schedule, pp.microbatches, degree)
    total = degree * pp.local_stages
    units, stage_of = _split(model, config, total)
    held = tuple(range(rank, total, degree))  # torch's looped placement: stage s on rank s % degree
    # FSDP2's param_dtype: the stage computes, and sends, in it (its inputs cast too)
    compute = torch_dtype(config.fsdp.param_dtype) if config.fsdp.enabled else None
    parts, shapes = [], {}
    for index in held:  # in stage order: each one's input is the output of the one before
        part = _keep(model, units, tuple(u for u in units if stage_of[u] == index))
        shapes[index] = _shapes(part, microbatch, index, total, group, received, compute)
        parts.append(part)
    rest = config.replace(pipeline={"enabled": False})
    for part in parts:
        parallelize(part, config=rest, mesh=inner_mesh)

    from torch.distributed import pipelining

    device = next(iter(parts[0].parameters())).device
    stages = [
        pipelining.PipelineStage(part, index, total, device, *shapes[index], group=group)
        for part, index in zip(parts, held, strict=True)
    ]
    cls = getattr(pipelining, _SCHEDULES[pp.schedule])
    schedule = cls(
        stages if len(stages) > 1 else stages[0], n_microbatches=pp.microbatches, loss_fn=loss_fn
    )
    module = parts[0] if len(parts) == 1 else nn.ModuleList(parts)
    mine = tuple(u for u in units if stage_of[u] in held)
    pipe = Pipeline(module, rank, total, mine, schedule, pp.microbatches, tuple(parts), held)
    return pipe, {index: shapes[index][1] for index in held}


def _check_rounds(schedule: str, microbatches: int, degree: int) -> None:
    """torch's Interleaved1F1B runs ``max(1, microbatches // degree)`` rounds, which must
    divide the micro-batches; said here, with the fix, rather than by its ValueError."""
    rounds = max(1, microbatches // degree)
    if schedule == "Interleaved1F1B" and microbatches % rounds:
        raise ConfigError(
            f"pipeline.microbatches = {microbatches} over {degree} pipeline ranks: "
            f"Interleaved1F1B runs {microbatches} // {degree} = {rounds} rounds of "
            "micro-batches, which must divide them. Fix: a multiple of the pipeline "
            f"degree ({degree * rounds} or {degree * (rounds + 1)}), or fewer micro-batches "
            "than pipeline ranks"
        )


def _placement(config: AOTDistConfig, mesh: Any) -> tuple[Any, int, int, Any]:
    """(pp group, this rank's stage, degree, the mesh left for FSDP2 or ``None``)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError(
            "aotdist.pipeline needs a process group (one rank per stage). Fix: call "
            "torch.distributed.init_process_group first (torchrun, accelerate launch)"
        )
    wanted = config.pipeline.degree
    if mesh is None:
        degree = dist.get_world_size()
        if config.fsdp.enabled or (wanted and wanted != degree):
            raise ConfigError(
                f"pipeline.degree {wanted or degree} with "
                f"{'fsdp.enabled' if config.fsdp.enabled else 'no mesh'} over "
                f"{degree} ranks: without a mesh every rank is one stage. Fix: pass "
                "mesh=init_device_mesh(device, (pp, dp), mesh_dim_names=('pp', 'dp'))"
            )
        return dist.group.WORLD, dist.get_rank(), degree, None
    names = tuple(mesh.mesh_dim_names or ())
    refuse_context_parallel(mesh)
    if "pp" not in names:
        raise ConfigError(
            f"the mesh's dimensions are {names}; aotdist.pipeline needs one named 'pp'. "
            "Fix: init_device_mesh(device, (pp, dp), mesh_dim_names=('pp', 'dp'))"
        )
    pp = mesh["pp"]
    degree = pp.size()
    if wanted and wanted != degree:
        raise ConfigError(
            f"pipeline.degree is {wanted} but the mesh's pp dimension has {degree} ranks. "
            "Fix: set pipeline.degree to 0 (the mesh's), or build the mesh to match"
        )
    # the user's tensor parallelism holds "tp"; FSDP2 shards over the rest
    others = tuple(n for n in names if n not in ("pp", "tp"))
    inner = None
    if others and config.fsdp.enabled:
        inner = mesh[others[0] if len(others) == 1 else others]
    replicas = math.prod(mesh[n].size() for n in others)
    if inner is None and replicas > 1:
        raise ConfigError(
            f"the mesh's {others} dimension(s) hold {replicas} copies of each stage, but "
            "fsdp.enabled is false, so nothing would average their gradients (each copy "
            "would train on its own data and drift apart). Fix: fsdp.enabled: true (FSDP2 "
            "over them), or a mesh with only pp (and tp)"
        )
    return pp.get_group(), pp.get_local_rank(), degree, inner


def _units(model: nn.Module, instances: set[str]) -> list[str]:
    """The model's modules in registration order, each module holding a region instance
    opened into its children, so that region instances and the modules around them are
    the units."""
    out: list[str] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            holds = any(i.startswith(fqn + ".") for i in instances)
            if fqn in instances or not holds:
                out.append(fqn)
            else:
                visit(child, fqn + ".")

    visit(model, "")
    return out


def _split(model: nn.Module, config: AOTDistConfig, stages: int) -> tuple[list[str], dict]:
    rc = config.regions
    plan = find_regions(model, include=rc.include, exclude=rc.exclude, min_repeats=rc.min_repeats)
    instances = {fqn for region in plan for fqn in region.fqns}
    units = _units(model, instances)
    points = list(config.pipeline.split_points)
    if not points:
        ordered = [u for u in units if u in instances]
        if len(ordered) < stages:
            raise ConfigError(
                f"{len(ordered)} region instance(s) cannot make {stages} pipeline stages. "
                "Fix: lower pipeline.degree (or pipeline.stages_per_rank), or name "
                "pipeline.split_points"
            )
        per, extra = divmod(len(ordered), stages)
        starts = [sum(per + (k < extra) for k in range(s)) for s in range(1, stages)]
        points = [ordered[i] for i in starts]
    elif len(points) != stages - 1:
        raise ConfigError(
            f"pipeline.split_points names {len(points)} point(s) for {stages} stages. "
            "Fix: give one split point fewer than the stages"
        )
    positions = []
    for point in points:
        if point not in units:
            inside = [i for i in instances if point.startswith(i + ".")]
            fix = (
                f"{point!r} is inside the region instance {inside[0]!r}: a stage boundary "
                f"cannot split a region. Fix: split at {inside[0]!r}"
                if inside
                else f"{point!r} names no module of the model{did_you_mean(point, units)}. "
                f"Fix: use one of {units}"
            )
            raise ConfigError(f"pipeline.split_points: {fix}")
        positions.append(units.index(point))
    if positions != sorted(set(positions)) or positions[0] == 0:
        raise ConfigError(
            f"pipeline.split_points {points} are not in the model's order after its first "
            f"module: each stage must start after the last. Fix: pick them, in order, from "
            f"{units[1:]}"
        )
    bounds = [0, *positions, len(units)]
    stage_of = {u: s for s in range(stages) for u in units[bounds[s] : bounds[s + 1]]}
    params = {u: sum(p.numel() for p in model.get_submodule(u).parameters()) for u in units}
    for s in range(stages):
        held = units[bounds[s] : bounds[s + 1]]
        if not any(params[u] for u in held):
            raise ConfigError(
                f"pipeline stage {s} ({held}) has no parameters: it would train nothing and "
                "its schedule has no gradient to send. Fix: move pipeline.split_points"
            )
    return units, stage_of


def _keep(model: nn.Module, units: list[str], mine: tuple[str, ...]) -> nn.Module:
    """A copy of ``model`` with only ``mine`` among ``units``."""
    # fake tensors (aotdist plan) hold their FakeTensorMode: copied with them, the mode's
    # StorageWeakRefs of its constants got a second owner each, released twice (a freed
    # storage, a heap corrupted at exit); the copy stays in the mode it was made in. A fake
    # tensor made from a constant (Gemma's torch.tensor(embed_scale)) holds the real one,
    # which cannot be copied inside the mode: the copies share it (the mode never writes it)
    tensors = [t for module in model.modules() for t in _tensors_in(vars(module))]
    kept = {fake_mode_of([t]) for t in tensors} | {fake_constant(t) for t in tensors}
    part = copy.deepcopy(model, {id(obj): obj for obj in kept - {None}})
    for fqn in units:
        if fqn in mine:
            continue
        parent_name, _, name = fqn.rpartition(".")
        parent = part.get_submodule(parent_name) if parent_name else part
        if isinstance(parent, (nn.ModuleDict, nn.ModuleList)):
            delattr(parent, name)  # the other blocks keep their names
        else:
            setattr(parent, name, None)
    return part


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` and in the dicts, lists, tuples and sets it holds."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def _shapes(
    stage: nn.Module,
    microbatch: Sequence[torch.Tensor],
    index: int,
    stages: int,
    group: Any,
    received: Mapping[int, tuple[tuple[int, ...], torch.dtype]] | None = None,
    compute: torch.dtype | None = None,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """This stage's micro-batch input and output as meta tensors: the first stage's from
    ``microbatch``, each later one's received from the stage before (its output, on the
    pipeline rank before), or, with ``received`` (stage -> input), read there and nothing
    sent. ``compute``: FSDP2's ``param_dtype``, which the stage's floating
    parameters and forward inputs are cast to (buffers are not), so its output, and what
    the next stage receives, is in it."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group) if received is None else [0]
    before, after = ranks[(index - 1) % len(ranks)], ranks[(index + 1) % len(ranks)]
    if index == 0:
        inputs = tuple(t.to("meta") for t in microbatch)
    elif received is not None:
        shape, dtype = received[index]
        inputs = (
            torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point),
        )
    else:
        descriptor = torch.zeros(_DESCRIPTOR, dtype=torch.int64)
        dist.recv(descriptor, src=before, group=group)
        inputs = (_from_descriptor(descriptor, requires_grad=True),)

    def meta(t: torch.Tensor, cast: bool) -> torch.Tensor:
        floating = cast and compute is not None and t.is_floating_point()
        return t.to("meta", dtype=compute if floating else t.dtype)

    state = {k: meta(v, True) for k, v in stage.named_parameters()}
    state.update({k: meta(v, False) for k, v in stage.named_buffers()})
    try:
        with torch.no_grad():
            args = tuple(meta(t, True) for t in inputs)
            out = torch.func.functional_call(stage, state, args)
    except TypeError as exc:
        if "'NoneType' object is not callable" not in str(exc):
            raise
        raise ConfigError(
            f"pipeline stage {index}: the model's forward calls a module another stage holds "
            f"(set to None on this one): {exc}. aotdist.pipeline splits the model the way "
            "torchtitan does, so its forward must skip what is None (`x = self.tok(x) if "
            "self.tok is not None else x`), as torchtitan's models do; transformers' models "
            "do not. Fix: skip the None modules in forward, or use a torchtitan model"
        ) from exc
    if not isinstance(out, torch.Tensor):
        raise ConfigError(
            f"pipeline stage {index} returns {type(out).__name__}; aotdist.pipeline passes one "
            "tensor between stages. Fix: return a tensor from each stage's forward"
        )
    output = torch.empty(out.shape, dtype=out.dtype, device="meta", requires_grad=True)
    if index < stages - 1 and received is None:
        dist.send(_descriptor(out), dst=after, group=group)
    return inputs, output


def _stage_inputs(
    model: nn.Module, microbatch: Sequence[torch.Tensor], config: AOTDistConfig, stages: int
) -> dict[int, tuple[tuple[int, ...], torch.dtype]]:
    """Each stage's micro-batch input ``(shape, dtype)`` after the first, from the stages'
    copies run in turn on this rank alone (``aotdist plan`` of an interleaved schedule,
    whose first rank holds stages that come after the last rank's)."""
    units, stage_of = _split(model, config, stages)
    compute = torch_dtype(config.fsdp.param_dtype) if config.fsdp.enabled else None
    known: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
    for index in range(stages - 1):
        part = _keep(model, units, tuple(u for u in units if stage_of[u] == index))
        _, out = _shapes(part, microbatch, index, stages, None, known, compute)
        known[index + 1] = (tuple(out.shape), out.dtype)
    return known


def _descriptor(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in _DTYPES or t.dim() > _DESCRIPTOR - 2:
        raise ConfigError(
            f"a pipeline stage's output is {t.dtype} with {t.dim()} dimensions; aotdist passes "
            f"one of {[str(d) for d in _DTYPES]} with at most {_DESCRIPTOR - 2} dimensions"
        )
    values = [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(values + [0] * (_DESCRIPTOR - len(values)), dtype=torch.int64)


def _from_descriptor(d: torch.Tensor, *, requires_grad: bool) -> torch.Tensor:
    dtype, ndim = _DTYPES[int(d[0])], int(d[1])
    shape = [int(v) for v in d[2 : 2 + ndim]]
    grads = requires_grad and dtype.is_floating_point
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grads)
