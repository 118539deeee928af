"""Accelerate: :class:`RegionalCompileHook` (a ``ModelHook``) and :func:`prepare`.

- ``add_hook_to_module(model, RegionalCompileHook())`` compiles the model's regions in
  place; ``remove_hook_from_module(model)`` makes it eager again. With DDP attach it
  before or after ``accelerator.prepare``; with Accelerate's own FSDP2, after.
- ``prepare(accelerator, model, optimizer, dataloader, ..., config=...)`` applies
  ``aotdist.parallelize`` (FSDP2, Float8, activation checkpointing, regional compile),
  rebinds the optimizers, runs the Float8 scale precompute after each optimizer step,
  and prepares the rest with Accelerate (no DDP around an FSDP2-sharded model).

aotdist settings live in their own YAML (``configs/aotdist/*.yaml``), not in Accelerate's
config file: ``accelerate launch`` rejects unknown keys there. Details: docs/internals.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from accelerate.hooks import ModelHook
from aotdist.callbacks._accelerate_checks import (
    accelerate_mixed_precision,
    check_accelerate_dynamo,
    check_optimizer,
)
from aotdist.callbacks._accelerate_state import full_state_checkpoints
from aotdist.callbacks._common import (
    Applied,
    ApplyHow,
    apply_aotdist,
    compile_only_config,
    enable_fsdp_for_host,
    expert_checkpoint_error,
    merge_config,
)
from torch import nn

from aotdist import _compat, cache, compile_from_config, metrics, restore
from aotdist.config import AOTDistConfig
from aotdist.errors import ConfigError, OrderingError
from aotdist.float8 import precompute_float8_scales, uses_fsdp_float8_all_gather
from aotdist.fsdp import fsdp_modules, is_fsdp_module, require_process_group
from aotdist.log import get_logger

_log = get_logger(__name__)


class RegionalCompileHook(ModelHook):
    """Compiles each distinct repeated region of the hooked model once, in place.

    Args:
        config: An ``AOTDistConfig``, a mapping of its sections, or a YAML path. Only the
            ``regions``, ``compile`` and ``ac`` sections apply: FSDP and Float8 replace
            parameters, so they belong to :func:`prepare`.
        include: Region classes or FQN globs; overrides ``config.regions.include``.
        exclude: Modules never made regions; overrides ``config.regions.exclude``.
        backend: ``torch.compile`` backend; overrides ``config.compile.backend``
            (default ``"inductor"``).

    Attributes:
        metrics: ``CompileMetrics`` of the first forward (``None`` before it).
        applied: What was applied, after ``init_hook``.

    Raises:
        ConfigError: A bad config, or FSDP/Float8 enabled in it.

    Example::

        import torch
        from accelerate import Accelerator
        from accelerate.hooks import add_hook_to_module, remove_hook_from_module

        from aotdist.callbacks import RegionalCompileHook
        from aotdist.testing import TinyGPT

        accelerator = Accelerator(cpu=True)
        model = TinyGPT(depth=2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        hook = RegionalCompileHook(backend="aot_eager")
        add_hook_to_module(model, hook)
        accelerator.backward(model(torch.randint(0, 64, (2, 16))).logsumexp(-1).mean())
        optimizer.step()
        assert hook.metrics.regions["GPTBlock"].subgraphs == 1
        remove_hook_from_module(model)  # eager again
    """

    def __init__(
        self,
        config: AOTDistConfig | Mapping | str | None = None,
        *,
        include: list[str] | str | None = None,
        exclude: list[str] | str | None = None,
        backend: str | None = None,
    ) -> None:
        self.config = compile_only_config(
            config,
            include=include,
            exclude=exclude,
            backend=backend,
            what="RegionalCompileHook",
            why="which a hook cannot do under an existing optimizer",
            fix="use aotdist.callbacks.prepare(accelerator, model, optimizer, ..., config=...) "
            "for FSDP2 and Float8",
        )
        self.applied: Applied | None = None
        self.metrics: metrics.CompileMetrics | None = None
        self._window: metrics.Tracker | None = None
        self._frames = False
        self._plain_forward: Any = None

    def init_hook(self, module: nn.Module) -> nn.Module:
        check_accelerate_dynamo(self.config)
        root = _unwrap_ddp(module)
        if (
            root is not module
            or fsdp_modules(root)
            or _compat.accelerate_old_forward(module) is None
        ):
            # Inside DDP or FSDP units: compile the module in place; the wrapper's own
            # forward and FSDP's hooks stay eager around it.
            self.applied = apply_aotdist(
                root, self.config, what="RegionalCompileHook", child_target=False
            )
            target = self.applied.target
            call = _compat.compiled_call(target)
            if call is not None and self.applied.how != ApplyHow.USER:  # restore undoes it
                _compat.wrap_compiled_call(target, _FirstCallMetrics(self, target))
            self._frames = self.applied.how != ApplyHow.USER and call is None
            return module
        # A plain module: compile the forward this hook wraps (Accelerate's pre/post hooks,
        # some of them torch.compiler.disable-d, stay outside the graph).
        cc = self.config.compile
        self.applied = apply_aotdist(
            root,
            self.config.replace(compile={"enabled": False}),
            what="RegionalCompileHook",
            child_target=False,
        )
        if cc.enabled and self.applied.how != ApplyHow.USER:
            self._plain_forward = _compat.accelerate_old_forward(module)
            compiled = compile_from_config(module, self.config, fn=self._plain_forward)
            _compat.set_accelerate_old_forward(module, _FirstCallMetrics(self, module, compiled))
        return module

    def pre_forward(self, module: nn.Module, *args, **kwargs):
        if self._plain_forward is not None and is_fsdp_module(module):
            raise OrderingError(
                "RegionalCompileHook was attached to the model before it was "
                "sharded with FSDP2 (accelerator.prepare with Accelerate's FSDP2 plugin, or "
                "fully_shard): the hook compiled the whole forward, which FSDP2's hooks cannot "
                "run inside. Fix: attach it after accelerator.prepare (it then compiles the "
                "regions inside the FSDP2 units): remove_hook_from_module(model), then "
                "add_hook_to_module(prepared_model, RegionalCompileHook(...))."
            )
        if self._frames and self.metrics is None and self._window is None:
            self._window = metrics.Tracker(self.applied.target)  # frames mode: record eagerly
            self.metrics = self._window.start()
        return args, kwargs

    def post_forward(self, module: nn.Module, output):
        if self._window is not None:
            self._window.stop()
            self._window = None
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        if self._plain_forward is not None:  # before Accelerate restores forward from it
            _compat.set_accelerate_old_forward(module, self._plain_forward)
            self._plain_forward = None
        if self.applied is not None and self.applied.how != ApplyHow.USER:
            # undoes the compiled call and its wrappers (this hook's first-call metrics too);
            # the hook never converts or shards: a re-attach starts over
            restore(self.applied.target)
        self.applied = None
        return module


class _FirstCallMetrics(_compat.CallWrapper):
    """The compiled call, with the first call's compile metrics recorded (outside Dynamo):
    ``inner`` (the model's compiled call slot, or the compiled forward Accelerate calls)."""

    def __init__(self, hook: RegionalCompileHook, target: nn.Module, inner: Any = None):
        self.inner, self._hook, self._target = inner, hook, target

    def __call__(self, *args, **kwargs):
        if self._hook.metrics is not None:
            return self.inner(*args, **kwargs)
        with metrics.track(self._target) as m:
            out = self.inner(*args, **kwargs)
        self._hook.metrics = m
        return out


def _unwrap_ddp(module: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


def prepare(
    accelerator: Any,
    model: nn.Module,
    *objects: Any,
    config: AOTDistConfig | Mapping | str | os.PathLike | None = None,
    mesh: Any = None,
) -> tuple:
    """``aotdist.parallelize`` then ``accelerator.prepare``, in the order that works.

    Args:
        accelerator: The ``accelerate.Accelerator``.
        model: The plain model (not yet prepared or compiled).
        *objects: Optimizers, dataloaders and schedulers, as for ``accelerator.prepare``.
            Optimizers may be built before this call: they are rebound to the parameters
            that Float8 conversion and FSDP2 create.
        config: An ``AOTDistConfig``, a mapping or a YAML path (``configs/aotdist/*.yaml``).
        mesh: FSDP's mesh. Default: the data-parallel dims of Accelerate's
            ``ParallelismConfig`` (``dp_shard_size``, with ``dp_replicate_size`` as HSDP;
            FSDP is turned on when it shards), composed with the tensor parallelism you
            applied on ``accelerator.torch_device_mesh["tp"]`` before this call; without
            one, every process (as ``fsdp.replicate_degree`` asks).

    Returns:
        ``(model, *prepared_objects)``, in the order given.

    Raises:
        ConfigError: A bad config; Accelerate's own dynamo, FSDP or DeepSpeed also enabled;
            a ``ParallelismConfig`` aotdist cannot shard over (context parallelism, or
            FSDP with no ``dp_shard`` dim).
        OrderingError: ``model`` was prepared or compiled already.

    Example::

        import torch
        from accelerate import Accelerator
        from torch.utils.data import DataLoader

        from aotdist.callbacks import prepare
        from aotdist.testing import TinyGPT

        accelerator = Accelerator(cpu=True)
        model = TinyGPT(depth=2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = DataLoader(torch.randint(0, 64, (4, 16)), batch_size=2)
        model, optimizer, data = prepare(accelerator, model, optimizer, data,
                                         config={"compile": {"backend": "aot_eager"}})
        losses = []
        for idx in data:
            loss = model(idx).logsumexp(-1).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert len(losses) == 2
    """
    from accelerate.utils import DistributedType

    cfg = merge_config(config)
    if cfg.pipeline.enabled:
        raise ConfigError(
            "the aotdist config has pipeline.enabled, which prepare does not split into "
            "stages. Fix: call aotdist.callbacks.prepare_pipeline(accelerator, model, ..., "
            "microbatch=..., loss_fn=...) instead"
        )
    check_accelerate_dynamo(cfg, accelerator.state)
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ConfigError(
            f"the Accelerate config shards the model itself (distributed_type="
            f"{accelerator.distributed_type.value}); aotdist.callbacks.prepare shards with "
            "aotdist. Fix: use distributed_type MULTI_GPU/MULTI_CPU with fsdp.enabled in the "
            "aotdist config, or keep Accelerate's FSDP2 and attach RegionalCompileHook after "
            "accelerator.prepare."
        )
    cfg = accelerate_mixed_precision(cfg, accelerator)
    if mesh is None:  # (FSDP turned on by a ParallelismConfig computes in its dtype too)
        cfg, mesh = _accelerate_mesh(accelerator, cfg)
        cfg = accelerate_mixed_precision(cfg, accelerator)
    if _compat.is_accelerate_prepared(model):
        raise OrderingError(
            "this model was already passed to accelerator.prepare; aotdist must convert, "
            "shard and compile it first. Fix: call aotdist.callbacks.prepare with the plain "
            "model instead of accelerator.prepare."
        )
    model.to(accelerator.device)
    old_names = {id(p): n for n, p in model.named_parameters()}
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    for opt in optimizers:
        check_optimizer(opt, old_names)
    apply_aotdist(model, cfg, mesh=mesh, what="aotdist.callbacks.prepare", child_target=False)
    new_params = dict(model.named_parameters())
    float8_all_gather = uses_fsdp_float8_all_gather(model)
    if cfg.cache.mode != "off" and optimizers:
        cache.save_after_first_step(optimizers[0], model)
    for opt in optimizers:
        _rebind(opt, old_names, new_params)
        if float8_all_gather:  # after every real step (not the skipped accumulation ones)
            opt.register_step_post_hook(lambda *_: precompute_float8_scales(model))
    if cfg.fsdp.enabled:
        # Sharded by aotdist: Accelerate must register it (save/load state) but not wrap it.
        _compat.mark_accelerate_prepared(model)
    if cfg.fsdp.expert_params:

        def refuse(*_):
            raise expert_checkpoint_error("accelerator.save_state")

        accelerator.register_save_state_pre_hook(refuse)
    prepared = accelerator.prepare(model, *objects)
    if cfg.fsdp.enabled:  # after prepare: its optimizer wrapper reloads the state once
        full_state_checkpoints(accelerator, model, optimizers)
    return prepared if isinstance(prepared, tuple) else (prepared,)


def _accelerate_mesh(accelerator: Any, cfg: AOTDistConfig) -> tuple[AOTDistConfig, Any]:
    """FSDP's config and mesh from Accelerate's ``ParallelismConfig`` (its device mesh's
    ``dp_replicate`` / ``dp_shard`` dims), or over every process without one."""
    mesh = getattr(accelerator, "torch_device_mesh", None)  # None: no ParallelismConfig
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if not names:
        if not cfg.fsdp.enabled:
            return cfg, None
        require_process_group()  # else init_device_mesh fails inside torch's env:// rendezvous
        if cfg.fsdp.replicate_degree > 1:
            return cfg, None  # aotdist builds HSDP's (replicate, shard) mesh itself
        from torch.distributed.device_mesh import init_device_mesh

        return cfg, init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    if {"cp", "sp"} & set(names):
        raise ConfigError(
            f"Accelerate's ParallelismConfig has dims {names}; aotdist composes FSDP with "
            "tensor parallelism only, not context or sequence parallelism. Fix: cp_size=1 "
            "and sp_size=1, or use Accelerate's own FSDP2 with RegionalCompileHook."
        )
    if "dp_shard" not in names:
        if cfg.fsdp.enabled:
            raise ConfigError(
                f"fsdp.enabled, but Accelerate's ParallelismConfig (dims {names}) has no "
                "dp_shard dim to shard over. Fix: ParallelismConfig(dp_shard_size=N, ...) "
                "(with dp_replicate_size=R for HSDP), or fsdp.enabled: false."
            )
        return cfg, None
    cfg = enable_fsdp_for_host(
        cfg, host="Accelerate's ParallelismConfig shards (dp_shard)", over="dims", log=_log.info
    )
    dp = tuple(n for n in ("dp_replicate", "dp_shard") if n in names)
    return cfg, mesh[dp] if len(dp) == 2 else mesh["dp_shard"]


def _rebind(
    optimizer: torch.optim.Optimizer, old_names: dict[int, str], new_params: dict[str, nn.Parameter]
) -> None:
    """Points ``optimizer`` at the parameters that replaced the ones it was built with."""
    for group in optimizer.param_groups:
        group["params"] = [new_params[old_names[id(p)]] for p in group["params"]]
