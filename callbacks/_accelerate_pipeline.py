"""Accelerate: :func:`prepare_pipeline`, ``aotdist.pipeline`` under an ``Accelerator``.

Accelerate has no pipeline dimension of its own (its ``ParallelismConfig`` has dp, tp,
cp), so aotdist builds the ``(pp, dp)`` mesh from the processes ``accelerate launch``
started, shards each stage over ``dp`` with FSDP2, and hands Accelerate the stage (marked
prepared: no DDP around it), the optimizers and schedulers. Dataloaders are split over the
data-parallel replicas only: the ranks of one replica (its stages) read the same batches,
the first stage its inputs, the last its targets.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from aotdist.callbacks._accelerate_checks import (
    accelerate_mixed_precision,
    check_accelerate_dynamo,
    check_optimizer,
)
from aotdist.callbacks._common import enable_fsdp_for_host, merge_config
from torch import nn

import aotdist
from aotdist import _compat
from aotdist.config import AOTDistConfig
from aotdist.errors import ConfigError, OrderingError
from aotdist.float8 import precompute_float8_scales, uses_fsdp_float8_all_gather
from aotdist.log import get_logger

_log = get_logger(__name__)


def prepare_pipeline(
    accelerator: Any,
    model: nn.Module,
    *objects: Any,
    microbatch: Sequence[torch.Tensor],
    loss_fn: Callable,
    config: AOTDistConfig | Mapping | str | os.PathLike | None = None,
    mesh: Any = None,
) -> tuple:
    """``aotdist.pipeline`` then ``accelerator.prepare``: this process's pipeline stage,
    sharded over the data-parallel replicas and compiled, with Accelerate's optimizers,
    schedulers and dataloaders.

    Args:
        accelerator: The ``accelerate.Accelerator`` (``MULTI_GPU`` / ``MULTI_CPU``).
        model: The whole model, built the same in every process; its ``forward`` skips
            the modules set to ``None`` on other stages (torchtitan's models do).
        *objects: Optimizers (built on ``model.parameters()``: each keeps its stage's
            parameters), schedulers and dataloaders, as for ``accelerator.prepare``.
        microbatch: One micro-batch of the first stage's inputs (shapes and dtypes).
        loss_fn: ``loss_fn(output, target)`` of the last stage.
        config: An aotdist config (object, mapping or YAML path) with ``pipeline.enabled``.
        mesh: A mesh with a ``pp`` dimension. Default: ``(pp, dp)`` over the processes,
            ``pp`` = ``pipeline.degree`` (0: every process is one stage), FSDP2 turned on
            over ``dp`` when it has more than one rank.

    Returns:
        ``(pipeline, *prepared_objects)`` in the order given; ``pipeline.step(x,
        target=y, losses=losses)`` runs one step on every process.

    Raises:
        ConfigError: No ``pipeline.enabled``; processes that do not divide into
            ``pipeline.degree``; Accelerate's own dynamo, FSDP, DeepSpeed or
            ``ParallelismConfig``; a mixed precision without FSDP2; a bad split.
        OrderingError: ``model`` was prepared already, or an optimizer stepped.

    Example::

        pipe, optimizer, data = prepare_pipeline(
            accelerator, model, optimizer, data, microbatch=(x[:2],), loss_fn=mse,
            config={"pipeline": {"enabled": True, "degree": 2, "microbatches": 4}})
        for x, y in data:
            optimizer.zero_grad()
            pipe.step(x, target=y, losses=(losses := []))
            optimizer.step()
    """
    from accelerate.utils import DistributedType

    cfg = merge_config(config)
    if not cfg.pipeline.enabled:
        raise ConfigError(
            "aotdist.callbacks.prepare_pipeline needs pipeline.enabled: true in the aotdist "
            "config. Fix: set it (pipeline: {enabled: true, degree: STAGES}), or call "
            "aotdist.callbacks.prepare for a model that is not pipelined"
        )
    check_accelerate_dynamo(cfg, accelerator.state)
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ConfigError(
            f"the Accelerate config shards the model itself (distributed_type="
            f"{accelerator.distributed_type.value}), which cannot wrap a pipeline stage. "
            "Fix: distributed_type MULTI_GPU/MULTI_CPU; aotdist shards each stage over the "
            "data-parallel ranks with FSDP2"
        )
    if _compat.is_accelerate_prepared(model):
        raise OrderingError(
            "this model was already passed to accelerator.prepare; aotdist must split it "
            "into stages first. Fix: pass the plain model to prepare_pipeline"
        )
    if mesh is None:
        cfg, mesh = _pipeline_mesh(accelerator, cfg)
    cfg = accelerate_mixed_precision(cfg, accelerator)
    if str(accelerator.mixed_precision or "no") != "no" and not cfg.fsdp.enabled:
        raise ConfigError(
            f"Accelerate's mixed_precision is {accelerator.mixed_precision}, but a pipeline "
            "stage runs outside Accelerate's autocast (the schedule calls it). Fix: "
            "fsdp.enabled: true (FSDP2 computes in that dtype), or mixed_precision: 'no'"
        )
    old_names = {id(p): n for n, p in model.named_parameters()}
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    for opt in optimizers:
        check_optimizer(opt, old_names)
    model.to(accelerator.device)
    pipe = aotdist.pipeline(model, microbatch=microbatch, loss_fn=loss_fn, config=cfg, mesh=mesh)
    # each stage keeps the whole model's names (pipe.module prefixes them with several)
    mine = {n: p for part in pipe.modules for n, p in part.named_parameters()}
    for opt in optimizers:  # each keeps the parameters of this process's stage
        for group in opt.param_groups:
            group["params"] = [
                mine[old_names[id(p)]] for p in group["params"] if old_names[id(p)] in mine
            ]
        if uses_fsdp_float8_all_gather(pipe.module):
            opt.register_step_post_hook(lambda *_: precompute_float8_scales(pipe.module))
    _compat.mark_accelerate_prepared(pipe.module)  # registered, not wrapped in DDP
    accelerator.register_save_state_pre_hook(_refuse_save_state)
    dp_mesh = mesh["dp"] if "dp" in (mesh.mesh_dim_names or ()) else None
    loaders = {
        i: _replica_loader(accelerator, o, dp_mesh)
        for i, o in enumerate(objects)
        if isinstance(o, torch.utils.data.DataLoader)
    }
    rest = [loaders.get(i, o) for i, o in enumerate(objects)]
    prepared = accelerator.prepare(pipe.module, *rest)
    prepared = prepared if isinstance(prepared, tuple) else (prepared,)
    return (pipe, *prepared[1:])


def _pipeline_mesh(accelerator: Any, cfg: AOTDistConfig) -> tuple[AOTDistConfig, Any]:
    """The ``(pp, dp)`` mesh over Accelerate's processes, FSDP2 on over ``dp`` > 1."""
    if getattr(getattr(accelerator, "torch_device_mesh", None), "mesh_dim_names", None):
        raise ConfigError(
            "Accelerate's ParallelismConfig has no pipeline dimension, and aotdist would "
            "not know which of its ranks hold which stage. Fix: drop the ParallelismConfig "
            "(aotdist builds the (pp, dp) mesh from pipeline.degree), or pass "
            "mesh=init_device_mesh(device, (pp, dp, tp), mesh_dim_names=('pp', 'dp', 'tp'))"
        )
    world = accelerator.num_processes
    pp = cfg.pipeline.degree or world
    if world % pp:
        raise ConfigError(
            f"{world} processes do not divide into pipeline.degree = {pp} stages. Fix: "
            f"launch a multiple of {pp} processes (accelerate launch --num_processes), or "
            f"set pipeline.degree to a divisor of {world}"
        )
    from torch.distributed.device_mesh import init_device_mesh

    dp = world // pp
    if dp > 1:
        cfg = enable_fsdp_for_host(
            cfg, host=f"{dp} copies of each pipeline stage", over="ranks", log=_log.info
        )
    mesh = init_device_mesh(accelerator.device.type, (pp, dp), mesh_dim_names=("pp", "dp"))
    return cfg, mesh


def _replica_loader(accelerator: Any, loader: Any, dp_mesh: Any) -> Any:
    """``loader`` split over the data-parallel replicas only (Accelerate's own split is
    over every process), marked prepared so that ``accelerator.prepare`` registers it."""
    from accelerate.data_loader import prepare_data_loader

    replicas = dp_mesh.size() if dp_mesh is not None else 1
    prepared = prepare_data_loader(
        loader,
        accelerator.device,
        num_processes=replicas,
        process_index=dp_mesh.get_local_rank() if dp_mesh is not None else 0,
        split_batches=accelerator.split_batches,
        put_on_device=accelerator.device_placement,
        rng_types=accelerator.rng_types.copy(),
        even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        non_blocking=accelerator.non_blocking,
    )
    _compat.mark_accelerate_prepared(prepared)
    return prepared


def _refuse_save_state(models: list, weights: list, output_dir: str) -> None:
    raise ConfigError(
        "accelerator.save_state writes the main process's model only, which under "
        "prepare_pipeline is stage 0: the other stages would be lost. Fix: save every "
        "stage with torch.distributed.checkpoint.save({'model': pipe.module.state_dict(), "
        "'optim': optimizer.state_dict()}, checkpoint_id=output_dir) on every process"
    )
