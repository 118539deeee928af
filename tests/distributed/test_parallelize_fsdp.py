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
    accumulate_grads,
    accumulated_reference,
    build_model,
    example_inputs,
    lm_loss,
    rank_batches,
    rank_step,
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
        "compile": {"backend": "aot_eager"},
        "ac": {"enabled": True},
    },
    "fsdp+float8+compile": {
        "fsdp": {"enabled": True},
        "compile": {"backend": "aot_eager"},
        "float8": FLOAT8,
    },
    "fsdp+float8ag+compile": {
        "fsdp": {"enabled": True},
        "compile": {"backend": "aot_eager"},
        "float8": {**FLOAT8, "fsdp_all_gather": True},
    },
}


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
        batches = list(
            rank_batches(model, world_size=world_size, steps=STEPS, batch_per_rank=BATCH_PER_RANK)
        )
        with metrics.track(model) as first:
            losses = [rank_step(model, opt, batches[0][0][rank], batches[0][1][rank])]
        with metrics.track(model) as later:
            losses += [rank_step(model, opt, xs[rank], ys[rank]) for xs, ys in batches[1:]]
        sd = get_model_state_dict(model)
        full = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in sd.items()
        }
        path = os.path.join(ckpt_dir, name)
        dcp.save(sd, checkpoint_id=path)
        # load into a freshly parallelized model with other weights, on the same ranks
        torch.manual_seed(123)
        other = build_model("gpt", depth=DEPTH)
        aotdist.parallelize(other, config=CONFIGS[name])
        other_sd = get_model_state_dict(other)
        dcp.load(other_sd, checkpoint_id=path)
        reloaded = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in other_sd.items()
        }
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
    return accumulated_reference(
        config, world_size=world_size, depth=DEPTH, steps=STEPS, batch_per_rank=BATCH_PER_RANK
    )


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
        torch.testing.assert_close(
            got["params"][key], ref, **_tol(name), msg=lambda m, k=key: f"{name}: {k} differs: {m}"
        )
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
GRAPH = {"fsdp": {"enabled": True, "mode": "graph"}, "compile": {"backend": "aot_eager"}}
GRAPH_HSDP = {**GRAPH, "fsdp": {**GRAPH["fsdp"], "replicate_degree": 2}}
ADAMW_STEPS = 3
# name: (config, the user's mesh: None, or its dim names (None: unnamed)), on 4 ranks
FOUR_RANK_RUNS = {
    "fsdp": (CONFIGS["fsdp+compile"], None),
    "hsdp": (HSDP, None),
    "hsdp_mesh": (CONFIGS["fsdp+compile"], ("dp_replicate", "dp_shard")),
    "graph_fsdp": (GRAPH, None),
    "graph_hsdp": (GRAPH_HSDP, None),
    "graph_hsdp_mesh": (GRAPH, (None, None)),
}


class _Collectives:
    """Records, per graph graph-mode FSDP compiles (and per region subgraph), its functional
    collectives as ``(kind, group name)`` and its ``invoke_subgraph`` calls, before bucketing."""

    def __enter__(self):
        from aotdist.backends import bucketing

        self.mod, self.orig, self.graphs = bucketing, bucketing.bucket_collectives, {}

        def wrapped(gm, bucket_mb, *, recurse=True):
            for m in [gm, *(bucketing._subgraphs(gm) if recurse else [])]:
                self.graphs.setdefault(id(m), self._describe(m))
            return self.orig(gm, bucket_mb, recurse=recurse)

        bucketing.bucket_collectives = wrapped
        return self

    @staticmethod
    def _describe(gm) -> dict:
        out = {"collectives": [], "invokes": 0}
        for node in gm.graph.nodes:
            name = str(node.target) if node.op == "call_function" else ""
            if name == str(torch.ops.higher_order.invoke_subgraph):
                out["invokes"] += 1
            elif "_c10d_functional." in name and "wait_tensor" not in name:
                kind = name.split("_c10d_functional.", 1)[1].split(".")[0]
                out["collectives"].append((kind, str(node.args[-1])))
        return out

    def __exit__(self, *exc):
        self.mod.bucket_collectives = self.orig


