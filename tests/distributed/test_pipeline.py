"""torch's pipeline parallelism around stages that aotdist compiled: 2 stages on 2 gloo
ranks, and 2 stages x 2 data-parallel ranks with each stage sharded (4 ranks; FSDP2's
hooks, and graph-mode FSDP).

The user splits the model at block boundaries (torchtitan's way: a copy of the model per
stage, the modules of other stages set to ``None``), compiles each stage with
``aotdist.compile_regions`` and hands it to ``torch.distributed.pipelining``. Each
schedule's losses, parameters and BatchNorm buffers are compared with one eager process
that runs the same micro-batches through the whole model; each stage compiles its blocks
as one reused subgraph. Both schedules share one spawn; each FSDP mode has its own.

Each stage is given its micro-batch shapes: torch 2.11's runtime shape inference runs the
stage once on zeros, without gradients, which moves BatchNorm's running statistics (eager
alike) and compiles a second, no-gradient graph of the stage.
"""

from __future__ import annotations

import contextlib
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
    """A residual block; with BatchNorm, running statistics are buffers the regions write."""

    def __init__(self, dim: int, norm: type[nn.Module] = nn.BatchNorm1d):
        super().__init__()
        self.norm = norm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc(nn.functional.gelu(self.norm(x)))


class Net(nn.Module):
    """stem -> blocks -> head; a stage's copy holds ``None`` for what other stages run."""

    def __init__(self, dim: int = 16, norm: type[nn.Module] = nn.BatchNorm1d, blocks: int = BLOCKS):
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


def _model(blocks: int = BLOCKS) -> Net:
    torch.manual_seed(0)  # every block's weights differ; every rank builds the same model
    return Net(blocks=blocks)


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
    # in fp32, as mixed-precision training does (torch 2.11's mse_loss backward fails on a
    # bfloat16 output against an fp32 target)
    return nn.functional.mse_loss(out.float(), target)


def _train_stage(part, stage_index: int, schedule_name: str, batches, group=None) -> dict:
    """``STEPS`` optimizer steps of one stage under the schedule: its micro-batch losses
    (the last stage's), what the regions compiled and aotdist's warnings."""
    from torch.distributed import pipelining

    inputs, outputs = _shapes(stage_index, 2)
    stage = pipelining.PipelineStage(
        part, stage_index, 2, torch.device("cpu"), inputs, outputs, group=group
    )
    schedule = getattr(pipelining, schedule_name)(stage, n_microbatches=MICRO, loss_fn=_loss)
    opt = torch.optim.SGD(part.parameters(), lr=LR)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with metrics.track(part) as m:
            for x, y in batches:
                opt.zero_grad()
                step_losses: list[torch.Tensor] = []
                if stage_index == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=y, losses=step_losses)
                opt.step()
                losses.append([float(v.detach()) for v in step_losses])
    return {
        "losses": losses,
        "regions": {n: (r.call_sites, r.subgraphs) for n, r in m.regions.items()},
        "warnings": [
            str(w.message) for w in caught if issubclass(w.category, aotdist.RegionCompileWarning)
        ],
    }


def _pipelined(rank: int, world_size: int, schedule_name: str) -> dict:
    torch._dynamo.reset()
    part = aotdist.compile_regions(_stage(_model(), rank, world_size), backend="aot_eager")
    result = _train_stage(part, rank, schedule_name, _batches())
    return {**result, "state": {k: v.detach().clone() for k, v in part.state_dict().items()}}


def _both_schedules(rank: int, world_size: int) -> dict:
    return {name: _pipelined(rank, world_size, name) for name in SCHEDULES}


