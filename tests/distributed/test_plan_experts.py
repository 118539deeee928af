"""``aotdist plan`` of an expert-parallel job (``fsdp.expert_params``) against what runs:
the same MoE model, config and world simulated at 2 ranks and run for real on 2 gloo
ranks, with routing that is balanced for real (the plan's assumption): a rank's parameter
bytes (its own experts whole, the rest sharded), the all-to-alls forward and backward
(count and bytes) and FSDP2's collectives equal, the saved activations within 5%. And a
64-rank plan whose figures follow from the model's sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aotdist.testing import run_distributed
from aotdist.testing.moe import MoENet

DEPTH, DIM, HIDDEN, EXPERTS, TOP_K, VOCAB = 3, 16, 32, 4, 2, 64
EXPERT_PARAMS = ["blocks.*.gate_up", "blocks.*.down"]
CONFIG = {"fsdp": {"mode": "hooks", "expert_params": EXPERT_PARAMS}}


def _build(imbalance: float = 1.0):
    """``imbalance`` > 1: rank 0's experts get that many times the mean tokens, for real
    (the router's bonus) as in the plan (``expert_imbalance``)."""
    torch.manual_seed(0)
    model = MoENet(DEPTH, DIM, HIDDEN, EXPERTS, TOP_K, VOCAB, balanced=True, imbalance=imbalance)
    return model, (torch.randint(0, VOCAB, (2, 8)),)


class _Counted:
    """The collectives a rank issues as they run, by kind, mesh dimension and (for the
    all-to-alls) phase: count and bytes (a gather's output, a reduce-scatter's input, an
    all-to-all's input)."""

    KINDS = {"allgather": "all_gather", "reducescatter": "reduce_scatter"}
    KINDS |= {"allreduce": "all_reduce", "alltoall": "all_to_all"}

    def __init__(self, names: dict[str, str]):
        from torch.utils._python_dispatch import TorchDispatchMode

        counted = self.counted = {}
        self.phase = "forward"
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch.distributed as dist

                space, _, op = func.name().partition("::")
                kind = next((v for k, v in outer.KINDS.items() if k in op.replace("_", "")), None)
                if space in ("c10d", "_c10d_functional") and kind is not None:
                    leaves = torch.utils._pytree.tree_leaves(args)
                    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
                    if kind == "all_to_all":  # the input: (output, input, ...) or (input, ...)
                        sent = tensors[1] if space == "c10d" else tensors[0]
                        nbytes = sent.numel() * sent.element_size()
                    else:
                        nbytes = max(t.numel() * t.element_size() for t in tensors)
                    if space == "_c10d_functional":  # (..., group_name): the last string
                        name = [a for a in leaves if isinstance(a, str)][-1]
                    else:
                        name = next(
                            dist.ProcessGroup.unbox(a) if isinstance(a, torch.ScriptObject) else a
                            for a in leaves
                            if isinstance(a, (torch.ScriptObject, dist.ProcessGroup))
                        ).group_name
                    phase = outer.phase if kind == "all_to_all" else ""
                    key = (kind, names[name], phase)
                    n, b = counted.get(key, (0, 0))
                    counted[key] = (n + 1, b + nbytes)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


def _real(rank: int, world_size: int, imbalance: float = 1.0, mode: str = "hooks") -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import aotdist
    from aotdist.backends.bucketing import graphs_observed
    from aotdist.bench.saved import SavedBytes
    from aotdist.simulate import Plan, _memory
    from aotdist.testing.distributed import count_collectives_as_run

    config = {**CONFIG, "compile": {"backend": "aot_eager"}}
    config["fsdp"] = {**config["fsdp"], "enabled": True, "mode": mode}
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    model, (x,) = _build(imbalance)
    aotdist.parallelize(model, config=config, mesh=mesh)
    out = Plan(
        world=world_size, mesh=(2,), mesh_dims=("dp_shard",), fsdp_mode=mode, optimizer="adamw"
    )
    _memory(out, model, "adamw")
    names = {mesh.get_group("dp_shard").group_name: "dp_shard"}
    names[torch.distributed.group.WORLD.group_name] = "dp_shard"
    in_graphs: dict = {}  # graph mode: FSDP's collectives, counted as the graphs run them
    with graphs_observed(lambda gm: count_collectives_as_run(gm, names, in_graphs)):
        model(x).float().mean().backward()  # the compile
    in_graphs.clear()  # the steady step's
    with SavedBytes(exclude=[*model.parameters(), *model.buffers()]) as saved:
        loss = model(x).float().mean()
    loss.backward()
    # counted as they run, in an eager step of the same sharding (a dispatch mode around
    # a compiled step would make Dynamo skip it): hooks mode's, and every all-to-all
    eager, _ = _build(imbalance)
    aotdist.parallelize(eager, config={**config, "compile": {"enabled": False}}, mesh=mesh)
    counter = _Counted(names)
    with counter.mode:
        loss = eager(x).float().mean()
        counter.phase = "backward"
        loss.backward()
    if mode == "graph":  # FSDP's from the compiled graphs, the all-to-alls from the eager
        counter.counted = {k: v for k, v in counter.counted.items() if k[0] == "all_to_all"}
        counter.counted |= {(kind, dim, ""): nb for (kind, dim), nb in in_graphs.items()}
    experts = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if "blocks" in n and not hasattr(p, "to_local")
    )
    return {
        "params": out.param_bytes,
        "experts": experts,
        "saved": saved.activation_bytes,
        "collectives": sorted((k, d, ph, n, b) for (k, d, ph), (n, b) in counter.counted.items()),
    }


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hooks", "graph"])
def test_the_expert_parallel_plan_is_what_the_ranks_run(mode):
    """FSDP2's hooks and graph-mode FSDP (its collectives counted in the compiled graphs)."""
    from aotdist.simulate import plan

    config = {"fsdp": {**CONFIG["fsdp"], "mode": mode}}
    simulated = plan(_build, world=2, mesh=(2,), config=config)
    real = run_distributed(_real, 2, 1.0, mode, timeout=300)
    planned = sorted(
        (c.kind, c.dim, c.phase, c.count, c.bytes)
        for c in (*simulated.collectives, *simulated.all_to_all)
    )
    for rank, ran in enumerate(real):
        assert simulated.param_bytes == ran["params"], rank
        assert simulated.expert_param_bytes == ran["experts"], rank
        assert planned == ran["collectives"], rank
        assert simulated.activation_bytes == pytest.approx(ran["saved"], rel=0.05), (
            simulated.activation_bytes,
            ran["saved"],
        )
    assert "balanced routing" in simulated.routing
    assert "balanced routing" in simulated.table()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_imbalanced_plan_is_what_the_hottest_rank_runs():
    """A router biased so that rank 0's experts get 1.5x the mean tokens (24 of each
    rank's 32 choices), for real on 2 gloo ranks and in the plan (``expert_imbalance``):
    the plan is the hottest rank's, its all-to-alls (count and bytes) and FSDP2's
    collectives equal, its saved activations within 5%; the balanced plan is not it."""
    from aotdist.simulate import plan

    factor = 1.5
    simulated = plan(
        lambda: _build(factor), world=2, mesh=(2,), config=CONFIG, expert_imbalance=factor
    )
    balanced = plan(_build, world=2, mesh=(2,), config=CONFIG)
    hot, cold = run_distributed(_real, 2, factor, timeout=240)
    planned = sorted(
        (c.kind, c.dim, c.phase, c.count, c.bytes)
        for c in (*simulated.collectives, *simulated.all_to_all)
    )
    assert planned == hot["collectives"]
    assert simulated.param_bytes == hot["params"] and simulated.expert_param_bytes == hot["experts"]
    assert simulated.activation_bytes == pytest.approx(hot["saved"], rel=0.05), (
        simulated.activation_bytes,
        hot["saved"],
    )
    a2a = {c.phase: c.bytes for c in simulated.all_to_all}
    even = {c.phase: c.bytes for c in balanced.all_to_all}
    cold_a2a = {ph: b for k, _, ph, _, b in cold["collectives"] if k == "all_to_all"}
    for phase in ("forward", "backward"):  # the hot rank sends back its 1.5x tokens' rows
        assert a2a[phase] > even[phase] > cold_a2a[phase], (phase, a2a, even, cold_a2a)
    assert simulated.activation_bytes > balanced.activation_bytes
    assert "1.5x the mean tokens" in simulated.routing and "1.5x" in simulated.table()


