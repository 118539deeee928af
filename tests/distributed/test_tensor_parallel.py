"""Tensor parallelism under the regions: dp x tp = 2 x 2 on 4 CPU ranks (gloo).

The user applies ``parallelize_module`` (colwise / rowwise) to every decoder layer of a
transformers Llama on the ``tp`` dim, then aotdist shards with FSDP2 on the ``dp`` dim
(hooks mode) and compiles each layer's region once; without FSDP2 the regions, which then
hold DTensors, compile as frames of their own. The same job runs from a plain script,
from Accelerate's ``ParallelismConfig`` through ``aotdist.callbacks.prepare`` and from
Lightning's ``ModelParallelStrategy``; each is compared with one eager process training the
same weights on the same data-parallel slices. All runs share one spawn.
"""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch

import aotdist
from aotdist import metrics
from aotdist.testing import accumulate_grads, rank_step, run_distributed

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # one 4-rank spawn, several compiled runs

DEPTH = 2
STEPS = 3
LR = 0.5
AOT = {"compile": {"backend": "aot_eager"}}
# Lightning's default_root_dir for runs that write nothing we read: never the repository,
# and removed when this process exits (mkdtemp alone left one folder per run behind).
_SCRATCH = tempfile.TemporaryDirectory(prefix="aotdist-test-pl-")


def _llama():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=DEPTH,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        use_cache=False,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def _apply_tp(model, mesh, *, slice_per_layer: bool = False):
    from torch.distributed.tensor.parallel import parallelize_module

    tp_mesh = mesh["tp"]  # one object for every layer (see the per-layer run)
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"] if slice_per_layer else tp_mesh, _tp_plan())