def _eager_reference(model: Net, batches, micro_batches: int, grads: list | None = None):
    """The whole model in one process, the same micro-batches in the same order, each
    micro-batch's gradient scaled by their number (as the schedules, and FSDP's average
    over the data-parallel ranks, scale it). Returns the losses (a tensor: step x
    micro-batch) and the state; appends each step's gradients to ``grads``."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        micro = zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True)
        parts = [_loss(model(xm), ym) for xm, ym in micro]
        (sum(parts) / micro_batches).backward()
        if grads is not None:
            grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        losses.append([p.detach() for p in parts])
    return torch.tensor(losses), model.state_dict()


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_both_schedules, 2, timeout=240.0)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_pipeline_of_compiled_stages_trains_as_the_whole_model_does(runs, schedule):
    ref_losses, ref_state = _eager_reference(_model(), _batches(), MICRO)
    first, last = runs[0][schedule], runs[1][schedule]
    torch.testing.assert_close(torch.tensor(last["losses"]), ref_losses)  # every micro-batch's loss
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


# ------------------------------------------------ stages sharded with FSDP2: pp 2 x dp 2


def _ln_model(blocks: int = BLOCKS) -> Net:
    """The FSDP runs' model: LayerNorm, since BatchNorm's statistics would differ per
    data-parallel rank (each sees its own slice) and match no single eager run."""
    torch.manual_seed(0)
    return Net(norm=nn.LayerNorm, blocks=blocks)


DP = 2


def _global_batches():
    """Each step's batch for both data-parallel ranks: rank ``dp`` takes rows
    ``8 * dp : 8 * (dp + 1)``, as ``MICRO`` micro-batches of 4."""
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randn(8 * DP, 8, generator=g), torch.randn(8 * DP, 4, generator=g))
        for _ in range(STEPS)
    ]


def _pp_fsdp(rank: int, world_size: int, mode: str = "hooks") -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (2, DP), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    part = _stage(_ln_model(), pp, 2)
    config = {"compile": {"backend": "aot_eager"}, "fsdp": {"enabled": True, "mode": mode}}
    aotdist.parallelize(part, config=config, mesh=mesh["dp"])
    batches = [(x.chunk(DP)[dp], y.chunk(DP)[dp]) for x, y in _global_batches()]
    group = mesh["pp"].get_group()
    result = _train_stage(part, pp, "Schedule1F1B", batches, group=group)
    return {**result, "params": {k: v.full_tensor() for k, v in part.state_dict().items()}}


@pytest.fixture(scope="module", params=["hooks", "graph"])
def fsdp_runs(request):
    return run_distributed(_pp_fsdp, 4, request.param, timeout=300.0)


def test_stages_sharded_with_fsdp_train_as_the_whole_model_does(fsdp_runs):
    """Either FSDP mode inside the stages: FSDP2's hooks, or graph mode's collectives in
    the stage's graph."""
    ref_losses, ref_state = _eager_reference(_ln_model(), _global_batches(), DP * MICRO)
    # ranks (pp, dp): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1); the last stage's
    # losses are its data-parallel rank's micro-batches
    for dp, rank in enumerate((2, 3)):
        mine = ref_losses[:, MICRO * dp : MICRO * (dp + 1)]
        torch.testing.assert_close(torch.tensor(fsdp_runs[rank]["losses"]), mine)
    for rank, result in enumerate(fsdp_runs):
        for key, value in result["params"].items():
            torch.testing.assert_close(value, ref_state[key], msg=f"rank {rank}: {key}")
        assert result["regions"] == {"Block": (BLOCKS // 2, 1)}, (rank, result["regions"])
        assert result["warnings"] == [], (rank, result["warnings"])
    assert set().union(*(r["params"] for r in fsdp_runs)) == set(ref_state)


# ------------------------------------------ aotdist.pipeline: the split and schedule from config


def _configured(rank: int, world_size: int, schedule: str, mode: str | None) -> dict:
    """``aotdist.pipeline`` on the whole model: 2 stages (``mode`` None), 2 stages x 2
    tensor-parallel ranks (``"tp"``), or 2 stages x 2 data-parallel ranks with FSDP2 in
    ``mode``."""
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    config = {
        "compile": {"backend": "aot_eager"},
        "pipeline": {"enabled": True, "schedule": schedule, "microbatches": MICRO},
    }
    if mode is None:
        model, mesh, batches, dp = _model(), None, _batches(), 0
    elif mode == "tp":  # the user's tensor parallelism on the whole model, before the split
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        model, batches, tp_mesh = _model(), _batches(), mesh["tp"]
        for block in model.blocks.values():
            parallelize_module(block, tp_mesh, {"fc": ColwiseParallel(output_layouts=Replicate())})
    else:  # "hooks", "graph", or "bf16": hooks with bfloat16 compute
        config["fsdp"] = {"enabled": True, "mode": "hooks" if mode == "bf16" else mode}
        if mode == "bf16":
            config["fsdp"]["param_dtype"] = "bfloat16"
        mesh = init_device_mesh("cpu", (2, DP), mesh_dim_names=("pp", "dp"))
        dp = mesh["dp"].get_local_rank()
        model, batches = (
            _ln_model(),
            [(x.chunk(DP)[dp], y.chunk(DP)[dp]) for x, y in _global_batches()],
        )
    x0 = batches[0][0]
    pipe = aotdist.pipeline(
        model, microbatch=(x0.chunk(MICRO)[0],), loss_fn=_loss, config=config, mesh=mesh
    )
    opt = torch.optim.SGD(pipe.module.parameters(), lr=LR)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with metrics.track(pipe.module) as m:
            for x, y in batches:
                opt.zero_grad()
                step_losses: list[torch.Tensor] = []
                pipe.step(x, target=y, losses=step_losses)  # one loop for every stage
                opt.step()
                losses.append([float(v.detach()) for v in step_losses])
    state = {
        k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
        for k, v in pipe.module.state_dict().items()
    }
    return {
        "losses": losses,
        "units": pipe.units,
        "state": state,
        "regions": {n: (r.call_sites, r.subgraphs) for n, r in m.regions.items()},
        "warnings": [
            str(w.message) for w in caught if issubclass(w.category, aotdist.RegionCompileWarning)
        ],
    }


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_aotdist_pipeline_splits_at_regions_and_trains_as_the_whole_model(schedule):
    runs = run_distributed(_configured, 2, schedule, None, timeout=240.0)
    ref_losses, ref_state = _eager_reference(_model(), _batches(), MICRO)
    assert runs[0]["units"] == ("stem", "blocks.0", "blocks.1")
    assert runs[1]["units"] == ("blocks.2", "blocks.3", "head")
    assert runs[0]["losses"] == [[]] * STEPS
    torch.testing.assert_close(torch.tensor(runs[1]["losses"]), ref_losses)
    for rank, result in enumerate(runs):
        for key, value in result["state"].items():  # parameters and BatchNorm buffers
            torch.testing.assert_close(value, ref_state[key], msg=f"rank {rank}: {key}")
        assert result["regions"] == {"Block": (BLOCKS // 2, 1)}, (rank, result["regions"])
        assert result["warnings"] == [], (rank, result["warnings"])
    assert set(runs[0]["state"]) | set(runs[1]["state"]) == set(ref_state)


def test_aotdist_pipeline_with_fsdp_inside_each_stage_trains_as_the_whole_model():
    runs = run_distributed(_configured, 4, "1F1B", "hooks", timeout=300.0)
    ref_losses, ref_state = _eager_reference(_ln_model(), _global_batches(), DP * MICRO)
    for dp, rank in enumerate((2, 3)):  # the last stage's data-parallel ranks
        mine = ref_losses[:, MICRO * dp : MICRO * (dp + 1)]
        torch.testing.assert_close(torch.tensor(runs[rank]["losses"]), mine)
    for rank, result in enumerate(runs):
        for key, value in result["state"].items():
            torch.testing.assert_close(value, ref_state[key], msg=f"rank {rank}: {key}")
        assert result["regions"] == {"Block": (BLOCKS // 2, 1)}, (rank, result["regions"])
        assert result["warnings"] == [], (rank, result["warnings"])


def test_stages_computing_in_bfloat16_send_and_receive_bfloat16():
    # FSDP2's param_dtype bfloat16: stage 0 computes and sends bfloat16, so stage 1 must
    # allocate bfloat16 receive buffers (fp32 ones read its bytes as garbage: losses of
    # 1e17 and nan). Parity within bfloat16's precision of the fp32 eager run.
    runs = run_distributed(_configured, 4, "1F1B", "bf16", timeout=300.0)
    ref_losses, ref_state = _eager_reference(_ln_model(), _global_batches(), DP * MICRO)
    loose = {"rtol": 3e-2, "atol": 3e-2}
    for dp, rank in enumerate((2, 3)):
        mine = ref_losses[:, MICRO * dp : MICRO * (dp + 1)]
        torch.testing.assert_close(torch.tensor(runs[rank]["losses"]), mine, **loose)
    for rank, result in enumerate(runs):
        for key, value in result["state"].items():  # the fp32 shards the optimizer keeps
            assert value.dtype == torch.float32, (key, value.dtype)
            torch.testing.assert_close(value, ref_state[key], msg=f"rank {rank}: {key}", **loose)
        assert result["regions"] == {"Block": (BLOCKS // 2, 1)}, (rank, result["regions"])
        assert result["warnings"] == [], (rank, result["warnings"])


def test_aotdist_pipeline_with_tensor_parallel_stages_trains_as_the_whole_model():
    # pp 2 x tp 2: each block's linear is column-parallel (its output gathered); a region
    # holding DTensors compiles as a frame of its own, once per stage
    runs = run_distributed(_configured, 4, "1F1B", "tp", timeout=300.0)
    ref_losses, ref_state = _eager_reference(_model(), _batches(), MICRO)
    for rank in (2, 3):  # the last stage's tensor-parallel ranks see the whole batch
        torch.testing.assert_close(torch.tensor(runs[rank]["losses"]), ref_losses)
    for rank, result in enumerate(runs):
        for key, value in result["state"].items():  # parameters and BatchNorm buffers
            torch.testing.assert_close(value, ref_state[key], msg=f"rank {rank}: {key}")
        assert result["regions"] == {"Block": (BLOCKS // 2, 1)}, (rank, result["regions"])
        assert result["warnings"] == [], (rank, result["warnings"])


# ------------------------------- interleaved schedules: several stages per rank, 2 gloo ranks


def _interleaved(rank: int, world_size: int, schedule: str, micro: int) -> dict:
    """``aotdist.pipeline`` with 2 stages per rank: 4 stages of two blocks each (a stage
    finds its regions on itself), rank 0 holding stages 0 and 2, rank 1 stages 1 and 3
    (torch's looped placement). LayerNorm blocks: BatchNorm over the 2 rows of a
    micro-batch amplifies the rounding of the gradients' summation order (each
    micro-batch's backward adds its own; eager differentiates the mean) to 2e-4."""
    torch._dynamo.reset()
    config = {
        "compile": {"backend": "aot_eager"},
        "pipeline": {
            "enabled": True,
            "schedule": schedule,
            "microbatches": micro,
            "stages_per_rank": 2,
        },
    }
    batches = _batches()
    microbatch = (batches[0][0].chunk(micro)[0],)
    pipe = aotdist.pipeline(_ln_model(8), microbatch=microbatch, loss_fn=_loss, config=config)
    return {
        **_train_stages(pipe, batches, lambda t: t.detach().clone()),
        "units": pipe.units,
        "first_last": (pipe.is_first, pipe.is_last),
    }


def _train_stages(pipe, batches, whole) -> dict:
    """SGD over ``batches`` through ``pipe``'s schedule: each step's micro-batch losses,
    every gradient and the state after (``whole``: a tensor made whole, e.g. a DTensor's
    ``full_tensor``), each stage's regions and the region warnings."""
    opt = torch.optim.SGD(pipe.module.parameters(), lr=LR)
    losses, grads = [], []
    with warnings.catch_warnings(record=True) as caught, contextlib.ExitStack() as tracked:
        warnings.simplefilter("always")
        per_stage = [tracked.enter_context(metrics.track(part)) for part in pipe.modules]
        for x, y in batches:
            opt.zero_grad()
            step_losses: list[torch.Tensor] = []
            pipe.step(x, target=y, losses=step_losses)
            grads.append(
                {k: whole(p.grad) for part in pipe.modules for k, p in part.named_parameters()}
            )
            opt.step()
            losses.append([float(v.detach()) for v in step_losses])
    return {
        "losses": losses,
        "grads": grads,
        "stages": pipe.stage_indices,
        "state": {k: whole(v) for part in pipe.modules for k, v in part.state_dict().items()},
        "regions": [
            {n: (r.call_sites, r.subgraphs) for n, r in m.regions.items()} for m in per_stage
        ],
        "warnings": [
            str(w.message) for w in caught if issubclass(w.category, aotdist.RegionCompileWarning)
        ],
    }


@pytest.mark.parametrize(("schedule", "micro"), [("Interleaved1F1B", 4), ("LoopedBFS", 2)])
def test_interleaved_schedules_train_as_the_whole_model(schedule, micro):
    """Every micro-batch's loss, every parameter's gradient at every step and the state
    after each SGD step equal one eager process's; each stage compiles its block once."""
    runs = run_distributed(_interleaved, 2, schedule, micro, timeout=240.0)
    ref_grads: list[dict] = []
    ref_losses, ref_state = _eager_reference(_ln_model(8), _batches(), micro, ref_grads)
    assert runs[0]["units"] == ("stem", "blocks.0", "blocks.1", "blocks.4", "blocks.5")
    assert runs[1]["units"] == ("blocks.2", "blocks.3", "blocks.6", "blocks.7", "head")
    assert (runs[0]["stages"], runs[1]["stages"]) == ((0, 2), (1, 3))
    assert (runs[0]["first_last"], runs[1]["first_last"]) == ((True, False), (False, True))
    assert runs[0]["losses"] == [[]] * STEPS
    torch.testing.assert_close(torch.tensor(runs[1]["losses"]), ref_losses)
    for rank, result in enumerate(runs):
        for step, (grads, ref) in enumerate(zip(result["grads"], ref_grads, strict=True)):
            for key, grad in grads.items():
                where = f"rank {rank} step {step}: {key}"
                torch.testing.assert_close(grad, ref[key], msg=where)
        for key, value in result["state"].items():
            torch.testing.assert_close(value, ref_state[key], msg=f"rank {rank}: {key}")
        assert result["regions"] == [{"Block": (2, 1)}] * 2, (rank, result["regions"])
        assert result["warnings"] == [], (rank, result["warnings"])
    assert set(runs[0]["state"]) | set(runs[1]["state"]) == set(ref_state)
    assert set(runs[0]["grads"][0]) | set(runs[1]["grads"][0]) == set(ref_grads[0])


# ------------------------- interleaved stages sharded with FSDP2: 2 stages per rank, pp 2 x dp 2


def _interleaved_fsdp(rank: int, world_size: int, mode: str) -> dict:
    """``aotdist.pipeline`` with Interleaved1F1B, 2 stages per rank (4 stages of two
    blocks), each stage sharded over the 2 data-parallel ranks by FSDP2 in ``mode``: rank
    (pp, dp) holds stages pp and pp + 2 of its replica. Every step's full gradients (a
    collective over ``dp``: both ranks of a stage read them in the same order)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    micro = 4
    config = {
        "compile": {"backend": "aot_eager"},
        "fsdp": {"enabled": True, "mode": mode},
        "pipeline": {
            "enabled": True,
            "schedule": "Interleaved1F1B",
            "microbatches": micro,
            "stages_per_rank": 2,
        },
    }
    mesh = init_device_mesh("cpu", (2, DP), mesh_dim_names=("pp", "dp"))
    dp = mesh["dp"].get_local_rank()
    batches = [(x.chunk(DP)[dp], y.chunk(DP)[dp]) for x, y in _global_batches()]
    microbatch = (batches[0][0].chunk(micro)[0],)
    model = _ln_model(8)
    pipe = aotdist.pipeline(model, microbatch=microbatch, loss_fn=_loss, config=config, mesh=mesh)
    return _train_stages(pipe, batches, lambda t: t.full_tensor())


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["hooks", "graph"])
def test_interleaved_stages_sharded_with_fsdp_train_as_the_whole_model(mode):
    """Interleaved1F1B, 2 stages per rank, on 2 pipeline x 2 data-parallel ranks: every
    micro-batch's loss, every gradient at every step and the parameters after each step
    equal one eager process's; each stage compiles its block once."""
    runs = run_distributed(_interleaved_fsdp, 4, mode, timeout=240.0)
    ref_grads: list[dict] = []
    ref_losses, ref_state = _eager_reference(_ln_model(8), _global_batches(), DP * 4, ref_grads)
    # ranks (pp, dp): 0 = (0, 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1)
    assert [r["stages"] for r in runs] == [(0, 2), (0, 2), (1, 3), (1, 3)]
    for dp, rank in enumerate((2, 3)):  # the last stage's data-parallel ranks
        mine = ref_losses[:, 4 * dp : 4 * (dp + 1)]
        torch.testing.assert_close(torch.tensor(runs[rank]["losses"]), mine)
    for rank, result in enumerate(runs):
        for step, (grads, ref) in enumerate(zip(result["grads"], ref_grads, strict=True)):
            for key, grad in grads.items():
                torch.testing.assert_close(grad, ref[key], msg=f"rank {rank} step {step}: {key}")
        for key, value in result["state"].items():
            torch.testing.assert_close(value, ref_state[key], msg=f"rank {rank}: {key}")
        assert result["regions"] == [{"Block": (2, 1)}] * 2, (rank, result["regions"])
        assert result["warnings"] == [], (rank, result["warnings"])
    assert set().union(*(r["state"] for r in runs)) == set(ref_state)
