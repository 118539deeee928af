"""``aotdist plan`` against what runs: the same configuration simulated at 2 ranks (fake
tensors, fake process group) and run for real on 2 gloo ranks: collectives by kind and
mesh dimension equal in count and bytes, the parameter bytes of a rank equal, the saved
activations within 5% of what autograd saves in the real compiled step. Pipelined jobs
(2 stages x 2 data-parallel ranks): the same per stage, point-to-point transfers too."""

from __future__ import annotations

import contextlib

import pytest

from aotdist.testing import build_model, example_inputs, run_distributed
from aotdist.testing.distributed import count_collectives_as_run, counting_collective

DEPTH = 3


def _build():
    model = build_model("gpt", depth=DEPTH)
    (x,), _ = example_inputs(model, 2)
    return model, (x,)


class _Counted:
    """Collectives a rank issues, counted by kind and mesh dimension as they run (eager
    FSDP2 hooks: a dispatch mode around a compiled step would make Dynamo skip it)."""

    def __init__(self, names: dict[str, str]):
        from torch.utils._python_dispatch import TorchDispatchMode

        counted = self.counted = {}
        p2p = self.p2p = {"send": [0, 0], "recv": [0, 0]}  # count, bytes

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch
                import torch.distributed as dist

                name = func.name().replace("_", "")
                if func.name() in ("c10d::send", "c10d::recv_"):
                    side = p2p["send" if func.name() == "c10d::send" else "recv"]
                    tensors = torch.utils._pytree.tree_leaves(args)
                    side[0] += 1
                    side[1] += sum(
                        t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)
                    )
                kind = next(
                    (
                        k
                        for k in ("allgather", "reducescatter", "allreduce")
                        if func.name().startswith("c10d::") and k in name
                    ),
                    None,
                )
                if kind is not None:
                    leaves = torch.utils._pytree.tree_leaves(args)
                    big = max(
                        t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)
                    )
                    group = next(
                        dist.ProcessGroup.unbox(a) if isinstance(a, torch.ScriptObject) else a
                        for a in leaves
                        if isinstance(a, (torch.ScriptObject, dist.ProcessGroup))
                    )
                    key = (
                        {
                            "allgather": "all_gather",
                            "reducescatter": "reduce_scatter",
                            "allreduce": "all_reduce",
                        }[kind],
                        names[group.group_name],
                    )
                    n, b = counted.get(key, (0, 0))
                    counted[key] = (n + 1, b + big)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


