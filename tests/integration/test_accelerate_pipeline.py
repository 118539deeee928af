"""``aotdist.callbacks.prepare_pipeline``: a pipelined model under an ``Accelerator``, on
gloo ranks, against one eager process that runs the same micro-batches through the whole
model.

2 processes are 2 stages (BatchNorm blocks: the regions write its running statistics);
4 are 2 stages x 2 data-parallel replicas, each stage sharded with FSDP2 over its
replica's ranks (LayerNorm: each replica sees its own rows). Training goes through
Accelerate's prepared optimizer and dataloader, one loop for every process. Also checked:
the refusals that would otherwise train wrongly or lose state.
"""

from __future__ import annotations

import contextlib
import tempfile
import warnings

import pytest
import torch
from torch import nn

import aotdist
from aotdist import metrics
from aotdist.testing import run_distributed

pytest.importorskip("accelerate")

STEPS = 3
MICRO = 2
LR = 0.1
BLOCKS = 4
ROWS = 8  # a replica's batch


class Block(nn.Module):
    def __init__(self, dim: int, norm: type[nn.Module]):
        super().__init__()
        self.norm = norm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc(nn.functional.gelu(self.norm(x)))


class Net(nn.Module):
    """stem -> blocks -> head; a stage holds ``None`` for what other stages run."""

    def __init__(self, norm: type[nn.Module], dim: int = 16, blocks: int = BLOCKS):
        super().__init__()
        self.stem = nn.Linear(8, dim)
        self.blocks = nn.ModuleDict({str(i): Block(dim, norm) for i in range(blocks)})
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        if self.stem is not None:
            x = self.stem(x)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x) if self.head is not None else x


def _model(norm: type[nn.Module], blocks: int = BLOCKS) -> Net:
    torch.manual_seed(0)  # the blocks' weights differ; every process builds the same model
    return Net(norm, blocks=blocks)


def _loss(out, target):
    return nn.functional.mse_loss(out, target)


def _dataset(replicas: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    n = STEPS * ROWS * replicas
    return torch.utils.data.TensorDataset(
        torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)
    )


def _config(**extra) -> dict:
    return {
        "compile": {"backend": "aot_eager"},
        "pipeline": {"enabled": True, "schedule": "1F1B", "microbatches": MICRO},
        **extra,
    }


def _accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    return Accelerator(cpu=True)


