"""``cache.mode: shared`` on 2 CPU ranks (gloo, FSDP2, Inductor).

One spawn runs three phases on the same two processes, each rank with an Inductor cache
directory of its own (as on separate nodes):

* cold: both ranks start without artifacts; rank 0 compiles each graph, rank 1 loads
  rank 0's artifacts of it instead of compiling (counted by Inductor's FX graph cache
  hits and misses); rank 0 saves the bundle after the first step;
* warm: a restart (new empty Inductor cache dirs, Dynamo and Inductor in-memory caches
  cleared, the model rebuilt): rank 0 reads the bundle and broadcasts it, no rank compiles;
* eager: the same training without compile, the parity reference.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import aotdist
from aotdist.testing import build_model, example_inputs, run_distributed

pytestmark = [pytest.mark.inductor, pytest.mark.slow]  # a 90 s spawn on 2 cores

STEPS = 2


def _train(rank: int, world_size: int, config: dict) -> dict:
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch._inductor.utils.clear_inductor_caches()
    counters.clear()
    torch.manual_seed(0)
    model = build_model("gpt", depth=2, dim=32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aotdist.parallelize(model, config)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        g = torch.Generator().manual_seed(1)
        losses, first = [], None
        for step in range(STEPS):
            (x,), y = example_inputs(model, 2 * world_size, generator=g)
            x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                aotdist.cache.save(model)
                first = {k: counters["inductor"][k] for k in
                         ("fxgraph_cache_hit", "fxgraph_cache_miss")}
            dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
            losses.append(loss.item())
    state = vars(model).get(aotdist.cache.STATE_ATTR)
    sharing = state["sharing"] if state else None
    return {"losses": losses, "first": first,
            "load": state["load"].status if state else "off",
            "shared_loaded": sharing.loaded if sharing else 0,
            "share_misses": sharing.misses if sharing else [],
            "warnings": [str(w.message) for w in caught
                         if issubclass(w.category, aotdist.cache.CacheWarning)]}


def _phases(rank: int, world_size: int, root: str) -> dict:
    fsdp = {"fsdp": {"enabled": True}}
    cache = {**fsdp, "compile": {"backend": "inductor"},
             "cache": {"mode": "shared", "dir": os.path.join(root, "bundle")}}
    out = {}
    for phase, config in (("cold", cache), ("warm", cache),
                          ("eager", {**fsdp, "compile": {"enabled": False}})):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, phase, f"rank{rank}")
        out[phase] = _train(rank, world_size, config)
    return out


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cache"))
    # skip_teardown: with torch 2.15, C++ teardown after Inductor compiled in a rank can
    # abort (SIGABRT) after the work succeeded; seen once in CI-like runs of these tests.
    return run_distributed(_phases, 2, root, timeout=600, skip_teardown=True)


def test_cold_run_rank1_loads_rank0_compiles(phases):
    rank0, rank1 = phases[0]["cold"], phases[1]["cold"]
    assert rank0["load"] == "missing" and rank1["load"] == "missing"
    assert rank0["first"]["fxgraph_cache_miss"] > 0  # rank 0 compiled
    assert rank1["first"]["fxgraph_cache_miss"] == 0, rank1  # rank 1 did not
    assert rank1["first"]["fxgraph_cache_hit"] == rank0["first"]["fxgraph_cache_miss"]
    assert rank1["shared_loaded"] == rank0["first"]["fxgraph_cache_miss"]
    assert rank1["share_misses"] == [] and rank1["warnings"] == []


def test_warm_restart_compiles_nothing(phases):
    for rank in (0, 1):
        warm = phases[rank]["warm"]
        assert warm["load"] == "loaded", warm
        assert warm["first"]["fxgraph_cache_miss"] == 0, (rank, warm)
        assert warm["first"]["fxgraph_cache_hit"] > 0
        assert warm["warnings"] == []


def test_cached_results_match_uncached(phases):
    cold, warm, eager = (phases[0][p]["losses"] for p in ("cold", "warm", "eager"))
    assert warm == cold  # the same kernels: bitwise
    torch.testing.assert_close(torch.tensor(cold), torch.tensor(eager), rtol=1e-4, atol=1e-5)
    assert phases[1]["cold"]["losses"] == cold  # all_reduced: every rank agrees
