"""Hugging Face ``Trainer`` (and TRL's trainers): :class:`TrainerRegionalCompile`.

``Trainer(model=..., callbacks=[TrainerRegionalCompile()])`` compiles the model's regions
in place when the Trainer is built, before it wraps the model (DDP) or enables gradient
checkpointing, so ``state_dict`` keys, checkpoints and ``save_pretrained`` stay plain. Each
log line carries aotdist's metrics (``aotdist/compile_seconds``, graphs, recompiles, per
region instances / call sites / subgraphs) for the window since the last one. With
``fsdp.enabled`` in its config it shards the model with FSDP2 too (the Trainer does not
wrap it in DDP), and the Trainer's checkpoints hold full tensors (``_trainer_state``).
Refused with the fix: ``TrainingArguments(torch_compile=True)`` (Trainer's whole-model
compile would trace into aotdist's compiled call), the Trainer's own FSDP, and Float8.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from aotdist.callbacks._common import (
    Applied,
    apply_aotdist,
    expert_checkpoint_error,
    merge_config,
    metric_values,
    with_run_length,
)
from aotdist.callbacks._trainer_state import (
    gather_for_save,
    load_full_model_state,
    shard_loaded_optimizer_state,
)
from transformers import TrainerCallback

from aotdist import _compat, metrics
from aotdist.config import AOTDistConfig
from aotdist.errors import ConfigError
from aotdist.log import get_logger

_log = get_logger("callbacks.trainer")


class TrainerRegionalCompile(TrainerCallback):
    """Regional compile for a Hugging Face ``Trainer``, in one line.

    Args:
        config: An ``AOTDistConfig``, a mapping or a YAML path (``compile``, ``regions``
            and ``fsdp``; ``float8`` is refused: see the module docstring). With
            ``fsdp.enabled`` the script runs under ``torchrun`` / ``accelerate launch``.
        include: Region classes or FQN globs (``regions.include``).
        exclude: Modules never made regions (``regions.exclude``).
        backend: ``compile.backend`` (default ``inductor``).
        log_metrics: Add aotdist's metrics to the Trainer's logs.

    Raises:
        ConfigError: A bad config, ``float8`` enabled, ``torch_compile=True`` or the
            Trainer's FSDP in ``TrainingArguments`` (when the Trainer is built).

    Example::

        from aotdist.callbacks import TrainerRegionalCompile
        callback = TrainerRegionalCompile(backend="aot_eager")
        assert callback.config.compile.backend == "aot_eager"
        # Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    """

    def __init__(
        self,
        config: AOTDistConfig | Mapping | str | os.PathLike | None = None,
        *,
        include: list[str] | str | None = None,
        exclude: list[str] | str | None = None,
        backend: str | None = None,
        log_metrics: bool = True,
    ) -> None:
        self.config = merge_config(config, include=include, exclude=exclude, backend=backend)
        if self.config.float8.enabled:
            raise ConfigError(
                "TrainerRegionalCompile does not convert to Float8: the Trainer's mixed "
                "precision and gradient clipping are not checked with Float8 weights. Fix: "
                "remove float8 here, and train Float8 with aotdist.callbacks.prepare in an "
                "Accelerate script or with Lightning's RegionalCompile."
            )
        if not isinstance(log_metrics, bool):
            raise ConfigError(
                f"TrainerRegionalCompile(log_metrics=...) must be a bool; got {log_metrics!r}"
            )
        self.log_metrics = log_metrics
        self.applied: Applied | None = None
        self._window: metrics.Tracker | None = None

    def on_init_end(self, args, state, control, model=None, **kwargs):
        _check_arguments(args, self.config)
        self._apply(model, args)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        _check_arguments(args, self.config)
        self._apply(model, args)
        if self._sharded and optimizer is not None:  # a resumed run loaded full tensors
            sharded = shard_loaded_optimizer_state(optimizer)
            if sharded:
                _log.info("aotdist: the resumed optimizer state, %d tensors, sharded", sharded)
        self._open_window()

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self._sharded and control.should_save:  # every rank: the Trainer saves next
            gather_for_save(self.applied.target, optimizer)

    def on_epoch_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.on_step_end(args, state, control, model=model, optimizer=optimizer)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._window is None or not self.log_metrics:
            return
        window = self._window.stop()
        self._open_window()
        values = metric_values(window)
        if logs is not None:
            logs.update(values)  # the callbacks after this one (reporters) see them
        if state.log_history:  # the record the Trainer keeps, and saves in checkpoints
            state.log_history[-1].update(values)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self._window is not None:
            self._window.stop()
            self._window = None
        if self._sharded:  # for trainer.save_model() after train() (model weights only)
            gather_for_save(self.applied.target, None)

    @property
    def _sharded(self) -> bool:
        return self.applied is not None and self.config.fsdp.enabled

    def _apply(self, model, args) -> None:
        if model is None or self.applied is not None:
            return
        if not (self.config.compile.enabled or self.config.fsdp.enabled):
            return
        config = with_run_length(self.config, args.max_steps, host="TrainingArguments")
        self.applied = apply_aotdist(
            model, config, what="TrainerRegionalCompile", child_target=False
        )
        if self.config.fsdp.enabled:
            # Sharded by aotdist: Accelerate registers the model without a DDP wrapper,
            # and the Trainer's checkpoints load full tensors into the shards.
            _compat.mark_accelerate_prepared(model)
            load_full_model_state(model)

    def _open_window(self) -> None:
        target = self.applied.target if self.applied is not None else None
        self._window = metrics.Tracker(target)
        self._window.start()


def _check_arguments(args: Any, config: AOTDistConfig) -> None:
    saves = getattr(args, "save_strategy", "no")
    saves = str(getattr(saves, "value", saves))  # an IntervalStrategy, or its text
    if config.fsdp.expert_params and saves != "no":
        raise expert_checkpoint_error(f"TrainingArguments(save_strategy={saves!r})")
    if getattr(args, "torch_compile", False):
        raise ConfigError(
            "TrainingArguments(torch_compile=True) would torch.compile the whole model on "
            "top of the regions aotdist compiled: its trace enters aotdist's compiled call "
            "(graph breaks, a recompile). Fix: torch_compile=False; aotdist compiles the "
            "model (choose the backend with TrainerRegionalCompile(backend=...))."
        )
    if getattr(args, "fsdp", None):  # an empty list when off
        raise ConfigError(
            f"TrainingArguments(fsdp={getattr(args, 'fsdp', None)!r}): the Trainer's FSDP "
            "wraps and shards the model after TrainerRegionalCompile compiled it, which "
            "replaces the parameters the compiled regions hold. Fix: drop fsdp from "
            "TrainingArguments and let aotdist shard it: TrainerRegionalCompile(config="
            "{'fsdp': {'enabled': True}})."
        )