def test_an_imbalance_outside_the_world_or_without_experts_is_refused_with_the_fix():
    from aotdist.errors import ConfigError
    from aotdist.simulate import plan

    with pytest.raises(ConfigError, match="outside 1 to 2") as err:
        plan(_build, world=2, config=CONFIG, expert_imbalance=3.0)
    assert "Fix: --expert-imbalance between 1 and 2" in str(err.value)
    with pytest.raises(ConfigError, match="without expert parallelism") as err:
        plan(_build, world=2, config={"fsdp": {"mode": "hooks"}}, expert_imbalance=2.0)
    assert "--expert-params" in str(err.value)


def test_the_planned_choice_gives_rank_0_its_share():
    from aotdist.testing.moe import planned_choice

    even = planned_choice(16, 2, 4, ranks=2)
    assert torch.bincount(even.flatten(), minlength=4).tolist() == [8, 8, 8, 8]
    skewed = planned_choice(16, 2, 4, ranks=2, imbalance=1.5)
    assert torch.bincount(skewed.flatten(), minlength=4).tolist() == [12, 12, 4, 4]
    assert all(len(set(row.tolist())) == 2 for row in skewed)  # a token's choices differ
    top = planned_choice(64, 8, 256, ranks=64, imbalance=4.0)  # DeepSeek-V3 at 64 ranks
    assert (top < 4).sum() == 4 * 64 * 8 // 64  # rank 0's 4 experts: 4x the mean