def _four_ranks(rank: int, world_size: int, ckpt_dir: str):
    """FSDP 1x4 and HSDP 2x2 (from the config, and from the user's mesh), in hooks and in
    graph mode, 3 AdamW steps each, in one spawn; an HSDP checkpoint loaded under FSDP 1x4;
    then the configurations that must be refused."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    for name, (config, dims) in FOUR_RANK_RUNS.items():
        torch._dynamo.reset()
        torch.manual_seed(0)
        mesh = (
            None
            if dims is None
            else init_device_mesh("cpu", (2, 2), mesh_dim_names=None if dims[0] is None else dims)
        )
        model = build_model("gpt", depth=DEPTH)
        aotdist.parallelize(model, config=config, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, grads = [], []
        with metrics.track(model) as m, _Collectives() as coll:
            for xs, ys in rank_batches(model, world_size=world_size, steps=ADAMW_STEPS):
                loss = lm_loss(model, xs[rank], ys[rank])
                loss.backward()
                grads.append({k: p.grad.full_tensor() for k, p in model.named_parameters()})
                opt.step()
                opt.zero_grad()
                dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
                losses.append(loss.item())
        weight = model.blocks[0].mlp.fc.weight
        used = aotdist.parallelize_info(model).mesh
        out[name] = {
            "losses": losses,
            "grads": grads,
            "params": {k: v.full_tensor() for k, v in model.state_dict().items()},
            "placements": [type(p).__name__ for p in weight.placements],
            "mesh": tuple(weight.device_mesh.shape),
            "call_sites": m.regions["GPTBlock"].call_sites,
            "subgraphs": m.regions["GPTBlock"].subgraphs,
            "recompiles": m.recompiles,
            "graphs": list(coll.graphs.values()),
            "groups": (
                {"shard": used.get_group(1).group_name, "replicate": used.get_group(0).group_name}
                if used.ndim == 2
                else {"shard": used.get_group().group_name}
            ),
        }
        if name in ("hsdp", "graph_hsdp"):
            dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(ckpt_dir, name))
    for name in ("hsdp", "graph_hsdp"):  # HSDP 2x2 checkpoints, loaded under FSDP 1x4
        torch.manual_seed(123)
        other = build_model("gpt", depth=DEPTH)
        aotdist.parallelize(other, config=CONFIGS["fsdp+compile"])
        sd = get_model_state_dict(other)
        dcp.load(sd, checkpoint_id=os.path.join(ckpt_dir, name))
        out[f"{name}_into_fsdp"] = {k: v.full_tensor() for k, v in sd.items()}
    errors = {}
    for name, config, mesh in (
        ("indivisible", {**HSDP, "fsdp": {"enabled": True, "replicate_degree": 3}}, None),
        ("mesh_mismatch", HSDP, init_device_mesh("cpu", (4,))),
        ("unnamed_2d", CONFIGS["fsdp+compile"], init_device_mesh("cpu", (2, 2))),
        ("3d", CONFIGS["fsdp+compile"], init_device_mesh("cpu", (1, 2, 2))),
    ):
        try:
            aotdist.parallelize(build_model("gpt", depth=DEPTH), config=config, mesh=mesh)
            errors[name] = None
        except aotdist.ConfigError as exc:
            errors[name] = str(exc)
    out["errors"] = errors
    return out


def _adamw_reference(world_size: int):
    """Single-process eager: the same model, AdamW, gradients accumulated over the slices."""
    torch.manual_seed(0)
    model = build_model("gpt", depth=DEPTH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for xs, ys in rank_batches(model, world_size=world_size, steps=ADAMW_STEPS):
        losses.append(accumulate_grads(model, list(zip(xs, ys, strict=True))))
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads, {k: v.detach() for k, v in model.state_dict().items()}


def _assert_same_run(got: dict, want_losses, want_grads, *, atol: float, what: str) -> None:
    torch.testing.assert_close(
        torch.tensor(got["losses"]),
        torch.tensor(want_losses),
        rtol=0,
        atol=atol,
        msg=lambda m: f"{what} losses: {m}",
    )
    for step, (g, w) in enumerate(zip(got["grads"], want_grads, strict=True)):
        for key, ref in w.items():
            torch.testing.assert_close(
                g[key],
                ref,
                rtol=0,
                atol=atol,
                msg=lambda m, k=key, s=step: f"{what} {k} step {s}: {m}",
            )


def test_four_ranks_fsdp_and_hsdp_in_both_modes_match_eager(tmp_path):
    out = run_distributed(_four_ranks, 4, str(tmp_path), timeout=560)[0]
    ref_losses, ref_grads, ref_params = _adamw_reference(4)
    for name in FOUR_RANK_RUNS:
        run = out[name]
        assert run["losses"][0] == pytest.approx(ref_losses[0], abs=1e-6), name  # step 1
        _assert_same_run(run, ref_losses, ref_grads, atol=1e-6, what=f"{name} vs eager")
        # AdamW divides each update by the gradient's running size: where a gradient is
        # ~1e-7 (its rounding), equal-within-1e-6 gradients move a parameter by up to lr
        for key, ref in ref_params.items():
            torch.testing.assert_close(run["params"][key], ref, rtol=0, atol=1e-3)
        assert (run["call_sites"], run["subgraphs"], run["recompiles"]) == (DEPTH, 1, []), run
    for flat, hsdp in (
        ("fsdp", "hsdp"),
        ("fsdp", "hsdp_mesh"),
        ("graph_fsdp", "graph_hsdp"),
        ("graph_fsdp", "graph_hsdp_mesh"),
    ):  # HSDP computes what FSDP does
        _assert_same_run(
            out[hsdp], out[flat]["losses"], out[flat]["grads"], atol=1e-6, what=f"{hsdp} vs {flat}"
        )
        assert out[hsdp]["placements"] == ["Replicate", "Shard"], out[hsdp]["placements"]
        assert out[hsdp]["mesh"] == (2, 2)
    assert out["fsdp"]["placements"] == out["graph_fsdp"]["placements"] == ["Shard"]
    assert out["fsdp"]["mesh"] == out["graph_fsdp"]["mesh"] == (4,)

    # graph mode: the collectives are in the graphs, over the right groups; one
    # invoke_subgraph per block call in the forward graph
    for name in ("graph_fsdp", "graph_hsdp", "graph_hsdp_mesh"):
        groups, graphs = out[name]["groups"], out[name]["graphs"]
        seen = {c for g in graphs for c in g["collectives"]}
        want = {
            ("all_gather_into_tensor", groups["shard"]),
            ("reduce_scatter_tensor", groups["shard"]),
        }
        if "replicate" in groups:
            want.add(("all_reduce", groups["replicate"]))
        assert seen == want, (name, seen, groups)
        assert max(g["invokes"] for g in graphs) == DEPTH, (name, graphs)

    for name in ("hsdp", "graph_hsdp"):  # HSDP 2x2 checkpoint -> FSDP 1x4 -> one process
        import torch.distributed.checkpoint as dcp

        for key, value in out[name]["params"].items():
            assert torch.equal(out[f"{name}_into_fsdp"][key], value), (name, key)
        torch.manual_seed(7)
        plain = build_model("gpt", depth=DEPTH)
        sd = plain.state_dict()
        with warnings.catch_warnings():  # "no process group: loading in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(sd, checkpoint_id=str(tmp_path / name))
        for key, value in sd.items():
            assert torch.equal(value, out[name]["params"][key]), (name, key)

    errors = out["errors"]
    assert "3 does not divide the world size 4" in errors["indivisible"], errors
    assert "Fix: a divisor of 4" in errors["indivisible"]
    assert "got a mesh of shape (4,)" in errors["mesh_mismatch"], errors
    assert "needs its dims named" in errors["unnamed_2d"], errors
    assert "got the 3-D mesh" in errors["3d"] and "Fix:" in errors["3d"], errors


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
        batches = rank_batches(
            model, world_size=world_size, steps=STEPS, batch_per_rank=BATCH_PER_RANK
        )
        losses = [rank_step(model, opt, xs[rank], ys[rank]) for xs, ys in batches]
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
    config = {
        "fsdp": {"enabled": True},
        "compile": {"backend": "inductor"},
        "float8": {**FLOAT8, "fsdp_all_gather": True},
        "ac": {"enabled": True},
    }
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


class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class _Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.inner = _Inner()

    def forward(self, x):
        return self.inner(self.norm(x))


class _Nested(torch.nn.Module):
    """A region inside another (Siglip's MLP in its encoder layer, and once in its head)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Outer() for _ in range(3)])
        self.head = _Inner()

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _nested_regions(rank: int, world_size: int):
    torch.manual_seed(0)
    model = _Nested()
    eager = copy.deepcopy(model)
    plan = aotdist.find_regions(model)
    aotdist.parallelize(
        model, config={"fsdp": {"enabled": True}, "compile": {"backend": "aot_eager"}}
    )
    x = torch.randn(4, 8)
    with metrics.track(model) as m:
        loss = model(x).square().mean()
        loss.backward()
    want = eager(x).square().mean()
    return [r.name for r in plan], loss.item(), want.item(), m.summary()


def test_a_region_nested_in_another_is_sharded_before_its_parent():
    # fully_shard on the outer region first took the inner one's parameters as DTensors,
    # and the inner's fully_shard then failed ("value was None when it should not be")
    names, got, want, summary = run_distributed(_nested_regions, 2, timeout=300)[0]
    assert {"_Outer", "_Inner"} <= set(names), names
    assert got == pytest.approx(want, rel=1e-6), summary
