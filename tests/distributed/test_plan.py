"""``aotdist plan`` against what runs: the same configuration simulated at 2 ranks (fake
tensors, fake process group) and run for real on 2 gloo ranks: collectives by kind and
mesh dimension equal in count and bytes, the parameter bytes of a rank equal, the saved
activations within 5% of what autograd saves in the real compiled step."""

from __future__ import annotations

import contextlib

import pytest

from aotdist.testing import build_model, example_inputs, run_distributed

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

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch
                import torch.distributed as dist

                name = func.name().replace("_", "")
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


def _count_as_run(gm, names: dict[str, str], counted: dict) -> None:
    """Makes every functional collective in ``gm`` and its subgraphs count itself (kind,
    mesh dimension, unsharded bytes) into ``counted`` each time the graph runs it."""
    import torch

    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            name = str(node.target) if node.op == "call_function" else ""
            kind = next(
                (
                    k
                    for k in ("all_gather", "reduce_scatter", "all_reduce")
                    if f"_c10d_functional.{k}" in name
                ),
                None,
            )
            if kind is not None:
                node.target = _counting(node.target, kind, names, counted)
        module.recompile()


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
            return _counting(func, kind, names, counted)(*args, **(kwargs or {}))

    refresh = graph_fsdp.refresh_float8_scales

    def counted_refresh(slots):
        with Mode():
            return refresh(slots)

    graph_fsdp.refresh_float8_scales = counted_refresh
    try:
        yield
    finally:
        graph_fsdp.refresh_float8_scales = refresh


def _counting(op, kind: str, names: dict[str, str], counted: dict):
    def run(*args, **kwargs):
        result = op(*args, **kwargs)
        unsharded = args[0] if kind == "reduce_scatter" else result
        key = (kind, names[args[-1]])
        n, b = counted.get(key, (0, 0))
        counted[key] = (n + 1, b + unsharded.numel() * unsharded.element_size())
        return result

    return run


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
        _count_as_run(gm, names, counted)

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
