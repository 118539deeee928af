"""``aotdist.parallelize`` on 2 and 4 CPU ranks (gloo) against single-process eager.

Each rank trains on its slice of every global batch; the reference is one process that
trains the same model (same seed, same Float8 conversion) eagerly on the same slices with
gradient accumulation, which is what FSDP's averaged gradients compute. The configs of
one world size run in one spawn (process start-up dominates on a 2-core machine), and
the tests below check what each config returned.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch

import aotdist
from aotdist import metrics
from aotdist.config import as_config
from aotdist.errors import RegionCompileWarning
from aotdist.float8 import warn_unverified_combination
from aotdist.testing import (
    accumulated_reference,
    build_model,
    example_inputs,
    lm_loss,
    rank_batches,
    run_distributed,
)

DEPTH = 3
# every test spawns ranks that train several configurations: 20-90 s each on 2 cores
pytestmark = pytest.mark.slow

STEPS = 5
BATCH_PER_RANK = 2
FLOAT8 = {"enabled": True, "exclude": ["head"]}

CONFIGS = {
    "fsdp": {"fsdp": {"enabled": True}, "compile": {"enabled": False}},
    "fsdp+compile": {"fsdp": {"enabled": True}, "compile": {"backend": "aot_eager"}},
    "fsdp+compile+noreshard+ac": {
        "fsdp": {"enabled": True, "reshard_after_forward": False},
        "compile": {"backend": "aot_eager"}, "ac": {"enabled": True},
    },
    "fsdp+float8+compile": {
        "fsdp": {"enabled": True}, "compile": {"backend": "aot_eager"}, "float8": FLOAT8,
    },
    "fsdp+float8ag+compile": {
        "fsdp": {"enabled": True}, "compile": {"backend": "aot_eager"},
        "float8": {**FLOAT8, "fsdp_all_gather": True},
    },
}


def _batches(world_size: int, model):
    return rank_batches(model, world_size=world_size, steps=STEPS, batch_per_rank=BATCH_PER_RANK)


def _count_all_gathers(counts: dict[str, int]):
    """Counts FSDP2 all-gathers per unit by wrapping ``FSDPParamGroup.unshard``."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    original = FSDPParamGroup.unshard

    def unshard(self, *args, **kwargs):
        pending = self._all_gather_result is None and not self.is_unsharded
        out = original(self, *args, **kwargs)
        if pending and self._all_gather_result is not None:
            name = getattr(self, "_module_fqn", "?")
            counts[name] = counts.get(name, 0) + 1
        return out

    FSDPParamGroup.unshard = unshard


def _step(model, opt, x, y) -> float:
    """One training step on this rank's slice; returns the loss averaged over ranks."""
    import torch.distributed as dist

    loss = lm_loss(model, x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    aotdist.precompute_float8_scales(model)
    dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
    return loss.item()


def _train_configs(rank: int, world_size: int, names: list[str], ckpt_dir: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    gathers: dict[str, int] = {}
    _count_all_gathers(gathers)
    results = {}
    for name in names:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build_model("gpt", depth=DEPTH)
        aotdist.parallelize(model, config=CONFIGS[name])
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        gathers.clear()
        batches = list(_batches(world_size, model))
        with metrics.track(model) as first:
            losses = [_step(model, opt, batches[0][0][rank], batches[0][1][rank])]
        with metrics.track(model) as later:
            losses += [_step(model, opt, xs[rank], ys[rank]) for xs, ys in batches[1:]]
        sd = get_model_state_dict(model)
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in sd.items()}
        path = os.path.join(ckpt_dir, name)
        dcp.save(sd, checkpoint_id=path)
        # load into a freshly parallelized model with other weights, on the same ranks
        torch.manual_seed(123)
        other = build_model("gpt", depth=DEPTH)
        aotdist.parallelize(other, config=CONFIGS[name])
        other_sd = get_model_state_dict(other)
        dcp.load(other_sd, checkpoint_id=path)
        reloaded = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
                    for k, v in other_sd.items()}
        results[name] = {
            "losses": losses,
            "params": full if rank == 0 else None,
            "reload_exact": all(torch.equal(reloaded[k], full[k]) for k in full),
            "keys": list(sd),
            "first": first.to_dict(),
            "later_recompiles": later.recompiles,
            "later_frames": later.frames_compiled,
            "gathers": dict(gathers),
            "float8_layers": len(aotdist.parallelize_info(model).float8_fqns),
            "weight_type": type(model.blocks[0].mlp.fc.weight.to_local()).__name__,
        }
    return results