def test_at_64_ranks_a_rank_holds_its_experts_and_sends_its_tokens_to_every_rank():
    """64 experts over 64 ranks (one each), top-2 of them per token: a rank holds 1/64 of
    the experts whole and 1/64 of the rest (FSDP2's shards); per MoE block its
    forward sends the counts (64 int64s) and, twice, its tokens' rows (top-2 copies of
    each); the backward sends the rows twice; only the rest's weights are gathered."""
    from aotdist.simulate import plan

    experts, ranks, batch, seq = 64, 64, 2, 16  # 64 rows: one per expert

    def build():
        torch.manual_seed(0)
        model = MoENet(DEPTH, DIM, HIDDEN, experts, TOP_K, VOCAB)
        return model, (torch.randint(0, VOCAB, (batch, seq)),)

    out = plan(build, world=ranks, config=CONFIG)
    expert_elems = DEPTH * experts * 3 * DIM * HIDDEN  # gate_up and down, every block
    assert out.expert_param_bytes == 4 * expert_elems // ranks
    rest = VOCAB * DIM + DEPTH * DIM * experts + DIM * VOCAB + VOCAB  # embed, routers, head
    assert out.param_bytes - out.expert_param_bytes == pytest.approx(4 * rest / ranks, rel=0.05)
    rows = batch * seq * TOP_K * DIM * 4  # the rows a rank sends in one token all-to-all
    counts = experts * 8
    a2a = {c.phase: (c.count, c.bytes, c.dim, c.network) for c in out.all_to_all}
    assert a2a["forward"] == (3 * DEPTH, DEPTH * (counts + 2 * rows), "dp_shard", True)
    assert a2a["backward"] == (2 * DEPTH, DEPTH * 2 * rows, "dp_shard", True)
    gathered = next(c for c in out.collectives if c.kind == "all_gather")
    assert gathered.bytes < 4 * rest * 2.2  # the rest's weights, never the experts
    assert out.regions["MoE"] == {"call_sites": DEPTH, "subgraphs": 1}
    assert "balanced routing" in out.table()