def _batches(n_dp: int = 2):
    """STEPS global batches of 4 sequences, each split into ``n_dp`` data-parallel slices."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (4, 12), generator=g).chunk(n_dp) for _ in range(STEPS)]


def _lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _train(model, dp_rank: int, n_dp: int = 2) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    return [rank_step(model, opt, ids[dp_rank], loss_fn=_lm_loss) for ids in _batches(n_dp)]


def _result(model, losses, tracker, caught) -> dict:
    weight = model.model.layers[0].mlp.gate_proj.weight
    return {
        "losses": losses,
        "params": {  # without FSDP2, what TP left alone is a plain tensor
            k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach()
            for k, v in model.state_dict().items()
        },
        "mesh": weight.device_mesh.mesh_dim_names or tuple(weight.device_mesh.shape),
        "placements": [type(p).__name__ for p in weight.placements],
        "regions": tracker.regions["LlamaDecoderLayer"].__dict__ if tracker else None,
        "warnings": [
            str(w.message) for w in caught if issubclass(w.category, aotdist.RegionCompileWarning)
        ],
    }


def _script(rank: int, slice_per_layer: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _llama()
    _apply_tp(model, mesh, slice_per_layer=slice_per_layer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aotdist.parallelize(model, config={**AOT, "fsdp": {"enabled": True}}, mesh=mesh["dp"])
        with metrics.track(model) as m:
            losses = _train(model, mesh["dp"].get_local_rank())
    return _result(model, losses, m, caught)


def _tp_only(rank: int) -> dict:
    """Tensor parallelism without FSDP2: each rank steps on both data slices itself, as
    the eager reference does; the regions hold DTensors and compile as frames."""
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _llama()
    _apply_tp(model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aotdist.parallelize(model, config=AOT)
        with metrics.track(model) as m:
            losses = []
            for ids in _batches():
                losses.append(accumulate_grads(model, [(x,) for x in ids], loss_fn=_lm_loss))
                opt.step()
                opt.zero_grad()
    return {**_result(model, losses, m, caught), "mode": str(m.mode)}


def _accelerate(rank: int, **sizes) -> dict:
    from accelerate import Accelerator, ParallelismConfig
    from accelerate.state import AcceleratorState
    from aotdist.callbacks import prepare

    torch._dynamo.reset()
    AcceleratorState._reset_state()  # one process, several Accelerators
    # Accelerate 1.15 accepts a ParallelismConfig on GPUs (MULTI_GPU) and FSDP2, not on
    # MULTI_CPU; its mesh is built before that check, which is skipped here (CPU only)
    ParallelismConfig._validate_accelerator = lambda self, accelerator: None
    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(**sizes))
    mesh = accelerator.torch_device_mesh
    model = _llama()
    if "tp" in mesh.mesh_dim_names:
        _apply_tp(model, mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (model,) = prepare(accelerator, model, config=AOT)  # FSDP: ParallelismConfig shards
        with metrics.track(model) as m:
            if "dp_replicate" in mesh.mesh_dim_names:  # HSDP: 4 data-parallel ranks
                losses = _train(model, rank, n_dp=4)
            else:
                losses = _train(model, mesh.get_local_rank("dp_shard"))
    return _result(model, losses, m, caught)


def _lightning(rank: int) -> dict:
    import lightning.pytorch as pl
    from aotdist.callbacks import RegionalCompile
    from lightning.pytorch.strategies import ModelParallelStrategy

    torch._dynamo.reset()

    class LitLlama(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _llama()
            self.losses = []

        def configure_model(self):  # the user's tensor parallelism, on Lightning's mesh
            mesh = self.device_mesh
            _apply_tp(self.model, {"tp": mesh["tensor_parallel"]})

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            loss = self.model(input_ids=ids, labels=ids).loss
            self.losses.append(loss.detach().item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    class DataParallelSlices(torch.utils.data.Dataset):  # the same slices as _train
        def __init__(self, dp_rank):
            self.rows = [ids[dp_rank] for ids in _batches()]

        def __len__(self):
            return STEPS

        def __getitem__(self, i):
            return (self.rows[i],)

    module = LitLlama()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=4,
            max_steps=STEPS,
            logger=False,
            strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2),
            callbacks=[RegionalCompile(AOT)],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            use_distributed_sampler=False,
            default_root_dir=tempfile.mkdtemp(dir=_SCRATCH.name),
        )
        dp_rank = rank // 2  # Lightning's mesh: (data_parallel, tensor_parallel), row-major
        loader = torch.utils.data.DataLoader(DataParallelSlices(dp_rank), batch_size=None)
        trainer.fit(module, loader)
    # Lightning logs the rank's own loss; average over the data-parallel ranks as _train does
    import torch.distributed as dist

    losses = torch.tensor(module.losses)
    dist.all_reduce(losses, op=dist.ReduceOp.SUM)
    out = _result(module.model, (losses / 4).tolist(), None, caught)
    out["plan"] = list(aotdist.parallelize_info(trainer.callbacks[0].applied.target).plan.fqns)
    return out


def _refused(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _llama()
    _apply_tp(model, mesh)
    try:
        aotdist.parallelize(
            model, config={**AOT, "fsdp": {"enabled": True, "mode": "graph"}}, mesh=mesh["dp"]
        )
    except aotdist.ConfigError as exc:
        return {
            "graph": str(exc),
            "untouched": not any("Region" in type(m).__name__ for m in model.modules()),
        }
    return {"graph": None}


def _runs(rank: int, world_size: int) -> dict:
    return {  # the per-layer slicing first: later meshes of one process may reuse cached
        # submesh objects (torch's mesh resources), which would hide what it shows
        "per_layer_mesh": _script(rank, slice_per_layer=True),
        "script": _script(rank),
        "tp_only": _tp_only(rank),
        "accelerate_tp": _accelerate(rank, dp_shard_size=2, tp_size=2),
        "accelerate_hsdp": _accelerate(rank, dp_replicate_size=2, dp_shard_size=2),
        "lightning_tp": _lightning(rank),
        "refused": _refused(rank),
    }


def _reference():
    """One eager process: the same Llama, SGD, gradients accumulated over the slices."""
    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids in _batches():
        losses.append(accumulate_grads(model, [(x,) for x in ids], loss_fn=_lm_loss))
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_runs, 4, timeout=580)[0]


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.mark.parametrize(
    "name",
    ["script", "tp_only", "per_layer_mesh", "accelerate_tp", "accelerate_hsdp", "lightning_tp"],
)
def test_matches_single_process_eager(runs, reference, name):
    ref_losses, ref_params = reference
    run = runs[name]
    torch.testing.assert_close(
        torch.tensor(run["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6
    )
    for key, ref in ref_params.items():
        torch.testing.assert_close(run["params"][key], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["script", "accelerate_tp"])
def test_tensor_parallel_layers_compile_once_under_fsdp(runs, name):
    run = runs[name]  # 2-D: sharded by FSDP2 on the data-parallel dim, by TP on tp
    assert len(run["placements"]) == 2 and run["placements"][-1] == "Shard", run["placements"]
    assert run["mesh"] == ({"script": "dp", "accelerate_tp": "dp_shard"}[name], "tp"), run["mesh"]
    assert run["regions"]["call_sites"] == DEPTH, run["regions"]
    assert run["regions"]["subgraphs"] == 1, run["regions"]
    assert run["warnings"] == [], run["warnings"]


def test_tensor_parallel_layers_without_fsdp_compile_once_as_frames(runs):
    # torch's invoke_subgraph takes no DTensor operands: each region is a frame of its own
    run = runs["tp_only"]
    assert run["placements"] == ["Shard"] and run["mesh"] == ("tp",), run
    assert run["mode"] == "frames", run["mode"]
    assert (run["regions"]["call_sites"], run["regions"]["subgraphs"]) == (DEPTH, 1), run
    assert run["warnings"] == [], run["warnings"]


def test_a_mesh_sliced_per_layer_is_named(runs):
    """``mesh["tp"]`` per layer gives each layer its own DeviceMesh object, which Dynamo
    guards on: the region compiles once per layer, and aotdist says why and what to do."""
    run = runs["per_layer_mesh"]
    if run["regions"]["subgraphs"] == 1:  # torch 2.11: slicing returns one cached object
        assert run["warnings"] == [], run["warnings"]
        return
    assert run["regions"]["subgraphs"] == DEPTH, run["regions"]  # seen on torch 2.14
    (warning,) = run["warnings"]
    assert "distinct DeviceMesh objects" in warning and "tp_mesh = mesh['tp']" in warning


def test_accelerate_parallelism_config_hsdp(runs):
    run = runs["accelerate_hsdp"]
    assert run["placements"] == ["Replicate", "Shard"], run["placements"]
    assert run["mesh"] == ("dp_replicate", "dp_shard"), run["mesh"]


def test_lightning_tensor_parallel(runs):
    run = runs["lightning_tp"]
    assert run["mesh"] == ("data_parallel", "tensor_parallel"), run["mesh"]
    assert len(run["placements"]) == 2 and run["placements"][-1] == "Shard", run["placements"]
    assert [f.split("model.")[-1] for f in run["plan"]] == [f"layers.{i}" for i in range(DEPTH)], (
        run["plan"]
    )
    assert run["warnings"] == [], run["warnings"]


def test_graph_mode_refuses_tensor_parallel_before_changing_the_model(runs):
    refused = runs["refused"]
    assert (
        refused["graph"] is not None
        and "does not compose with tensor parallelism" in refused["graph"]
        and "fsdp.mode: hooks" in refused["graph"]
    ), refused
    assert refused["untouched"], refused
