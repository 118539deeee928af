"""A context-parallel request (a mesh with a ``cp`` dimension, torchtitan's and Accelerate's
name) is refused on one screen, with the reason and the fix: torch's ``context_parallel``
shards attention through CUDA's SDPA kernels only (its run on CPU:
``tests/distributed/test_torch_context_parallel.py``), and FSDP2 would otherwise shard over
``cp`` as over data."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import aotdist
from aotdist.testing.distributed import fake_world


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x) if block is not None else x
        return x


def _mesh(*names: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,) * len(names), mesh_dim_names=names)


def test_parallelize_refuses_a_cp_dimension_on_cpu_with_the_reason_and_the_fix():
    config = {"compile": {"backend": "aot_eager"}, "fsdp": {"enabled": True}}
    with fake_world(4):
        with pytest.raises(aotdist.ConfigError) as err:
            aotdist.parallelize(Net(), config=config, mesh=_mesh("dp_shard", "cp"))
    text = str(err.value)
    assert "('dp_shard', 'cp'), with 'cp' (context parallelism) on cpu" in text
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in text
    assert text.endswith("Fix: pass a mesh without the cp dimension (Accelerate: cp_size=1)")


def test_a_pipeline_refuses_a_cp_dimension_before_it_splits():
    config = {"compile": {"backend": "aot_eager"}, "pipeline": {"enabled": True}}
    with fake_world(4):
        with pytest.raises(aotdist.ConfigError, match="with 'cp' \\(context parallelism\\)"):
            aotdist.pipeline(
                Net(),
                microbatch=(torch.randn(2, 8),),
                loss_fn=nn.functional.mse_loss,
                config=config,
                mesh=_mesh("pp", "cp"),
            )


def test_a_mesh_without_cp_is_not_refused():
    config = {"compile": {"backend": "aot_eager"}, "fsdp": {"enabled": True}}
    with fake_world(2):
        model = aotdist.parallelize(Net(), config=config, mesh=_mesh("dp_shard"))
    assert aotdist.parallelize_info(model).mesh.mesh_dim_names == ("dp_shard",)
