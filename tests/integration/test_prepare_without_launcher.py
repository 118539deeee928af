"""``aotdist.callbacks.prepare`` run with plain ``python`` (a notebook, a first try): FSDP
without a process group is refused with ``aotdist.parallelize``'s message, before
anything touches ``torch.distributed`` or the model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import aotdist
from aotdist.compile.state import STATE_ATTR
from aotdist.errors import ConfigError
from aotdist.testing.models import build_model

pytest.importorskip("accelerate")

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def plain_python(monkeypatch):
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)


def _parallelize_message() -> str:
    with pytest.raises(ConfigError) as err:
        aotdist.parallelize(build_model("gpt", depth=2), config={"fsdp": {"enabled": True}})
    return str(err.value)


@pytest.mark.parametrize("fsdp", [{"enabled": True}, {"enabled": True, "replicate_degree": 2}])
def test_prepare_without_a_launcher_says_what_parallelize_says(plain_python, fsdp):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from aotdist.callbacks import prepare

    AcceleratorState._reset_state()
    accelerator = Accelerator(cpu=True)
    model = build_model("gpt", depth=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError) as err:
        prepare(
            accelerator,
            model,
            optimizer,
            config={"fsdp": fsdp, "compile": {"backend": "aot_eager"}},
        )
    assert str(err.value) == _parallelize_message()
    assert str(err.value).startswith("fsdp.enabled needs an initialized process group")
    assert not dist.is_initialized()
    assert STATE_ATTR not in vars(model)  # refused before marking anything
    AcceleratorState._reset_state()
