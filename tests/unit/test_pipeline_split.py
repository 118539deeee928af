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
