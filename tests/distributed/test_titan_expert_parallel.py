"""torchtitan's own MoE under expert parallelism and aotdist's regions: Qwen 3 MoE from
torchtitan's model code (3 blocks, 8 experts top-2, random weights), each block's experts
sharded over 2 gloo ranks (4 each) and tokens exchanged by torchtitan's
``AllToAllTokenDispatcher`` (its split sizes read on the host), the rest replicated.

Under ``compile_regions`` (the test averages the replicated gradients) and under
``aotdist.parallelize`` with FSDP over the rest (``fsdp.expert_params``; FSDP2's hooks
and graph-mode FSDP). Compared over 3 SGD steps with the same ranks run eagerly and with
one process holding every expert (torchtitan's experts compute in bfloat16, and a rank's
tokens share each grouped matmul with other rows: equal within bfloat16's rounding). Each
block is one subgraph reused by its 3 call sites. torchtitan's model code needs torch 2.12
or newer.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import aotdist
from aotdist.check.families_titan import titan_family, titan_unavailable
from aotdist.testing import run_distributed

if titan_unavailable("qwen3_moe"):
    pytest.skip(titan_unavailable("qwen3_moe"), allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS, LR, RANKS = 3, 0.1, 2
EXPERTS = ("w1_EFD", "w2_EDF", "w3_EFD")  # torchtitan's GroupedExperts weights


def _model() -> nn.Module:
    model, _ = titan_family("qwen3_moe").build(0)  # the same weights on every rank
    return model


def _shard_experts(model: nn.Module, rank: int, ranks: int) -> None:
    """What torchtitan's expert parallelism does to each MoE block, on plain tensors: this
    rank keeps its slice of every expert weight, and the dispatcher sends tokens over the
    ``ep`` mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("ep",))
    for layer in model.layers.values():
        inner = layer.moe.routed_experts.inner_experts
        local = inner.num_experts // ranks
        for name in EXPERTS:
            full = getattr(inner, name).detach()
            setattr(inner, name, nn.Parameter(full[rank * local : (rank + 1) * local].clone()))
        layer.moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(
        0, 2048, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank)
    )


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from aotdist.check.families_titan import _next_token_loss

    return _next_token_loss(model(ids))


FSDP_EP = {
    "compile": {"backend": "aot_eager"},
    "fsdp": {"enabled": True, "expert_params": ["layers.*.moe.routed_experts.inner_experts.*"]},
}
GRAPH_EP = {**FSDP_EP, "fsdp": {**FSDP_EP["fsdp"], "mode": "graph"}}