@contextlib.contextmanager
def _eager_scales_counted(names: dict[str, str], counted: dict):
    """Graph mode with float8 all-gather: the functional collectives of the eager scale
    refresh before each forward (outside every graph) counted as they run."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import aotdist.fsdp.graph as graph_fsdp

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            space, _, op = func.name().partition("::")
            kind = next(
                (
                    k
                    for k in ("all_gather", "reduce_scatter", "all_reduce")
                    if space == "_c10d_functional" and op.startswith(k)
                ),
                None,
            )
            if kind is None:
                return func(*args, **(kwargs or {}))
            return counting_collective(func, kind, names, counted)(*args, **(kwargs or {}))

    refresh = graph_fsdp.refresh_float8_scales

    def counted_refresh(slots):
        with Mode():
            return refresh(slots)

    graph_fsdp.refresh_float8_scales = counted_refresh
    try:
        yield
    finally:
        graph_fsdp.refresh_float8_scales = refresh


CASES = {  # id: (ranks, mesh, fsdp config, ac[, more config])
    "graph": (2, (2,), {"mode": "graph"}, False),
    "hooks": (2, (2,), {"mode": "hooks"}, False),
    "graph-ac": (2, (2,), {"mode": "graph"}, True),
    "hooks-ac": (2, (2,), {"mode": "hooks"}, True),
    "graph-bf16": (2, (2,), {"mode": "graph", "param_dtype": "bfloat16"}, False),
    "hooks-bf16": (2, (2,), {"mode": "hooks", "param_dtype": "bfloat16"}, False),
    "graph-hsdp-2x2": (4, (2, 2), {"mode": "graph"}, False),
    "hooks-hsdp-2x2": (4, (2, 2), {"mode": "hooks"}, False),
    # torchao's weights all-gathered in float8 by FSDP2: 1 byte per element
    "hooks-bf16-float8-gather": (
        2,
        (2,),
        {"mode": "hooks", "param_dtype": "bfloat16"},
        False,
        {"float8": {"enabled": True, "fsdp_all_gather": True}},
    ),
    # graph mode casts them to float8 in the graph and gathers the bytes; the amaxes are
    # all-reduced eagerly before each forward (counted as they run too)
    "graph-bf16-float8-gather": (
        2,
        (2,),
        {"mode": "graph", "param_dtype": "bfloat16"},
        False,
        {"float8": {"enabled": True, "fsdp_all_gather": True}},
    ),
}


def _config(case: str) -> dict:
    _, _, fsdp, ac, *more = CASES[case]
    return {"fsdp": dict(fsdp), "ac": {"enabled": ac}, **(more[0] if more else {})}


def _real(rank: int, world_size: int, case: str) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import aotdist
    from aotdist.backends.bucketing import graphs_observed
    from aotdist.bench.saved import SavedBytes
    from aotdist.simulate import Plan, _memory

    _, shape, fsdp, *_ = CASES[case]
    dims = ("dp_shard",) if len(shape) == 1 else ("dp_replicate", "dp_shard")
    torch.manual_seed(0)
    config = {**_config(case), "compile": {"backend": "aot_eager"}}
    config["fsdp"]["enabled"] = True
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    model, (x,) = _build()
    aotdist.parallelize(model, config=config, mesh=mesh)
    out = Plan(
        world=world_size, mesh=shape, mesh_dims=dims, fsdp_mode=fsdp["mode"], optimizer="adamw"
    )
    _memory(out, model, "adamw")
    names = {mesh.get_group(d).group_name: d for d in dims}
    counted: dict = {}  # graph mode: the compiled graphs' collectives, counted as they run

    def count(gm):
        count_collectives_as_run(gm, names, counted)

    with graphs_observed(count):
        model(x).float().mean().backward()  # the compile
    counted.clear()  # the steady step's
    with (
        _eager_scales_counted(names, counted),
        SavedBytes(exclude=[*model.parameters(), *model.buffers()]) as saved,
    ):
        loss = model(x).float().mean()
    loss.backward()
    if fsdp["mode"] == "graph":
        collectives = sorted((k, d, n, b) for (k, d), (n, b) in counted.items())
    else:  # counted as they run, in an eager step of the same sharding
        eager, _ = _build()
        aotdist.parallelize(eager, config={**config, "compile": {"enabled": False}}, mesh=mesh)
        counter = _Counted(names)
        with counter.mode:
            eager(x).float().mean().backward()
        collectives = sorted((k, d, n, b) for (k, d), (n, b) in counter.counted.items())
    return {"params": out.param_bytes, "saved": saved.activation_bytes, "collectives": collectives}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_plan_is_what_the_ranks_run(case):
    """Same model, config and mesh: simulated at N ranks, and run on N gloo ranks."""
    from aotdist.simulate import plan

    world, shape, *_ = CASES[case]
    simulated = plan(_build, world=world, mesh=shape, config=_config(case))
    real = run_distributed(_real, world, case, timeout=300)[0]
    assert simulated.param_bytes == real["params"]
    assert (
        sorted((c.kind, c.dim, c.count, c.bytes) for c in simulated.collectives)
        == real["collectives"]
    )
    assert simulated.activation_bytes == pytest.approx(real["saved"], rel=0.05), (
        simulated.activation_bytes,
        real["saved"],
    )


def test_checkpointed_regions_in_graph_mode_gather_no_more_than_without_checkpointing():
    """Graph-mode FSDP with activation checkpointing: the backward recomputes a region's
    forward, its gathers included, and the region's backward uses those gathered weights:
    as many all-gathers per step as without checkpointing (it gathered each region's
    weights a third time, 1.4x the bytes), the hooks mode count plus the root's regather."""
    from aotdist.simulate import plan

    def gathers(mode, ac):
        config = {"fsdp": {"mode": mode}, "ac": {"enabled": ac}}
        out = plan(_build, world=4, mesh=(4,), config=config)
        return next((c.count, c.bytes) for c in out.collectives if c.kind == "all_gather")

    plain, checkpointed = gathers("graph", False), gathers("graph", True)
    hooks = gathers("hooks", True)
    assert checkpointed[0] == plain[0] == hooks[0] + 1, (plain, checkpointed, hooks)
    assert checkpointed[1] <= 1.02 * plain[1], (plain, checkpointed)


