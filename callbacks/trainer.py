"""Hugging Face ``Trainer`` (and TRL's trainers): :class:`TrainerRegionalCompile`.

``Trainer(model=..., callbacks=[TrainerRegionalCompile()])`` compiles the model's regions
in place when the Trainer is built, before it wraps the model (DDP) or enables gradient
checkpointing, so ``state_dict`` keys, checkpoints and ``save_pretrained`` stay plain. Each
log line carries aotdist's metrics (``aotdist/compile_seconds``, graphs, recompiles, per
region instances / call sites / subgraphs) for the window since the last one. Refused with
the fix: ``TrainingArguments(torch_compile=True)`` (Trainer's whole-model compile would
trace into aotdist's compiled call) and the Trainer's FSDP (its Accelerate wrapping
replaces parameters after the regions were compiled; use ``aotdist.callbacks.prepare`` or
Lightning for FSDP2 with aotdist).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from aotdist.callbacks._common import (
    Applied,
    apply_aotdist,
    compile_only_config,
    metric_values,
)
from transformers import TrainerCallback

from aotdist import metrics
from aotdist.config import AOTDistConfig
from aotdist.errors import ConfigError

__all__ = ["TrainerRegionalCompile"]


class TrainerRegionalCompile(TrainerCallback):
    """Regional compile for a Hugging Face ``Trainer``, in one line.

    Args:
        config: An ``AOTDistConfig``, a mapping or a YAML path (``compile`` and ``regions``
            sections; ``fsdp`` and ``float8`` are refused: see the module docstring).
        include: Region classes or FQN globs (``regions.include``).
        exclude: Modules never made regions (``regions.exclude``).
        backend: ``compile.backend`` (default ``inductor``).
        log_metrics: Add aotdist's metrics to the Trainer's logs.

    Raises:
        ConfigError: A bad config, ``fsdp`` or ``float8`` enabled, ``torch_compile=True``
            or the Trainer's FSDP in ``TrainingArguments`` (when the Trainer is built).

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
        self.config = compile_only_config(
            config,
            include=include,
            exclude=exclude,
            backend=backend,
            what="TrainerRegionalCompile",
            why="after the Trainer has taken the model",
            fix="remove them here, and use aotdist.parallelize / aotdist.callbacks.prepare "
            "with Accelerate, or Lightning's RegionalCompile, for FSDP2 and Float8",
        )
        if not isinstance(log_metrics, bool):
            raise ConfigError(
                f"TrainerRegionalCompile(log_metrics=...) must be a bool; got {log_metrics!r}"
            )
        self.log_metrics = log_metrics
        self.applied: Applied | None = None
        self._window: metrics.Tracker | None = None

    def on_init_end(self, args, state, control, model=None, **kwargs):
        _check_arguments(args)
        self._apply(model)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        _check_arguments(args)
        self._apply(model)
        self._open_window()

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

    def on_train_end(self, args, state, control, **kwargs):
        if self._window is not None:
            self._window.stop()
            self._window = None

    def _apply(self, model) -> None:
        if model is not None and self.config.compile.enabled and self.applied is None:
            self.applied = apply_aotdist(
                model, self.config, what="TrainerRegionalCompile", child_target=False
            )

    def _open_window(self) -> None:
        target = self.applied.target if self.applied is not None else None
        self._window = metrics.Tracker(target)
        self._window.start()


def _check_arguments(args: Any) -> None:
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
            "TrainingArguments and shard with aotdist.parallelize(model, config={'fsdp': "
            "{'enabled': True}}) in an Accelerate or Lightning script."
        )