def _train(rank: int, world_size: int, compiled: bool | str) -> dict:
    """``compiled``: ``False`` eager, ``True`` ``compile_regions``, ``"fsdp"``
    ``aotdist.parallelize`` with FSDP2 over the rest and the experts per rank
    (``fsdp.expert_params``), ``"graph"`` the same with graph-mode FSDP: no gradient
    arithmetic of the test's."""
    import torch.distributed as dist
    from torchtitan.distributed import utils as titan_utils

    # torchtitan's parallelism.spmd_backend: its default (spmd_types) reads a mesh that
    # only torchtitan's own parallelize sets
    titan_utils.set_spmd_backend("partial_dtensor")
    torch._dynamo.reset()
    model = _model()
    _shard_experts(model, rank, world_size)
    if compiled in ("fsdp", "graph"):
        aotdist.parallelize(model, config=FSDP_EP if compiled == "fsdp" else GRAPH_EP)
    elif compiled:
        aotdist.compile_regions(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    with warnings.catch_warnings(record=True) as caught, aotdist.metrics.track(model) as m:
        warnings.simplefilter("always")
        for step in range(STEPS):
            opt.zero_grad()
            loss = _loss(model, _batch(rank, step))
            loss.backward()
            for name, p in model.named_parameters() if compiled in (False, True) else ():
                if name.rpartition(".")[2] in EXPERTS:  # every rank's tokens: the sum
                    p.grad /= world_size
                else:  # replicated: averaged, as data parallelism does
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            opt.step()
            losses.append(float(loss))
    return {
        "losses": losses,
        "params": {
            k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
            for k, v in model.named_parameters()
        },
        "plain": sorted(k for k, v in model.named_parameters() if not hasattr(v, "full_tensor")),
        "regions": {n: (r.call_sites, r.subgraphs) for n, r in m.regions.items()},
        "warnings": [
            str(w.message) for w in caught if issubclass(w.category, aotdist.RegionCompileWarning)
        ],
    }


def _both(rank: int, world_size: int) -> dict:
    return {how: _train(rank, world_size, how) for how in (False, True, "fsdp", "graph")}


def _unsharded() -> tuple[list[list[float]], dict]:
    """One process holding every expert: each step the mean of both ranks' losses."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        parts = [_loss(model, _batch(rank, step)) for rank in range(RANKS)]
        (sum(parts) / RANKS).backward()
        opt.step()
        losses.append([float(p) for p in parts])
    return losses, {k: v.detach() for k, v in model.named_parameters()}


def _slice(name: str, value: torch.Tensor, rank: int) -> torch.Tensor:
    if name.rpartition(".")[2] not in EXPERTS:
        return value
    local = value.shape[0] // RANKS
    return value[rank * local : (rank + 1) * local]


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_both, RANKS, timeout=240.0)


@pytest.fixture(scope="module")
def unsharded():
    return _unsharded()


@pytest.mark.parametrize(
    "how", [True, "fsdp", "graph"], ids=["compile_regions", "parallelize_fsdp", "graph_fsdp"]
)
def test_torchtitan_s_moe_block_is_one_reused_subgraph_under_expert_parallelism(runs, how):
    for rank, run in enumerate(runs):
        result = run[how]
        assert result["regions"] == {"Qwen3TransformerBlock": (3, 1)}, (rank, result)
        demoted = [w for w in result["warnings"] if "cannot be a reusable subgraph" in w]
        assert demoted == [], demoted  # torch's PendingUnbackedSymbolNotFound, before the fix
        if how is not True:  # FSDP shards the rest; each rank keeps its experts whole
            inner = "moe.routed_experts.inner_experts"
            experts = [f"layers.{i}.{inner}.{w}" for i in range(3) for w in EXPERTS]
            assert result["plain"] == sorted(experts), result["plain"]


@pytest.mark.parametrize(
    "how", [True, "fsdp", "graph"], ids=["compile_regions", "parallelize_fsdp", "graph_fsdp"]
)
def test_torchtitan_s_sharded_experts_train_as_the_same_ranks_eagerly(runs, how):
    for rank, run in enumerate(runs):
        eager, compiled = run[False], run[how]
        torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]))
        for key, value in compiled["params"].items():
            torch.testing.assert_close(value, eager["params"][key], msg=f"rank {rank}: {key}")


@pytest.mark.parametrize(
    "how", [True, "fsdp", "graph"], ids=["compile_regions", "parallelize_fsdp", "graph_fsdp"]
)
def test_torchtitan_s_sharded_experts_train_as_one_process_holding_them_all(runs, unsharded, how):
    losses, params = unsharded
    bf16 = {"rtol": 1e-4, "atol": 2e-4}  # the experts' bfloat16 grouped matmuls
    for rank, run in enumerate(runs):
        result = run[how]
        want = torch.tensor([s[rank] for s in losses])
        torch.testing.assert_close(torch.tensor(result["losses"]), want, **bf16)
        assert result["losses"][0] == pytest.approx(losses[0][rank], abs=1e-5)  # same weights
        for key, value in result["params"].items():
            torch.testing.assert_close(
                value, _slice(key, params[key], rank), msg=f"rank {rank}: {key}", **bf16
            )
