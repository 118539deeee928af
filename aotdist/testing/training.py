"""Training helpers shared by the multi-rank tests: per-rank batches, the language-model
loss, one data-parallel training step, the single-process eager reference, and a log
recorder."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from aotdist.testing.models import build_model, example_inputs


def rank_batches(
    model: nn.Module, *, world_size: int, steps: int, batch_per_rank: int = 2, seed: int = 1
) -> Iterator[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """``steps`` global batches for ``model``, each split into ``world_size`` rank slices.

    Yields:
        ``(xs, ys)``: the inputs and targets of one step, ``xs[rank]`` being rank's slice.
    """
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        (x,), y = example_inputs(model, batch_per_rank * world_size, generator=g)
        yield x.chunk(world_size), y.chunk(world_size)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy of ``model(x)`` (batch, sequence, vocabulary) against ``y``."""
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def rank_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    *batch: torch.Tensor,
    loss_fn: Callable[..., torch.Tensor] = lm_loss,
) -> float:
    """One data-parallel training step on this rank's slice: ``loss_fn(model, *batch)``,
    backward, the optimizer step, the Float8 scales of FSDP2's float8 all-gather (a no-op
    without), and the loss averaged over the ranks (an all-reduce: every rank calls it)."""
    import torch.distributed as dist

    from aotdist.float8 import precompute_float8_scales

    loss = loss_fn(model, *batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    precompute_float8_scales(model)
    dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
    return loss.item()


def accumulate_grads(
    model: nn.Module,
    slices: Sequence[Sequence[torch.Tensor]],
    *,
    loss_fn: Callable[..., torch.Tensor] = lm_loss,
) -> float:
    """What data-parallel ranks that average their gradients compute, in one process:
    backward of ``loss_fn(model, *slice) / len(slices)`` for each rank's slice, the
    gradients accumulating. Returns the summed (so averaged) loss; the caller steps."""
    total = 0.0
    for batch in slices:
        loss = loss_fn(model, *batch) / len(slices)
        loss.backward()
        total += loss.item()
    return total


def train_steps(
    model: nn.Module, *, steps: int, lr: float = 0.5, batch: int = 2, seed: int = 1
) -> list[float]:
    """``steps`` SGD steps of ``model`` in this process on seeded batches; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for xs, ys in rank_batches(model, world_size=1, steps=steps, batch_per_rank=batch, seed=seed):
        loss = lm_loss(model, xs[0], ys[0])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def accumulated_reference(
    config: dict,
    *,
    world_size: int,
    depth: int,
    steps: int,
    batch_per_rank: int = 2,
    lr: float = 0.5,
    device: torch.device | str | None = None,
):
    """What ``world_size`` FSDP ranks compute, in one eager process.

    The same TinyGPT (seed 0) and Float8 conversion as the ranks, trained with SGD on the
    same rank slices with gradient accumulation (FSDP averages the ranks' gradients).

    Args:
        config: The ranks' aotdist config (only its ``float8`` section is used).
        world_size: How many ranks the batches are split over.
        depth: TinyGPT depth.
        steps: Optimizer steps.
        batch_per_rank: Samples per rank and step.
        lr: SGD learning rate.
        device: Where to train; default CPU. Parameters come back on CPU.

    Returns:
        ``(losses, {name: parameter}, state_dict keys)``.
    """
    torch.manual_seed(0)
    model = build_model("gpt", depth=depth)
    float8 = config.get("float8")
    if float8:
        from aotdist.config import Float8Config
        from aotdist.float8 import convert_to_float8

        convert_to_float8(model, Float8Config(**{**float8, "fsdp_all_gather": False}))
    keys = list(model.state_dict())
    model = model.to(device or "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for xs, ys in rank_batches(
        model, world_size=world_size, steps=steps, batch_per_rank=batch_per_rank
    ):
        slices = [
            (x.to(device or "cpu"), y.to(device or "cpu")) for x, y in zip(xs, ys, strict=True)
        ]
        losses.append(accumulate_grads(model, slices))
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}, keys


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def record_logs(
    name: str = "aotdist", level: int = logging.DEBUG
) -> Iterator[list[logging.LogRecord]]:
    """Records what logger ``name`` (and its children) logs at ``level`` and above.

    The logger's level is set for the duration and put back afterwards.

    Yields:
        The list the records are appended to.
    """
    logger, handler = logging.getLogger(name), _Records()
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
