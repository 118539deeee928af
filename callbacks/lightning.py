"""Lightning: :class:`RegionalCompile`, regional compile (+ FSDP2, Float8) in one line.

``Trainer(callbacks=[RegionalCompile()])``. The callback applies aotdist right after the
LightningModule's ``configure_model`` (its own or Lightning's default), before Lightning
moves the model, wraps it (DDP) or builds the optimizers, so every strategy sees the
final modules and parameters. Under ``ModelParallelStrategy`` it shards with FSDP2 over
the strategy's data-parallel mesh; a ``configure_model`` that already called
``aotdist.parallelize`` is left as it is.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from aotdist.callbacks._common import (
    Applied,
    ApplyHow,
    apply_aotdist,
    enable_fsdp_for_host,
    expert_checkpoint_error,
    merge_config,
    metric_values,
    with_run_length,
)
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from aotdist import cache, metrics
from aotdist._compat.lightning import lightning_compiler_context
from aotdist.config import AOTDistConfig, as_config
from aotdist.errors import ConfigError
from aotdist.float8 import precompute_float8_scales, uses_fsdp_float8_all_gather

_WRAPPED = "_aotdist_configure_model_wrapped"


def _register_config_type() -> None:
    """Lets LightningCLI's jsonargparse validate ``RegionalCompile``'s ``config`` while it
    parses (a mapping of sections or a YAML path, through :func:`aotdist.config.as_config`),
    so a typo is a parser error led by aotdist's message, not a traceback at instantiation."""
    try:
        from jsonargparse.typing import get_registered_type, register_type
    except ImportError:  # no LightningCLI: nothing parses the callback's arguments
        return
    if get_registered_type(AOTDistConfig) is None:
        register_type(
            AOTDistConfig,
            serializer=lambda cfg: cfg.to_dict(),
            deserializer=as_config,
            deserializer_exceptions=(ConfigError,),
        )


_register_config_type()  # when the callback's module loads, before LightningCLI reads it