def test_a_mesh_that_does_not_give_the_world_is_refused():
    from aotdist.errors import ConfigError
    from aotdist.simulate import plan

    with pytest.raises(ConfigError, match="does not give 64 ranks"):
        plan(_build, world=64, mesh=(3, 8))


def test_the_command_prints_the_plan_as_json_with_the_mesh_s_network_dimension(capsys):
    """``aotdist plan`` at 16 ranks, HSDP 2x8: replicas across nodes, shards within one;
    a rank holds what it holds at 8 ranks sharding alone."""
    import json

    from aotdist.cli import main

    def run(*argv):
        assert main(["plan", "--depth", "2", "--json", *argv]) == 0
        return json.loads(capsys.readouterr().out)

    hsdp, flat = run("--world", "16", "--mesh", "2x8"), run("--world", "8")
    assert hsdp["param_bytes"] == flat["param_bytes"] > 0
    network = {(c["kind"], c["dim"]): c["network"] for c in hsdp["collectives"]}
    assert network[("all_reduce", "dp_replicate")] is True
    assert network[("all_gather", "dp_shard")] is False
    assert {c["dim"] for c in flat["collectives"]} == {"dp_shard"}
    assert hsdp["regions"]["GPTBlock"]["subgraphs"] == 1


def test_float8_all_gather_gathers_the_float8_weights_in_one_byte(capsys):
    """``--float8-all-gather``, in hooks and in graph mode: torchao's Float8Linear weights
    gathered in float8, the rest in bf16 (the exact bytes against a real run: the
    agreement cases)."""
    import json

    from aotdist.cli import main

    def gathered(*argv):
        code = main(
            ["plan", "--depth", "2", "--world", "4", "--param-dtype", "bfloat16", "--json", *argv]
        )
        out, err = capsys.readouterr()
        if code != 0:
            return code, err
        return code, next(c for c in json.loads(out)["collectives"] if c["kind"] == "all_gather")

    for mode in ("hooks", "graph"):  # Float8 compute with bf16 gathers, then float8 ones
        bf16 = gathered("--fsdp-mode", mode, "--float8")[1]
        float8 = gathered("--fsdp-mode", mode, "--float8-all-gather")[1]
        assert float8["count"] == bf16["count"] and float8["bytes"] < 0.6 * bf16["bytes"], (
            mode,
            bf16,
            float8,
        )


