"""torch's pipeline parallelism around stages that aotdist compiled: 2 stages on 2 gloo ranks.

The user splits the model at block boundaries (torchtitan's way: a copy of the model per
stage, the modules of other stages set to ``None``), compiles each stage with
``aotdist.compile_regions`` and hands it to ``torch.distributed.pipelining``. Each
schedule's losses, parameters and BatchNorm buffers are compared with one eager process
that runs the same micro-batches through the whole model; each stage compiles its blocks
as one reused subgraph. Both schedules share one spawn.

Each stage is given its micro-batch shapes: torch 2.11's runtime shape inference runs the
stage once on zeros, without gradients, which moves BatchNorm's running statistics (eager
alike) and compiles a second, no-gradient graph of the stage.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import aotdist
from aotdist import metrics
from aotdist.testing import run_distributed

STEPS = 3
MICRO = 2  # micro-batches per step (1F1B needs at least one per stage)
LR = 0.1
BLOCKS = 4
SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")


class Block(nn.Module):
    """A residual block with BatchNorm: running statistics are buffers the regions write."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.BatchNorm1d(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc(nn.functional.gelu(self.norm(x)))


class Net(nn.Module):
    """stem -> blocks -> head; a stage's copy holds ``None`` for what other stages run."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.stem = nn.Linear(8, dim)
        self.blocks = nn.ModuleDict({str(i): Block(dim) for i in range(BLOCKS)})
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        if self.stem is not None:
            x = self.stem(x)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x) if self.head is not None else x


def _model() -> Net:
    torch.manual_seed(0)  # every block's weights differ; every rank builds the same model
    return Net()


def _stage(model: Net, stage: int, stages: int) -> Net:
    """This stage's copy: its blocks (keys kept, so names match the whole model's), the
    stem on the first stage only, the head on the last."""
    part = copy.deepcopy(model)
    per = BLOCKS // stages
    mine = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for key in [k for k in part.blocks if k not in mine]:
        del part.blocks[key]
    if stage != 0:
        part.stem = None
    if stage != stages - 1:
        part.head = None
    return part


def _shapes(stage: int, stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's input and output on ``stage``, as meta tensors."""
    rows, dim = 8 // MICRO, 16
    inputs = (rows, 8 if stage == 0 else dim)
    outputs = (rows, 4 if stage == stages - 1 else dim)
    # the gradients that flow between the stages: into every stage's input but the first
    grads_in = stage != 0
    return (
        torch.empty(inputs, device="meta", requires_grad=grads_in),
        torch.empty(outputs, device="meta", requires_grad=True),
    )


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(STEPS)]


def _loss(out, target):
    return nn.functional.mse_loss(out, target)


def _pipelined(rank: int, world_size: int, schedule_name: str) -> dict:
    from torch.distributed import pipelining

    torch._dynamo.reset()
    part = aotdist.compile_regions(_stage(_model(), rank, world_size), backend="aot_eager")
    inputs, outputs = _shapes(rank, world_size)
    stage = pipelining.PipelineStage(
        part, rank, world_size, torch.device("cpu"), input_args=inputs, output_args=outputs
    )
    schedule = getattr(pipelining, schedule_name)(stage, n_microbatches=MICRO, loss_fn=_loss)
    opt = torch.optim.SGD(part.parameters(), lr=LR)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with metrics.track(part) as m:
            for x, y in _batches():
                opt.zero_grad()
                step_losses: list[torch.Tensor] = []
                if rank == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=y, losses=step_losses)
                opt.step()
                losses.append([float(v) for v in step_losses])
    return {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in part.state_dict().items()},
        "regions": {n: (r.call_sites, r.subgraphs) for n, r in m.regions.items()},
        "warnings": [
            str(w.message) for w in caught if issubclass(w.category, aotdist.RegionCompileWarning)
        ],
    }


def _both_schedules(rank: int, world_size: int) -> dict:
    return {name: _pipelined(rank, world_size, name) for name in SCHEDULES}


def _eager_reference():
    """The whole model in one process, the same micro-batches in the same order."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        micro = zip(x.chunk(MICRO), y.chunk(MICRO), strict=True)
        parts = [_loss(model(xm), ym) for xm, ym in micro]
        loss = sum(parts) / MICRO  # the schedules scale each micro-batch's gradient so
        loss.backward()
        opt.step()
        losses.append([float(p.detach()) for p in parts])
    return losses, model.state_dict()


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_both_schedules, 2, timeout=240.0)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_pipeline_of_compiled_stages_trains_as_the_whole_model_does(runs, schedule):
    ref_losses, ref_state = _eager_reference()
    first, last = runs[0][schedule], runs[1][schedule]
    torch.testing.assert_close(last["losses"], ref_losses)  # every micro-batch's loss
    assert first["losses"] == [[]] * STEPS  # the first stage computes no loss
    for result in (first, last):
        assert result["state"], "the stage has no state"
        for key, value in result["state"].items():  # parameters and BatchNorm buffers
            torch.testing.assert_close(value, ref_state[key], msg=f"{schedule}: {key}")
    covered = set(first["state"]) | set(last["state"])
    assert covered == set(ref_state)  # together the stages hold the whole model


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_stage_compiles_its_blocks_as_one_subgraph(runs, schedule):
    for rank in (0, 1):
        result = runs[rank][schedule]
        assert result["regions"] == {"Block": (BLOCKS // 2, 1)}, (rank, result["regions"])
        assert result["warnings"] == [], (rank, result["warnings"])
