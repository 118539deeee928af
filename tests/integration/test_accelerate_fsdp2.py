"""``RegionalCompileHook`` with Accelerate's own FSDP2 (``FullyShardedDataParallelPlugin(
fsdp_version=2)``), 2 CPU ranks (gloo), against the same Accelerate FSDP2 run in eager.

The designed behaviour (callbacks/accelerate.py): attached after ``accelerator.prepare``
the hook compiles the regions in place inside Accelerate's FSDP2 units (FSDP2's hooks
stay eager around them); attached before, the model it compiled is then sharded under
it, which aotdist refuses with an ``OrderingError`` naming the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aotdist.testing import build_model, example_inputs, run_distributed

pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow  # one 2-rank spawn, three Accelerate FSDP2 runs

DEPTH = 2


def _fsdp2_accelerator():
    """An Accelerator for 2 CPU processes with Accelerate's FSDP2 plugin."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin

    AcceleratorState._reset_state()  # one process, several Accelerators
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["GPTBlock"],
    )
    return Accelerator(cpu=True, fsdp_plugin=plugin), plugin


def _as_fsdp2(accelerator, plugin) -> bool:
    """Makes the next ``prepare`` take Accelerate's own FSDP2 path on CPU.

    Accelerate 1.15 ignores ``fsdp_plugin`` on CPU (``cpu=True`` gives ``MULTI_CPU``: FSDP
    is only chosen for GPU-like devices, and a later ``AcceleratorState()`` derives
    ``MULTI_CPU`` again), so the state is set to FSDP right before ``prepare``, which then
    runs Accelerate's real ``fsdp2_prepare_model`` (``fully_shard`` per GPTBlock, root)
    over gloo.
    """
    from accelerate.utils import DistributedType

    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    return accelerator.is_fsdp2


def _orders(rank: int, world_size: int) -> dict:
    from accelerate.hooks import add_hook_to_module
    from aotdist.callbacks import RegionalCompileHook
    from torch.distributed.fsdp import FSDPModule

    from aotdist.compile.state import STATE_ATTR
    from aotdist.errors import OrderingError

    g = torch.Generator().manual_seed(rank + 10)
    batches = [example_inputs(build_model("gpt", depth=1), 2, generator=g) for _ in range(3)]
    out = {}
    for order in ("eager", "prepare_then_hook", "hook_then_prepare"):
        accelerator, plugin = _fsdp2_accelerator()
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build_model("gpt", depth=DEPTH)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        hook = RegionalCompileHook({"compile": {"backend": "aot_eager"}})
        if order == "hook_then_prepare":
            add_hook_to_module(model, hook)
        fsdp2 = _as_fsdp2(accelerator, plugin)
        model, optimizer = accelerator.prepare(model, optimizer)
        if order == "prepare_then_hook":
            add_hook_to_module(model, hook)
        units = sorted(type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule))
        losses = []
        try:
            for (x,), y in batches:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
        except OrderingError as exc:
            out[order] = {"error": str(exc), "units": units}
            continue
        out[order] = {
            "fsdp2": fsdp2,
            "units": units,
            "losses": losses,
            "params": {
                k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in model.state_dict().items()
            },
            "compiled": STATE_ATTR in vars(accelerator.unwrap_model(model)),
            "call_sites": (
                hook.metrics.regions["GPTBlock"].call_sites
                if hook.metrics and "GPTBlock" in hook.metrics.regions
                else None
            ),
            "frames": hook.metrics.frames_compiled if hook.metrics else None,
        }
    return out


@pytest.fixture(scope="module")
def orders():
    return run_distributed(_orders, 2, timeout=540)


def test_hook_after_accelerate_fsdp2_compiles_inside_its_units_like_eager(orders):
    rank0 = orders[0]
    eager, got = rank0["eager"], rank0["prepare_then_hook"]
    assert eager["fsdp2"] and got["fsdp2"]
    # Accelerate's FSDP2 units: each GPTBlock (its auto-wrap also wraps the final
    # LayerNorm) and the root
    assert got["units"] == eager["units"], got["units"]
    assert got["units"].count("FSDPGPTBlock") == DEPTH and "FSDPTinyGPT" in got["units"]
    assert got["compiled"] and got["frames"], got
    assert got["call_sites"] == DEPTH, got["call_sites"]
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=1e-6
    )
    for key, value in eager["params"].items():
        torch.testing.assert_close(
            got["params"][key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}"
        )
    assert orders[1]["prepare_then_hook"]["losses"] == got["losses"]


def test_hook_before_accelerate_fsdp2_is_refused_naming_the_fix(orders):
    for rank in (0, 1):
        got = orders[rank]["hook_then_prepare"]
        assert "error" in got, got.get("losses")
        assert got["error"].startswith(
            "RegionalCompileHook was attached to the model before it was sharded with FSDP2"
        ), got["error"]
        assert "Fix: attach it after accelerator.prepare" in got["error"]
        assert got["units"].count("FSDPGPTBlock") == DEPTH  # Accelerate did shard it