def test_a_transformers_config_json_is_planned_as_its_sizes(tmp_path, capsys):
    """``--hf config.json``: the user's own model config (no weights), its sizes kept."""
    import json

    import transformers

    from aotdist.cli import main

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        vocab_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config.save_pretrained(tmp_path)
    assert (
        main(
            ["plan", "--hf", str(tmp_path / "config.json"), "--world", "4", "--seq", "8", "--json"]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    per_rank = (
        sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        * 4
        / 4
    )
    assert out["param_bytes"] == pytest.approx(per_rank, rel=0.02)
    assert out["regions"]["LlamaDecoderLayer"] == {"call_sites": 2, "subgraphs": 1}


def test_a_job_over_the_gpu_s_memory_exits_1_with_the_fix(capsys):
    from aotdist.cli import main

    assert (
        main(["plan", "--depth", "2", "--world", "4", "--mesh", "2x2", "--gpu-memory", "0.0001"])
        == 1
    )
    out, err = capsys.readouterr()
    assert "peak (est.)" in out  # the plan is still printed
    assert "does not fit" in err and "Fix: shard over more ranks (a shard group of 4" in err
    # pipelined: the mesh named is a stage's (4 of the 8 ranks), which --pp multiplies
    argv = ["plan", "--depth", "4", "--world", "8", "--pp", "2", "--mesh", "2x2"]
    assert main([*argv, "--microbatches", "2", "--gpu-memory", "0.0001"]) == 1
    err = capsys.readouterr().err
    assert "a shard group of 4: --mesh 1x4, or --mesh 4 without HSDP" in err, err


# ----------------------------------------------------------------- pipelined jobs, per stage
PIPELINE_CASES = {  # id: (fsdp mode, schedule, micro-batches); 2 pp ranks x 2 dp ranks
    "pp-hooks-1f1b": ("hooks", "1F1B", 2),
    "pp-graph-gpipe": ("graph", "GPipe", 4),
    "pp-hooks-interleaved": ("hooks", "Interleaved1F1B", 4),  # 2 stages per rank
}


def _pp_build(case: str = "pp-hooks-1f1b"):
    # two blocks per stage: a stage finds its regions on itself
    model = build_model("gpt", depth=8 if "interleaved" in case else 4)
    (x,), _ = example_inputs(model, 4)
    return model, (x,)


def _pp_config(case: str) -> dict:
    mode, schedule, micro = PIPELINE_CASES[case]
    pipeline = {"enabled": True, "degree": 2, "schedule": schedule, "microbatches": micro}
    return {"fsdp": {"mode": mode}, "pipeline": pipeline}


def _real_pipeline(rank: int, world_size: int, case: str) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import aotdist
    from aotdist.backends.bucketing import graphs_observed
    from aotdist.bench.saved import SavedBytes
    from aotdist.simulate import StagePlan, _memory

    mode, _, micro = PIPELINE_CASES[case]
    torch.manual_seed(0)
    config = {**_pp_config(case), "compile": {"backend": "aot_eager"}}
    config["fsdp"]["enabled"] = True
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    model, (x,) = _pp_build(case)
    pipe = aotdist.pipeline(
        model,
        microbatch=(x.chunk(micro)[0],),
        loss_fn=lambda out, target: out.float().mean(),
        config=config,
        mesh=mesh,
    )

    def step():
        if pipe.is_first:
            pipe.step(x)
        else:
            pipe.step(target=x, losses=[])

    names = {mesh.get_group(d).group_name: d for d in ("pp", "dp_shard")}
    counted: dict = {}  # graph mode: the compiled graphs' collectives, counted as they run
    with graphs_observed(lambda gm: count_collectives_as_run(gm, names, counted)):
        step()  # the compile
    counted.clear()
    with SavedBytes(exclude=[*pipe.module.parameters(), *pipe.module.buffers()]) as saved:
        step()
    in_graphs = dict(counted)
    counter = _Counted(names)  # FSDP2's hooks and the stage-to-stage transfers, as they run
    with counter.mode:
        step()
    out = StagePlan(index=pipe.stage_index, ranks=(rank, rank), units=pipe.units)
    _memory(out, pipe.module, "adamw")
    collectives = in_graphs if mode == "graph" else counter.counted
    return {
        "params": out.param_bytes,
        "saved_per_microbatch": saved.activation_bytes / (micro * len(pipe.modules)),
        "collectives": sorted((k, d, n, b) for (k, d), (n, b) in collectives.items()),
        "sends": counter.p2p["send"],
        "recvs": counter.p2p["recv"],
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", list(PIPELINE_CASES))
def test_the_pipeline_plan_is_what_each_stage_runs(case):
    """2 stages x 2 data-parallel ranks, simulated stage by stage and run on 4 gloo ranks:
    per stage, its parameters, FSDP collectives (micro-batches and deferred gradient sync
    as torch's pipelining issues them) and point-to-point transfers equal, one
    micro-batch's saved activations within 5%."""
    from aotdist.simulate import plan

    simulated = plan(lambda: _pp_build(case), world=4, mesh=(2,), config=_pp_config(case))
    real = run_distributed(_real_pipeline, 4, case, timeout=300)
    for stage, rank in ((0, 0), (1, 2)):
        sim, ran = simulated.pipeline.stages[stage], real[rank]
        assert sim.param_bytes == ran["params"], stage
        assert (
            sorted((c.kind, c.dim, c.count, c.bytes) for c in sim.collectives) == ran["collectives"]
        ), stage
        assert (sim.sends, sim.recvs) == (ran["sends"], ran["recvs"]), stage
        assert sim.microbatch_activation_bytes == pytest.approx(
            ran["saved_per_microbatch"], rel=0.05
        ), (stage, sim.microbatch_activation_bytes, ran["saved_per_microbatch"])


def test_a_pipelined_plan_splits_the_model_and_names_the_schedule_s_bubble():
    """At 64 ranks (4 stages x 16): the stages together hold the model's parameters once
    per data-parallel shard group; each sends one activation per micro-batch forward and
    receives one gradient back (none past the ends); 1F1B keeps fewer micro-batches in
    flight on later stages; the bubble is (stages - 1) / (micro-batches + stages - 1)."""
    from aotdist.simulate import plan

    def build():
        model = build_model("gpt", depth=8)
        (x,), _ = example_inputs(model, 8)
        return model, (x,)

    whole = plan(build, world=16, mesh=(16,))
    config = {"pipeline": {"enabled": True, "degree": 4, "microbatches": 8}}
    piped = plan(build, world=64, mesh=(16,), config=config)
    pp = piped.pipeline
    assert (piped.mesh, piped.mesh_dims) == ((4, 16), ("pp", "dp_shard"))
    assert pp.bubble_fraction == pytest.approx(3 / 11)
    stages = pp.stages
    assert [s.ranks for s in stages] == [(0, 15), (16, 31), (32, 47), (48, 63)]
    held = sum(s.param_bytes for s in stages)
    pos = 16 * 32 * 4  # TinyGPT's position table (one row: each stage's rank 0 holds it whole)
    assert held - 3 * pos == pytest.approx(whole.param_bytes, rel=0.02), (held, whole)
    assert [s.sends[0] for s in stages] == [8, 16, 16, 8]  # activations on, gradients back
    assert [s.recvs[0] for s in stages] == [8, 16, 16, 8]
    assert [s.in_flight for s in stages] == [4, 3, 2, 1]
    assert all(s.regions["GPTBlock"] == {"call_sites": 2, "subgraphs": 1} for s in stages)
    assert piped.peak_bytes == max(s.peak_bytes for s in stages)


@pytest.mark.parametrize(
    ("schedule", "in_flight"), [("Interleaved1F1B", [5, 3]), ("LoopedBFS", [16, 16])]
)
def test_an_interleaved_plan_holds_two_stages_per_rank_and_a_shorter_bubble(schedule, in_flight):
    """2 pipeline ranks x 2 stages of two blocks (4 ranks): rank r holds stages r and r + 2;
    each stage sends an activation per micro-batch on and a gradient back (none past the
    ends); the bubble is (2 - 1) / (2 * 8 + 2 - 1); the stage micro-batches in flight
    follow torch's own order of each rank's actions (Interleaved1F1B: its warm-up, 4 and 2
    forwards, plus one)."""
    from aotdist.simulate import plan

    def build():
        model = build_model("gpt", depth=8)
        (x,), _ = example_inputs(model, 8)
        return model, (x,)

    pipeline = {"enabled": True, "degree": 2, "microbatches": 8, "schedule": schedule}
    piped = plan(build, world=4, mesh=(2,), config={"pipeline": pipeline})
    pp = piped.pipeline
    assert (pp.stages_per_rank, pp.bubble_fraction) == (2, pytest.approx(1 / 17))
    ranks = pp.stages
    assert [s.stages for s in ranks] == [(0, 2), (1, 3)]
    assert [s.units for s in ranks] == [
        ("tok", "blocks.0", "blocks.1", "blocks.4", "blocks.5"),
        ("blocks.2", "blocks.3", "blocks.6", "blocks.7", "ln_f", "head"),
    ]
    assert [s.sends[0] for s in ranks] == [24, 24]  # 8 + 16 and 16 + 8
    assert [s.recvs[0] for s in ranks] == [24, 24]
    assert [s.in_flight for s in ranks] == in_flight
    for s in ranks:  # each stage's two blocks: one subgraph per stage
        assert s.regions["GPTBlock"] == {"call_sites": 4, "subgraphs": 2}, s.regions
        assert s.activation_bytes == s.in_flight * s.microbatch_activation_bytes
    assert piped.peak_bytes == max(s.peak_bytes for s in ranks)


def test_the_command_plans_a_pipeline_and_refuses_a_world_it_does_not_divide(capsys):
    import json

    from aotdist.cli import main

    argv = ["plan", "--depth", "4", "--world", "8", "--pp", "2", "--microbatches", "4"]
    assert main([*argv, "--schedule", "GPipe", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mesh"] == [2, 4] and out["pipeline"]["schedule"] == "GPipe"
    assert [s["in_flight"] for s in out["pipeline"]["stages"]] == [4, 4]
    assert main(argv) == 0
    assert "bubble 20.0% of each step" in capsys.readouterr().out
    assert main([*argv, "--mesh", "3"]) != 0
    assert "does not give 8 ranks" in capsys.readouterr().err


def test_a_model_whose_forward_does_not_skip_other_stages_modules_is_refused_with_the_fix():
    """transformers' models call every module: stage 1's copy, whose embedding is None,
    fails; the plan (and aotdist.pipeline) says why and what to change."""
    import torch
    from torch import nn

    from aotdist.errors import ConfigError
    from aotdist.simulate import plan

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return x + torch.relu(self.proj(x))

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(8, 8)
            self.blocks = nn.ModuleList(Block() for _ in range(4))

        def forward(self, x):
            x = self.stem(x)
            for block in self.blocks:
                x = block(x)
            return x

    def build():
        return Plain(), (torch.randn(4, 8),)

    config = {"pipeline": {"enabled": True, "degree": 2, "microbatches": 2}}
    with pytest.raises(ConfigError, match="its forward must skip what is None"):
        plan(build, world=2, mesh=(1,), config=config)


_COPIES_UNDER_FAKE_TENSORS = """
import gc
import torch
from aotdist._compat import fake_mode_of
from aotdist._compat.distributed import fake_tensor_mode
from aotdist.pipelining import _keep

kept = []

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        kept.append(torch.tensor(3.0))  # a constant: the mode keeps a weak ref to its storage

with fake_tensor_mode() as mode:
    model = Net()
    for _ in range(3):  # the stage copies of the model
        part = _keep(model, ["a", "b"], ("a",))
        assert fake_mode_of([part.a.weight]) is mode, "the copy made a FakeTensorMode of its own"
        del part
        gc.collect()
    junk = [torch.full((1,), 7.0) for _ in range(1000)]  # would reuse a freed storage
    print("constant", kept[0].item())
"""


def test_a_stage_copy_under_fake_tensors_keeps_the_mode_and_its_constants():
    """``aotdist plan --pp`` copies the model built under fake tensors for each stage. A
    copy that deep-copied the FakeTensorMode duplicated its weak references to constants'
    storages (torch's StorageWeakRef), released twice: torchtitan's Llama 3 70B at pp 8
    aborted at exit with glibc's "corrupted double-linked list". Here three copies freed a
    live constant's storage ("data is not allocated"). In a subprocess: it can crash."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _COPIES_UNDER_FAKE_TENSORS],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "constant 3.0" in out.stdout