class RegionalCompile(Callback):
    """Compiles each distinct repeated region of the LightningModule once.

    Works with ``strategy="auto"``, ``"ddp"``, ``"ddp_spawn"`` and
    ``ModelParallelStrategy`` (FSDP2 over its ``data_parallel`` dim, composed with the
    tensor parallelism your ``configure_model`` applies on ``tensor_parallel``; slice
    that mesh once for all layers), on CPU and GPU. Logs compile metrics to every
    logger in ``trainer.loggers`` (rank zero), warns on recompiles after the first epoch, and runs the
    Float8 scale precompute after each optimizer step when FSDP float8 all-gather is used.

    Args:
        config: An ``AOTDistConfig``, a mapping of its sections, or a YAML path (annotated
            ``AOTDistConfig``: LightningCLI parses a mapping or a path into one, and a typo
            is its parser error, led by aotdist's message). Its ``fsdp`` section applies under ``ModelParallelStrategy`` (where FSDP2 is turned
            on by default); ``float8`` and ``ac`` apply under every strategy.
        include: Region classes or FQN globs, relative to the LightningModule
            (``"model.blocks.*"``); overrides ``config.regions.include``.
        exclude: Modules never made regions; overrides ``config.regions.exclude``.
        backend: ``torch.compile`` backend; overrides ``config.compile.backend``
            (default ``"inductor"``).
        mode: ``torch.compile`` mode; overrides ``config.compile.mode``.
        log_metrics: Log compile metrics to every logger in ``trainer.loggers``.

    Raises:
        ConfigError: A bad config or argument, or ``pipeline.enabled`` (Lightning's loop
            cannot drive a pipeline schedule: ``prepare_pipeline`` under Accelerate or
            ``aotdist.pipeline`` in a script can), at construction.

    Example::

        import lightning.pytorch as pl
        import torch
        from torch.utils.data import DataLoader

        from aotdist.callbacks import RegionalCompile
        from aotdist.testing import TinyGPT

        class LitGPT(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.model = TinyGPT(depth=2)

            def training_step(self, idx, batch_idx):
                return self.model(idx).logsumexp(-1).mean()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        callback = RegionalCompile(backend="aot_eager")
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=1, callbacks=[callback], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(LitGPT(), DataLoader(torch.randint(0, 64, (4, 16)), batch_size=2))
        assert callback.applied.target_fqn == "model" and trainer.global_step == 1
    """

    def __init__(
        self,
        config: AOTDistConfig | None = None,
        *,
        include: list[str] | str | None = None,
        exclude: list[str] | str | None = None,
        backend: str | None = None,
        mode: str | None = None,
        log_metrics: bool = True,
    ) -> None:
        if not isinstance(log_metrics, bool):
            raise ConfigError(
                f"RegionalCompile(log_metrics=...) must be a bool; got {log_metrics!r}"
            )
        super().__init__()
        self.config: AOTDistConfig = merge_config(
            config, include=include, exclude=exclude, backend=backend, mode=mode
        )
        if self.config.pipeline.enabled:
            raise _pipeline_error()
        self.log_metrics = log_metrics
        self.applied: Applied | None = None
        self._window: metrics.Tracker | None = None  # the metrics window in progress
        self._first_batch_done = False
        self._last_step = -1
        self._cache_saved = False
        self._float8_all_gather = False
        self.recompiles_after_first_epoch = 0

    # ---- setup: validate, then apply right after configure_model ----------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _validate(trainer, pl_module, self.config)
        if getattr(pl_module, _WRAPPED, False):
            return
        original = pl_module.configure_model  # the user's, or LightningModule's no-op

        def configure_model() -> None:  # no functools.wraps: Lightning must see an override
            original()
            self._apply(trainer, pl_module)

        pl_module.configure_model = configure_model
        setattr(pl_module, _WRAPPED, True)

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.applied is not None and self.applied.target in pl_module.modules():
            return  # configure_model runs again for test/predict after fit
        config, mesh = with_run_length(self.config, trainer.max_steps, host="Trainer"), None
        if _is_model_parallel(trainer.strategy):
            mesh = _data_parallel_mesh(trainer.strategy, config)
            config = enable_fsdp_for_host(
                config, host="ModelParallelStrategy", over="mesh", log=rank_zero_info
            )
        self.applied = apply_aotdist(pl_module, config, mesh=mesh, what="RegionalCompile")
        self._float8_all_gather = uses_fsdp_float8_all_gather(pl_module)
        rank_zero_info(self.applied.describe(type(pl_module).__name__))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close_window()
        if "configure_model" in vars(pl_module):
            del pl_module.configure_model
        if getattr(pl_module, _WRAPPED, False):
            delattr(pl_module, _WRAPPED)

    # ---- training: metrics windows and the Float8 precompute ---------------------------

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._first_batch_done and self._window is None:
            self._open_window()

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if trainer.global_step != self._last_step:  # an optimizer step happened
            if not self._cache_saved:  # the first: forward and backward are compiled now
                self._cache_saved = True
                cache.save(pl_module)  # no-op unless cache.mode is local or shared
            self._last_step = trainer.global_step
            if self._float8_all_gather:
                precompute_float8_scales(pl_module)
        if not self._first_batch_done:
            self._first_batch_done = True
            first = self._close_window()
            self._log(trainer, first, first_step=True)
            if (
                first is not None
                and self.config.compile.enabled
                and first.frames_compiled == 0
                and not first.precompiled
                and self.applied is not None
                and self.applied.how == ApplyHow.PARALLELIZE
            ):  # (a saved graph ran: no trace)
                rank_zero_warn(
                    f"aotdist: nothing was compiled in the first training step: "
                    f"{self.applied.target_fqn or 'the LightningModule'} did not run through "
                    "its __call__. Fix: call it as a module in training_step "
                    "(self.model(x), not self.model.forward(x))."
                )
            self._open_window()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._cache_saved:  # the first validation after the save: its graph joins the bundle
            cache.save(pl_module)  # no-op unless that validation compiled

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._first_batch_done:
            return
        window = self._close_window()
        if window is not None and trainer.current_epoch >= 1 and window.recompiles:
            self.recompiles_after_first_epoch += len(window.recompiles)
            rank_zero_warn(
                f"aotdist: {len(window.recompiles)} recompile(s) in epoch "
                f"{trainer.current_epoch}: {window.recompiles[0].splitlines()[0][:200]}. "
                "Recompiles after the first epoch cost compile time every time; mark the "
                "changing input dims dynamic or keep shapes fixed (drop_last=True)."
            )
        if window is not None and self.log_metrics and trainer.is_global_zero:
            for logger in trainer.loggers:  # every logger, as Lightning's own monitors do
                logger.log_metrics(
                    {"aotdist/recompiles_epoch": len(window.recompiles)}, step=trainer.global_step
                )
        self._open_window()

    def _open_window(self) -> None:
        target = self.applied.target if self.applied is not None else None
        self._window = metrics.Tracker(target)
        self._window.start()

    def _close_window(self) -> metrics.CompileMetrics | None:
        if self._window is None:
            return None
        out, self._window = self._window.stop(), None
        return out

    def _log(
        self, trainer: pl.Trainer, m: metrics.CompileMetrics | None, *, first_step: bool
    ) -> None:
        if m is None or not self.log_metrics or not trainer.loggers or not trainer.is_global_zero:
            return
        values = metric_values(m)
        for logger in trainer.loggers:  # every logger, as Lightning's own monitors do
            logger.log_metrics(values, step=trainer.global_step)

    # ---- resumable state --------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "recompiles_after_first_epoch": self.recompiles_after_first_epoch,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("config")
        if saved is not None and AOTDistConfig.from_dict(saved) != self.config:
            rank_zero_warn(
                "aotdist: resuming with another RegionalCompile config than the checkpoint's; "
                "the weights load the same (aotdist never changes state_dict keys), but the "
                f"run now uses {self.config.to_dict()} instead of {saved}."
            )
        self.recompiles_after_first_epoch = int(state_dict.get("recompiles_after_first_epoch", 0))