def _reference(config: dict, world_size: int):
    """Single process, eager, same model/seed/conversion, gradient accumulation over ranks."""
    return accumulated_reference(config, world_size=world_size, depth=DEPTH, steps=STEPS,
                                 batch_per_rank=BATCH_PER_RANK)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("dcp"))
    out = run_distributed(_train_configs, 2, list(CONFIGS), ckpt, timeout=540)
    return out, ckpt


def _tol(name: str) -> dict:
    # Float8 rounds to 3 mantissa bits: a last-bit difference in a reduction order can
    # move one element to the next float8 value; fp32 configs match much tighter.
    return {"rtol": 1e-3, "atol": 1e-4} if "float8" in name else {"rtol": 1e-4, "atol": 1e-5}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_single_process_eager(two_ranks, name):
    (rank0, rank1), _ = two_ranks
    ref_losses, ref_params, ref_keys = _reference(CONFIGS[name], 2)
    got = rank0[name]
    assert rank1[name]["losses"] == got["losses"]  # the averaged loss is the same everywhere
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), **_tol(name))
    assert got["keys"] == ref_keys
    moved = 0
    for key, ref in ref_params.items():
        torch.testing.assert_close(got["params"][key], ref, **_tol(name),
                                   msg=lambda m, k=key: f"{name}: {k} differs: {m}")
        moved += not torch.equal(ref, _initial_params()[key])
    assert moved == len(ref_params), "some parameters never trained: the test is vacuous"


_INITIAL: dict = {}


def _initial_params():
    if not _INITIAL:
        torch.manual_seed(0)
        _INITIAL.update(build_model("gpt", depth=DEPTH).state_dict())
    return _INITIAL


@pytest.mark.parametrize("name", [n for n in CONFIGS if "compile" in n])
def test_compiled_once_no_recompiles(two_ranks, name):
    (rank0, rank1), _ = two_ranks
    for res in (rank0[name], rank1[name]):
        first = res["first"]
        assert first["mode"] == "frames"
        region = first["regions"]["GPTBlock"]
        assert region["instances"] == DEPTH
        assert region["call_sites"] == DEPTH  # every block ran the compiled region
        assert region["subgraphs"] == 1  # ... compiled once for all of them
        assert res["later_recompiles"] == []  # storage resizes between steps: no guard fails
        assert res["later_frames"] == 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fsdp_all_gathers_per_region_instance(two_ranks, name):
    (rank0, _), _ = two_ranks
    gathers = rank0[name]["gathers"]
    reshard = CONFIGS[name]["fsdp"].get("reshard_after_forward", True)
    ac = CONFIGS[name].get("ac", {}).get("enabled", False)
    per_step = 2 if reshard else 1  # forward, and again in backward after a reshard
    for i in range(DEPTH):
        assert gathers.get(f"blocks.{i}") == STEPS * per_step, (gathers, ac)
    assert gathers.get("") == STEPS  # the root unit


def test_float8_weights_and_all_gather(two_ranks):
    (rank0, _), _ = two_ranks
    assert rank0["fsdp+float8+compile"]["float8_layers"] == 4 * DEPTH  # head excluded
    assert rank0["fsdp+float8+compile"]["weight_type"] == "Tensor"
    assert rank0["fsdp+float8ag+compile"]["weight_type"] == "WeightWithDynamicFloat8CastTensor"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dcp_round_trip(two_ranks, name):
    (rank0, rank1), ckpt = two_ranks
    assert rank0[name]["reload_exact"] and rank1[name]["reload_exact"]
    # and into a plain single-process eager model: same keys, same values
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(7)
    plain = build_model("gpt", depth=DEPTH)
    sd = plain.state_dict()
    assert list(sd) == rank0[name]["keys"]
    with warnings.catch_warnings():  # "no process group: loading in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=os.path.join(ckpt, name))
    plain.load_state_dict(sd)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, rank0[name]["params"][key]), key


HSDP = {**CONFIGS["fsdp+compile"], "fsdp": {"enabled": True, "replicate_degree": 2}}