def _train(rank: int, world_size: int, interleaved: bool = False) -> dict:
    """``interleaved``: Interleaved1F1B, 2 stages of two blocks per process (8 blocks)."""
    from aotdist.callbacks import prepare_pipeline

    torch._dynamo.reset()
    accelerator = _accelerator()
    replicas = world_size // 2
    norm = nn.BatchNorm1d if replicas == 1 else nn.LayerNorm
    model = _model(norm, 2 * BLOCKS if interleaved else BLOCKS)
    pipeline = {"enabled": True, "degree": 2, "microbatches": MICRO}
    if interleaved:  # 2 micro-batches over 2 ranks: one round
        pipeline.update(schedule="Interleaved1F1B", stages_per_rank=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)  # on the whole model
    loader = torch.utils.data.DataLoader(_dataset(replicas), batch_size=ROWS)
    pipe, optimizer, loader = prepare_pipeline(
        accelerator,
        model,
        optimizer,
        loader,
        microbatch=(torch.zeros(ROWS // MICRO, 8),),
        loss_fn=_loss,
        config=_config(pipeline=pipeline),
    )
    losses, rows = [], []
    with warnings.catch_warnings(record=True) as caught, contextlib.ExitStack() as tracked:
        warnings.simplefilter("always")
        per_stage = [tracked.enter_context(metrics.track(part)) for part in pipe.modules]
        for x, y in loader:  # the same loop on every process
            optimizer.zero_grad()
            step_losses: list[torch.Tensor] = []
            pipe.step(x, target=y, losses=step_losses)
            optimizer.step()
            losses.append([float(v.detach()) for v in step_losses])
            rows.append(x[:, 0].tolist())
    state = {  # each stage keeps the whole model's names
        k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
        for part in pipe.modules
        for k, v in part.state_dict().items()
    }
    from aotdist.errors import ConfigError

    with tempfile.TemporaryDirectory() as out:
        try:
            accelerator.save_state(out)
            refused = ""
        except ConfigError as e:
            refused = str(e)
    return {
        "losses": losses,
        "rows": rows,
        "stages": pipe.stage_indices,
        "opt_params": sum(p.numel() for g in optimizer.param_groups for p in g["params"]),
        "stage_params": sum(p.numel() for p in pipe.module.parameters()),
        "state": state,
        "regions": [
            {n: (r.call_sites, r.subgraphs) for n, r in m.regions.items()} for m in per_stage
        ],
        "warnings": [
            str(w.message) for w in caught if issubclass(w.category, aotdist.RegionCompileWarning)
        ],
        "save_state": refused,
    }


def _eager_reference(model: Net, replicas: int):
    """The whole model in one process: each step's batch is every replica's rows, as
    ``MICRO`` micro-batches per replica, each micro-batch's gradient scaled by their number."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = _dataset(replicas)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        parts = []
        for r in range(replicas):  # Accelerate's split: replica r takes batch r of each round
            start = (step * replicas + r) * ROWS
            x, y = data[start : start + ROWS]
            parts += [
                _loss(model(xm), ym) for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO), strict=True)
            ]
        (sum(parts) / len(parts)).backward()
        opt.step()
        losses.append([p.detach() for p in parts])
    return torch.tensor(losses), model.state_dict()


def _check(runs: list[dict], replicas: int, interleaved: bool = False) -> None:
    norm = nn.BatchNorm1d if replicas == 1 else nn.LayerNorm
    ref_losses, ref_state = _eager_reference(
        _model(norm, 2 * BLOCKS if interleaved else BLOCKS), replicas
    )
    mine = [(0, 2), (1, 3)] if interleaved else [(0,), (1,)]  # rank r: stages r (and r + 2)
    stages = [r["stages"] for r in runs]
    assert stages == [mine[0]] * replicas + [mine[1]] * replicas, stages
    for r in range(replicas):  # a replica's stages read the same batches
        assert runs[r]["rows"] == runs[replicas + r]["rows"]
        assert runs[r]["losses"] == [[]] * STEPS  # the first stage computes no loss
        want = ref_losses[:, MICRO * r : MICRO * (r + 1)]
        torch.testing.assert_close(torch.tensor(runs[replicas + r]["losses"]), want)
    for rank, result in enumerate(runs):
        for key, value in result["state"].items():  # parameters and BatchNorm buffers
            torch.testing.assert_close(value, ref_state[key], msg=f"rank {rank}: {key}")
        per_stage = [{"Block": (2, 1)}] * len(mine[0])  # each stage: two blocks, one subgraph
        assert result["regions"] == per_stage, (rank, result["regions"])
        assert result["warnings"] == [], (rank, result["warnings"])
        assert result["opt_params"] == result["stage_params"]  # the stage's, nothing else
        assert "stage 0" in result["save_state"] and "checkpoint" in result["save_state"]
    assert set().union(*(r["state"] for r in runs)) == set(ref_state)


def test_two_stages_under_accelerate_train_as_the_whole_model():
    _check(run_distributed(_train, 2, timeout=240.0), replicas=1)


@pytest.mark.slow  # 4 ranks on 2 cores
def test_stages_sharded_over_replicas_under_accelerate_train_as_the_whole_model():
    _check(run_distributed(_train, 4, timeout=300.0), replicas=2)


@pytest.mark.slow  # 4 ranks on 2 cores
def test_interleaved_stages_sharded_over_replicas_under_accelerate_train_as_the_whole_model():
    # Interleaved1F1B: each process holds 2 stages of one replica, each sharded with FSDP2
    _check(run_distributed(_train, 4, True, timeout=300.0), replicas=2, interleaved=True)


def _refusals(rank: int, world_size: int) -> dict:
    from aotdist.callbacks import prepare_pipeline

    from aotdist.errors import ConfigError

    out = {}
    cases = {
        "not_enabled": {"compile": {"backend": "aot_eager"}},
        "indivisible": _config(pipeline={"enabled": True, "degree": 3, "microbatches": MICRO}),
    }
    for name, config in cases.items():
        accelerator = _accelerator()
        model = _model(nn.BatchNorm1d)
        try:
            prepare_pipeline(
                accelerator, model, microbatch=(torch.zeros(4, 8),), loss_fn=_loss, config=config
            )
            out[name] = ""
        except ConfigError as e:
            out[name] = str(e)
    return out


def test_a_config_without_a_pipeline_or_a_degree_that_does_not_divide_is_refused():
    runs = run_distributed(_refusals, 2, timeout=120.0)
    for result in runs:
        assert "pipeline.enabled: true" in result["not_enabled"]
        assert "Fix: set it" in result["not_enabled"]
        assert "2 processes do not divide into pipeline.degree = 3" in result["indivisible"]


def test_prepare_with_a_pipelined_config_names_prepare_pipeline():
    from aotdist.callbacks import prepare

    with pytest.raises(aotdist.ConfigError, match="prepare_pipeline") as err:
        prepare(_accelerator(), _model(nn.BatchNorm1d), config=_config())
    assert "Fix" in str(err.value)
