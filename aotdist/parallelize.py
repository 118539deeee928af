"""``aotdist.parallelize``: Float8, activation checkpointing, regions, FSDP2, compile, in order."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from aotdist._compat.deprecation import positional_after_first_deprecated
from aotdist.cache import load as load_cache
from aotdist.compile import check_not_compiled
from aotdist.compile.configured import compile_from_config
from aotdist.compile.guard import trace_host_scalars
from aotdist.compile.marking import mark_regions
from aotdist.compile.state import INFO_ATTR, STATE_ATTR
from aotdist.config import AOTDistConfig, as_config
from aotdist.errors import ConfigError, OrderingError
from aotdist.float8 import convert_to_float8, warn_unverified_combination
from aotdist.fsdp.modes import record_sharding, sharding_for
from aotdist.fsdp.replaced import record_replaced
from aotdist.log import get_logger
from aotdist.regions import RegionPlan, find_regions

_log = get_logger(__name__)


@dataclass(frozen=True)
class ParallelizeInfo:
    """What :func:`parallelize` applied to a model (``parallelize_info(model)``).

    Attributes:
        config: The config it ran with.
        plan: The regions it marked.
        float8_fqns: Linear layers converted to Float8Linear.
        sharded_fqns: Modules ``fully_shard`` was applied to, root last as ``""``.
        mesh: The device mesh FSDP2 used, or ``None``.
    """

    config: AOTDistConfig
    plan: RegionPlan
    float8_fqns: tuple[str, ...]
    sharded_fqns: tuple[str, ...]
    mesh: Any = None


@positional_after_first_deprecated
def parallelize(
    model: nn.Module,
    *,
    config: AOTDistConfig | Mapping | str | os.PathLike | None = None,
    mesh: Any = None,
) -> nn.Module:
    """Applies Float8, activation checkpointing, region marking, FSDP2 and compile in order.

    With ``cache.mode`` ``local`` or ``shared``, compile artifacts of an earlier run are
    loaded last (see :mod:`aotdist.cache`); call ``aotdist.cache.save(model)`` after the
    first training step (the Lightning and Accelerate helpers do).

    Build the optimizer *after* this call: Float8 conversion and ``fully_shard`` replace
    the parameters. With ``float8.fsdp_all_gather``, call
    :func:`aotdist.precompute_float8_scales` after each ``optimizer.step()``.

    Args:
        model: The unwrapped model, on its training device; changed in place.
        config: An :class:`AOTDistConfig`, a mapping for ``AOTDistConfig.from_dict`` or a
            YAML path. ``None``: regional compile only.
        mesh: FSDP's device mesh: 1-D, or 2-D ``(replicate, shard)`` for HSDP (both
            modes); default: all ranks of the default process group, as
            ``fsdp.replicate_degree`` asks. With tensor parallelism, the data-parallel
            dim(s) of your mesh (hooks mode).

    Returns:
        ``model`` itself: same class at the root, same ``state_dict()`` keys.

    Raises:
        OrderingError: ``model`` is a ``torch.compile`` wrapper, was compiled, holds FSDP1
            or DDP wrappers, was sharded already (with ``fsdp.enabled``) or parallelized.
        ConfigError: A bad config, or ``fsdp.enabled`` without a process group.

    Example::

        import torch

        import aotdist
        from aotdist.testing import TinyGPT

        # One process, FSDP off (its default): regional compile only.
        model = aotdist.parallelize(TinyGPT(depth=3), config={"compile": {"backend": "aot_eager"}})
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # after parallelize
        model(torch.randint(0, 64, (2, 16))).logsumexp(-1).mean().backward()
        optimizer.step()
        plan = aotdist.parallelize_info(model).plan
        assert list(plan.fqns) == ["blocks.0", "blocks.1", "blocks.2"]
    """
    config = as_config(config)
    if config.pipeline.enabled:
        raise ConfigError(
            "pipeline.enabled: parallelize applies to one model, and a pipelined model is "
            "one stage per rank. Fix: call aotdist.pipeline(model, microbatch=..., "
            "loss_fn=..., config=...), which splits it and parallelizes each stage"
        )
    refuse_context_parallel(mesh)
    sharding = sharding_for(config)  # NoSharding, HooksSharding or GraphSharding
    _check_fresh(model)
    # Float8 conversion and FSDP2 must both come before the user's own fully_shard.
    sharding.check(model, config)
    mesh = sharding.mesh(model, mesh, config)

    # 1. Float8 first: it replaces nn.Linear modules, and everything after must see the
    #    final modules: region signatures include their classes, and FSDP2 must shard the
    #    Float8Linear weights (with float8 all-gather they become torchao's weight subclass).
    #    Graph-mode FSDP gathers in float8 itself (aotdist.fsdp.graph): plain weights.
    f8 = sharding.float8(config)
    float8_fqns = convert_to_float8(model, f8) if f8.enabled else []
    warn_unverified_combination(config)

    # 2. Regions are found on the converted model (graph-mode FSDP drops, with a
    #    warning, regions it cannot feed their shards).
    rc = config.regions
    plan = sharding.plan(
        model,
        find_regions(model, include=rc.include, exclude=rc.exclude, min_repeats=rc.min_repeats),
        config,
    )

    # 3. Mark regions (with activation checkpointing around each instance) *before*
    #    sharding: marking swaps each instance's class, and fully_shard swaps it again
    #    to an FSDP subclass of the class it finds. Marking afterwards would drop FSDP's.
    mark_regions(model, plan, checkpoint=config.ac.enabled)

    # 4. Shard. Hooks mode: fully_shard each region instance, then the root (one
    #    all-gather per instance, issued as it runs). Graph-mode FSDP: every parameter a
    #    DTensor shard, the collectives then live in the compiled graph (aotdist.fsdp.graph).
    before = list(model.parameters())
    sharded = sharding.shard(model, plan, config, mesh)
    record_replaced(model, before)  # an optimizer built before this holds the old ones
    record_sharding(model, sharding, sharded)  # compile, capture and the cache ask it

    # 5. Compile last, so FSDP2's hooks (installed in 4) stay outside compiled code and
    #    fire per instance: with FSDP2 each region is compiled once as its own graph,
    #    otherwise the whole model is one graph calling each region's subgraph
    #    (graph-mode FSDP's backend buckets its collectives: fsdp.bucket_mb, fsdp.overlap).
    compile_from_config(model, config, plan=plan, mesh=mesh)  # the backend: sharding's
    scalars = sharding.host_scalar_regions(model, plan, config)
    trace_host_scalars(model, scalars, "fsdp.expert_params: expert parallelism")
    sharding.finish(model, config)

    model.__dict__[INFO_ATTR] = ParallelizeInfo(
        config=config,
        plan=plan,
        float8_fqns=tuple(float8_fqns),
        sharded_fqns=tuple(sharded),
        mesh=mesh,
    )
    _log.info(
        "parallelize %s: %d region(s) %s, %d Float8 layer(s), %d FSDP unit(s), compile %s",
        type(model).__name__,
        len(plan),
        [r.name for r in plan],
        len(float8_fqns),
        len(sharded),
        config.compile.backend if config.compile.enabled else "off",
    )

    # 6. Compile artifacts: loaded after everything that changes the graphs (the key holds
    #    the region plan and parameters) and before the first forward, which compiles.
    #    ``aotdist.cache.save(model)`` after the first step (the callbacks call it).
    if config.cache.mode != "off" and config.compile.enabled:
        load_cache(model, config, plan=plan)
    return model


def parallelize_info(model: nn.Module) -> ParallelizeInfo | None:
    """What :func:`parallelize` applied to ``model``, or ``None`` if it was not applied."""
    return vars(model).get(INFO_ATTR)


def _check_fresh(model: nn.Module) -> None:
    if INFO_ATTR in vars(model):
        raise OrderingError(
            "aotdist.parallelize was already applied to this model; applying it twice would "
            "shard and compile twice. Fix: use the model as it is, or rebuild it."
        )
    if STATE_ATTR in vars(model):
        raise OrderingError(
            "aotdist.compile_regions was already applied to this model; parallelize must "
            "convert and shard before compiling. Fix: call aotdist.restore(model) first."
        )
    check_not_compiled(model)


def refuse_context_parallel(mesh: Any) -> None:
    """A mesh with a ``cp`` dimension (torchtitan's and Accelerate's name for context
    parallelism) asks for what aotdist does not run: FSDP2 would shard over it as over data."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "cp" not in names:
        return
    device = getattr(mesh, "device_type", "cpu")
    why = (
        "torch's context_parallel shards attention through CUDA's SDPA kernels only (flash, "
        "memory-efficient, cuDNN); on CPU, SDPA runs "
        "aten._scaled_dot_product_flash_attention_for_cpu, for which neither "
        "context_parallel nor DTensor has a rule, so a CPU job cannot split the sequence"
        if device == "cpu"
        else "aotdist does not compose context parallelism yet (nothing here runs torch's "
        "context_parallel around the step, nor shards FSDP2 over data and cp together)"
    )
    raise ConfigError(
        f"the mesh has dimensions {names}, with 'cp' (context parallelism) on {device}: "
        f"{why}. Fix: pass a mesh without the cp dimension (Accelerate: cp_size=1)"
    )