def _pipeline_error() -> ConfigError:
    return ConfigError(
        "RegionalCompile: the aotdist config has pipeline.enabled, which Lightning's loop "
        "cannot drive: a pipeline schedule runs every micro-batch's forward and backward "
        "inside its own step (only the last stage has a loss), where Lightning's automatic "
        "optimization calls backward on training_step's loss; and Lightning splits the "
        "batches over every data-parallel process (DDP over all of them, "
        "ModelParallelStrategy over its data_parallel dim, which has no pipeline dim), "
        "where the stages of one replica must read the same batch. Fix: train the "
        "pipelined model with Accelerate (aotdist.callbacks.prepare_pipeline under "
        "accelerate launch) or a script (pipe = aotdist.pipeline(model, microbatch=..., "
        "loss_fn=..., config=..., mesh=...); each step pipe.step(x, target=y, "
        "losses=losses) then optimizer.step(), under torchrun), or set pipeline.enabled: "
        "false for RegionalCompile."
    )


def _is_model_parallel(strategy: Any) -> bool:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return isinstance(strategy, ModelParallelStrategy)


def _data_parallel_mesh(strategy: Any, config: AOTDistConfig):
    """FSDP's mesh under ``ModelParallelStrategy``: its ``data_parallel`` dim (the user's
    ``configure_model`` applied tensor parallelism on ``tensor_parallel``), or ``None``
    for HSDP, which aotdist builds over the same ranks (``fsdp.replicate_degree``)."""
    mesh = strategy.device_mesh
    tp = mesh["tensor_parallel"].size()
    if config.fsdp.replicate_degree == 1:
        return mesh["data_parallel"]
    if tp > 1:
        raise ConfigError(
            f"RegionalCompile: fsdp.replicate_degree: {config.fsdp.replicate_degree} (HSDP) "
            f"with tensor_parallel_size={tp}: ModelParallelStrategy's mesh has one "
            "data-parallel dim, which aotdist cannot split into (replicate, shard). Fix: "
            "drop fsdp.replicate_degree (FSDP over the data-parallel dim, tensor parallelism "
            "within), or tensor_parallel_size=1 for HSDP."
        )
    return None


def _validate(trainer: pl.Trainer, pl_module: pl.LightningModule, config: AOTDistConfig) -> None:
    from lightning.pytorch.strategies import (
        DDPStrategy,
        FSDPStrategy,
        ModelParallelStrategy,
        SingleDeviceStrategy,
    )

    strategy = trainer.strategy
    name = type(strategy).__name__
    if config.fsdp.expert_params and trainer.checkpoint_callback is not None:
        raise expert_checkpoint_error("Trainer(enable_checkpointing=True)")
    if isinstance(strategy, FSDPStrategy):
        raise ConfigError(
            "RegionalCompile: FSDPStrategy is FSDP1, whose flat parameters aotdist cannot "
            "compile per region. Fix: strategy=ModelParallelStrategy(data_parallel_size=N, "
            "tensor_parallel_size=1); RegionalCompile shards with FSDP2 there."
        )
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)):
        raise ConfigError(
            f"RegionalCompile: strategy {name} is not supported. Fix: use 'auto', 'ddp', "
            "'ddp_spawn' or ModelParallelStrategy."
        )
    if config.fsdp.enabled and not isinstance(strategy, ModelParallelStrategy):
        raise ConfigError(
            f"RegionalCompile: fsdp.enabled needs ModelParallelStrategy, got {name} (DDP "
            "would wrap the FSDP2-sharded model a second time). Fix: strategy="
            "ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1), or set "
            "fsdp.enabled: false."
        )
    precision = str(trainer.precision)
    if config.float8.enabled and (
        precision.startswith(("64", "16-true", "transformer-engine")) or "bnb" in precision
    ):
        raise ConfigError(
            f"RegionalCompile: float8.enabled with precision={precision!r}: torchao Float8 "
            "needs float32 or bfloat16 master weights and no other low-precision plugin. "
            "Fix: precision='32-true' or 'bf16-mixed', or float8.enabled: false."
        )
    compiled = lightning_compiler_context(pl_module)
    if compiled:
        raise ConfigError(
            "RegionalCompile: the LightningModule passed to the Trainer came from "
            "torch.compile; Lightning would compile the whole model again on top. Fix: "
            "pass the uncompiled LightningModule; RegionalCompile compiles it."
        )
