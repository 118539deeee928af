"""Test helpers: tiny models with repeated regions, a parity checker against eager, a
multi-process runner, and the data-parallel training steps and eager references the
multi-rank tests compare."""

from aotdist.launch import (
    DistributedTestError,
    DistributedTimeoutError,
    free_port,
    run_distributed,
)
from aotdist.testing.models import (
    AliasingNet,
    TinyGPT,
    TinyResNet,
    TinyViT,
    build_model,
    example_inputs,
)
from aotdist.testing.parity import assert_parity, assert_training_parity, forward_backward
from aotdist.testing.training import (
    accumulate_grads,
    accumulated_reference,
    lm_loss,
    rank_batches,
    rank_step,
    record_logs,
    train_steps,
)

__all__ = [
    "DistributedTestError",
    "DistributedTimeoutError",
    "free_port",
    "run_distributed",
    "AliasingNet",
    "TinyGPT",
    "TinyResNet",
    "TinyViT",
    "build_model",
    "example_inputs",
    "assert_parity",
    "assert_training_parity",
    "forward_backward",
    "accumulate_grads",
    "accumulated_reference",
    "lm_loss",
    "rank_batches",
    "rank_step",
    "record_logs",
    "train_steps",
]