def test_a_plan_of_an_expert_parallel_job_reads_what_the_routing_cannot_tell_with_the_fix():
    """A value computed from the weights, read on the host: named, not guessed."""
    from aotdist.errors import ConfigError
    from aotdist.simulate import plan

    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up = nn.Parameter(torch.ones(4, 4))

        def forward(self, x):
            n = int((x @ self.gate_up).sum().item() > 0)  # from the data, not the routing
            return x * (n + 1)

    config = {"fsdp": {"mode": "hooks", "expert_params": ["gate_up"]}}
    with pytest.raises(ConfigError, match="reads a tensor's value on the host"):
        plan(lambda: (Reads(), (torch.randn(2, 4),)), world=2, config=config)


def test_experts_that_every_rank_holds_whole_are_refused_with_the_fix():
    """A MoE that computes every expert on each rank (no all-to-all, as transformers'
    do): leaving its experts unsharded is no expert parallelism."""
    from aotdist.errors import ConfigError
    from aotdist.simulate import plan
    from aotdist.testing.moe import MoE

    def build():
        blocks = (MoE(DIM, HIDDEN, EXPERTS, TOP_K, ranks=1) for _ in range(2))
        return nn.Sequential(*blocks), (torch.randn(2, 8, DIM),)

    config = {"fsdp": {"mode": "hooks", "expert_params": ["*.gate_up", "*.down"]}}
    with pytest.raises(ConfigError, match="sends no all-to-all") as err:
        plan(build, world=2, config=config)
    assert "Fix" in str(err.value)


def test_the_command_plans_expert_parallelism_and_refuses_it_for_a_transformers_moe(
    tmp_path, monkeypatch, capsys
):
    import json

    from aotdist.cli import main

    (tmp_path / "ep_model.py").write_text(
        "import torch\n"
        "from aotdist.testing.moe import MoENet\n\n"
        "def build():\n"
        "    return MoENet(2, 16, 32, 16, 2, 64), (torch.randint(0, 64, (1, 16)),)\n"
    )
    monkeypatch.chdir(tmp_path)
    argv = ["plan", "--model", "ep_model:build", "--world", "16", "--gpus-per-node", "8"]
    argv += ["--expert-params", "blocks.*.gate_up", "--expert-params", "blocks.*.down"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "balanced routing" in out["routing"]
    assert out["expert_param_bytes"] == 2 * 3 * 16 * 32 * 4  # 2 blocks, 1 of 16 experts each
    assert {(c["phase"], c["network"]) for c in out["all_to_all"]} == {
        ("forward", True),
        ("backward", True),
    }
    assert main(argv) == 0
    assert "all-to-all per step, assuming balanced routing" in capsys.readouterr().out
    assert main([*argv, "--expert-imbalance", "4", "--json"]) == 0
    skewed = json.loads(capsys.readouterr().out)
    assert "receives 4x the mean tokens" in skewed["routing"]
    a2a = {c["phase"]: c["bytes"] for c in skewed["all_to_all"]}
    assert a2a["forward"] > {c["phase"]: c["bytes"] for c in out["all_to_all"]}["forward"]
    assert main([*argv, "--expert-imbalance", "17"]) == 2
    err = capsys.readouterr().err
    assert "outside 1 to 16" in err and "Fix:" in err and "Traceback" not in err

    code = main(["plan", "--hf", "deepseek_v3", "--world", "8", "--expert-params", "*.experts.*"])
    err = capsys.readouterr().err
    assert code == 2 and "hold every expert on each rank" in err and "Fix:" in err
    assert "Traceback" not in err