def _four_ranks(rank: int, world_size: int):
    """FSDP over 4 ranks, HSDP 2x2 from the config and HSDP 2x2 from the user's mesh, in
    one spawn; then the configurations that must be refused."""
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for name, config, mesh in (
            ("fsdp", CONFIGS["fsdp+compile"], None),
            ("hsdp", HSDP, None),
            ("hsdp_mesh", CONFIGS["fsdp+compile"],
             init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard")))):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build_model("gpt", depth=DEPTH)
        aotdist.parallelize(model, config=config, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        with metrics.track(model) as m:
            losses = [_step(model, opt, xs[rank], ys[rank])
                      for xs, ys in _batches(world_size, model)]
        weight = model.blocks[0].mlp.fc.weight
        out[name] = {
            "losses": losses, "params": {k: v.full_tensor() for k, v in model.state_dict().items()},
            "placements": [type(p).__name__ for p in weight.placements],
            "mesh": tuple(weight.device_mesh.shape),
            "call_sites": m.regions["GPTBlock"].call_sites,
        }
    errors = {}
    for name, config, mesh in (
            ("indivisible", {**HSDP, "fsdp": {"enabled": True, "replicate_degree": 3}}, None),
            ("mesh_mismatch", HSDP, init_device_mesh("cpu", (4,))),
            ("unnamed_2d", CONFIGS["fsdp+compile"], init_device_mesh("cpu", (2, 2))),
            ("graph_2d", CONFIGS["fsdp+compile"] | {"fsdp": {"enabled": True, "mode": "graph"}},
             init_device_mesh("cpu", (2, 2)))):
        try:
            aotdist.parallelize(build_model("gpt", depth=DEPTH), config=config, mesh=mesh)
            errors[name] = None
        except aotdist.ConfigError as exc:
            errors[name] = str(exc)
    out["errors"] = errors
    return out


def test_four_ranks_fsdp_and_hsdp_match_eager():
    out = run_distributed(_four_ranks, 4, timeout=400)[0]
    ref_losses, ref_params, _ = _reference(CONFIGS["fsdp+compile"], 4)
    for name in ("fsdp", "hsdp", "hsdp_mesh"):
        torch.testing.assert_close(torch.tensor(out[name]["losses"]), torch.tensor(ref_losses),
                                   rtol=1e-4, atol=1e-5)
        for key, ref in ref_params.items():
            torch.testing.assert_close(out[name]["params"][key], ref, rtol=1e-4, atol=1e-5)
        assert out[name]["call_sites"] == DEPTH, out[name]
    assert out["fsdp"]["placements"] == ["Shard"] and out["fsdp"]["mesh"] == (4,)
    for name in ("hsdp", "hsdp_mesh"):  # replicated over 2 groups, sharded within each
        assert out[name]["placements"] == ["Replicate", "Shard"], out[name]["placements"]
        assert out[name]["mesh"] == (2, 2)
        for key, value in out["fsdp"]["params"].items():  # HSDP computes what FSDP does
            torch.testing.assert_close(out[name]["params"][key], value, rtol=1e-6, atol=1e-6)
    errors = out["errors"]
    assert "3 does not divide the world size 4" in errors["indivisible"], errors
    assert "Fix: a divisor of 4" in errors["indivisible"]
    assert "got a mesh of shape (4,)" in errors["mesh_mismatch"], errors
    assert "fsdp.mode: hooks" in errors["graph_2d"], errors
    assert "needs its dims named" in errors["unnamed_2d"], errors


def _ordering_errors(rank: int, world_size: int):
    from torch.distributed.fsdp import fully_shard

    errors = {}

    def attempt(key, fn):
        try:
            fn()
        except aotdist.AOTDistError as exc:
            errors[key] = (type(exc).__name__, str(exc))
        else:
            errors[key] = None

    fsdp = {"fsdp": {"enabled": True}, "compile": {"backend": "aot_eager"}}
    m = build_model("gpt", depth=2)
    aotdist.parallelize(m, config=fsdp)
    attempt("twice", lambda: aotdist.parallelize(m, config=fsdp))

    m = build_model("gpt", depth=2)
    fully_shard(m)
    attempt("fsdp2_then_parallelize", lambda: aotdist.parallelize(m, config=fsdp))


    # compile first, shard after: refused at the first call, before a silent eager run
    m = build_model("gpt", depth=2)
    aotdist.compile_regions(m, backend="aot_eager")
    for block in m.blocks:
        fully_shard(block)
    fully_shard(m)
    (x,), _ = example_inputs(m, 2)
    attempt("compile_then_shard", lambda: m(x))

    # the user's own sharding, compile only: allowed, regions compiled inside the units
    torch.manual_seed(0)
    m = build_model("gpt", depth=2)
    ref = copy.deepcopy(m)
    for block in m.blocks:
        fully_shard(block)
    fully_shard(m)
    aotdist.parallelize(m, config={"compile": {"backend": "aot_eager"}})
    with metrics.track(m) as t:
        out = m(x)
    errors["user_sharded_ok"] = torch.allclose(out, ref(x), atol=1e-5)
    errors["user_sharded_regions"] = t.to_dict()["regions"]["GPTBlock"]
    return errors


def test_wrong_orderings_are_refused():
    errors = run_distributed(_ordering_errors, 2, timeout=300)[0]
    assert errors["twice"][0] == "OrderingError" and "already applied" in errors["twice"][1]
    assert errors["fsdp2_then_parallelize"][0] == "OrderingError"
    assert "fully_shard was already applied" in errors["fsdp2_then_parallelize"][1]
    assert errors["compile_then_shard"][0] == "OrderingError"
    assert "after aotdist.compile_regions" in errors["compile_then_shard"][1]
    assert errors["user_sharded_ok"] is True
    assert errors["user_sharded_regions"]["call_sites"] == 2
    assert errors["user_sharded_regions"]["subgraphs"] == 1


def _rank_dies(rank: int, world_size: int):
    model = build_model("gpt", depth=2)
    aotdist.parallelize(model, config=CONFIGS["fsdp+compile"])
    if rank == 1:
        raise RuntimeError("rank 1 lost its data loader")
    (x,), y = example_inputs(model, 2)
    lm_loss(model, x, y).backward()  # rank 0 waits in FSDP's all-gather for rank 1


def test_a_dying_rank_stops_the_others():
    from aotdist.testing import DistributedTestError

    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_dies, 2, timeout=120)
    assert info.value.rank == 1
    assert "lost its data loader" in str(info.value)


def _inductor_everything(rank: int, world_size: int, config: dict):
    torch.manual_seed(0)
    model = build_model("gpt", depth=DEPTH)
    aotdist.parallelize(model, config=config)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with metrics.track(model) as t:
        losses = [_step(model, opt, xs[rank], ys[rank]) for xs, ys in _batches(world_size, model)]
    params = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return losses, params, t.to_dict()


@pytest.mark.inductor
def test_inductor_fsdp_float8_all_gather_ac():
    """The production stack: Inductor (C++ codegen on CPU), FSDP2, Float8 all-gather, AC.

    Tolerance: this stack drifts from eager Float8 by up to 1.46e-3 in parameters (loss
    7.7e-4) after 5 steps on the CI machine (Intel Xeon; torch 2.11 and 2.15 alike; cause
    not found, see ``aotdist.float8.warn_unverified_combination``), so parameters are
    checked at atol 2e-3 and parallelize must warn. A wrong block's weights or a wrong
    gradient (the failures this test exists for) are orders of magnitude larger.
    """
    config = {"fsdp": {"enabled": True}, "compile": {"backend": "inductor"},
              "float8": {**FLOAT8, "fsdp_all_gather": True}, "ac": {"enabled": True}}
    with pytest.warns(RegionCompileWarning, match="fsdp_all_gather"):
        warn_unverified_combination(as_config(config))
    (losses, params, m), _ = run_distributed(_inductor_everything, 2, config, timeout=540)
    ref_losses, ref_params, _ = _reference(config, 2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **_tol("float8"))
    for key, ref in ref_params.items():
        torch.testing.assert_close(params[key], ref, rtol=1e-3, atol=2e-3)
    assert m["backend_seconds"] > 0  # Inductor really compiled
    # one subgraph on torch 2.11 too (Float8's matmul trampolines: _compat.subgraphs)
    assert m["regions"]["GPTBlock"]["subgraphs"] == 1, m["regions"]
    assert m["recompiles"] == []
