"""``aotdist.pipeline``'s refusals: each wrong split or placement is one ConfigError that
names the problem and the fix, raised before any stage is built."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import aotdist
from aotdist.testing.distributed import fake_world


class Block(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc(x)


class Net(nn.Module):
    def __init__(self, blocks: int = 4):
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(blocks)})
        self.act = nn.ReLU()  # no parameters
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.stem(x) if self.stem is not None else x
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.act(x)) if self.head is not None else x


def _pipeline(model=None, *, world: int = 2, mesh=None, **pipeline):
    config = {"compile": {"backend": "aot_eager"}, "pipeline": {"enabled": True, **pipeline}}
    with fake_world(world):
        return aotdist.pipeline(
            model or Net(),
            microbatch=(torch.randn(2, 4),),
            loss_fn=nn.functional.mse_loss,
            config=config,
            mesh=mesh,
        )


@pytest.mark.parametrize(
    ("point", "says"),
    [
        ("blocks.1.fc", "is inside the region instance 'blocks.1'"),
        ("blokcs.1", "names no module of the model (did you mean 'blocks.1'?)"),
        ("stem", "not in the model's order after its first module"),
        ("tail", "pipeline stage 1 (['tail']) has no parameters"),
    ],
)
def test_a_wrong_split_is_one_screen_with_the_fix(point, says):
    model = Net()
    model.tail = nn.ReLU()  # registered last: a stage of it alone has no parameters
    with pytest.raises(aotdist.ConfigError, match="Fix") as err:
        _pipeline(model, split_points=[point])
    assert says in str(err.value), err.value


def test_fewer_region_instances_than_stages_is_refused():
    with pytest.raises(aotdist.ConfigError, match="cannot make 3 pipeline stages"):
        _pipeline(Net(blocks=2), world=3)


def test_a_degree_other_than_the_world_without_a_mesh_is_refused():
    with pytest.raises(aotdist.ConfigError, match="mesh_dim_names"):
        _pipeline(degree=4)


def test_parallelize_refuses_a_pipelined_config_and_names_aotdist_pipeline():
    with pytest.raises(aotdist.ConfigError, match="aotdist.pipeline"):
        aotdist.parallelize(Net(), config={"pipeline": {"enabled": True}})


def test_pipeline_config_rules():
    with pytest.raises(aotdist.ConfigError) as err:
        aotdist.AOTDistConfig.from_dict(
            {"pipeline": {"schedule": "1f1b", "degree": 1, "microbatches": 0}}
        )
    text = str(err.value)
    assert "pipeline.schedule" in text and "1F1B" in text
    assert "pipeline.degree" in text and "pipeline.microbatches" in text


def test_stage_copies_without_fsdp_to_average_their_gradients_are_refused():
    from torch.distributed.device_mesh import init_device_mesh

    config = {"compile": {"backend": "aot_eager"}, "pipeline": {"enabled": True}}
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        with pytest.raises(aotdist.ConfigError, match="Fix: fsdp.enabled: true") as err:
            aotdist.pipeline(
                Net(),
                microbatch=(torch.randn(2, 4),),
                loss_fn=nn.functional.mse_loss,
                config=config,
                mesh=mesh,
            )
    assert "('dp',) dimension(s) hold 2 copies of each stage" in str(err.value)


@pytest.mark.parametrize(
    ("pipeline", "says"),
    [
        ({"schedule": "1F1B", "stages_per_rank": 2}, "1F1B runs one stage per rank, got 2"),
        ({"schedule": "LoopedBFS", "stages_per_rank": 1}, "interleaves several stages per rank"),
        (
            {"schedule": "Interleaved1F1B", "degree": 2, "split_points": ["blocks.2"]},
            "but pipeline.degree is 2 x 2 per rank. Fix: give 3 split points",
        ),
    ],
)
def test_stages_per_rank_that_the_schedule_cannot_run_is_refused_with_the_fix(pipeline, says):
    with pytest.raises(aotdist.ConfigError, match="Fix") as err:
        aotdist.AOTDistConfig.from_dict({"pipeline": pipeline})
    assert says in str(err.value), err.value


def test_interleaved_schedules_hold_two_stages_per_rank_unless_told():
    def held(**pipeline):
        return aotdist.AOTDistConfig.from_dict({"pipeline": pipeline}).pipeline.local_stages

    assert (held(), held(schedule="GPipe")) == (1, 1)
    assert (held(schedule="Interleaved1F1B"), held(schedule="LoopedBFS")) == (2, 2)
    assert held(schedule="Interleaved1F1B", stages_per_rank=3) == 3


def test_micro_batches_interleaved_1f1b_cannot_divide_into_rounds_are_refused():
    # torch runs 5 // 2 = 2 rounds, which do not divide 5 micro-batches
    with pytest.raises(aotdist.ConfigError, match="Fix: a multiple of the pipeline") as err:
        _pipeline(schedule="Interleaved1F1B", microbatches=5)
    assert "Interleaved1F1B runs 5 // 2 = 2 rounds" in str(err.value)


def test_an_interleaved_split_needs_a_region_instance_per_stage():
    with pytest.raises(aotdist.ConfigError, match="cannot make 4 pipeline stages") as err:
        _pipeline(Net(blocks=3), schedule="LoopedBFS")
    assert "pipeline.stages_per_rank" in str(err.value)
