"""``aotdist plan --cp N`` against what runs. torch's ``context_parallel`` does not run on
CPU, but its ring-attention functions (``_templated_ring_attention`` and its backward) are
plain functions of the local shards that take the attention kernel as an argument: on
gloo they run CPU's SDPA kernel around the ring. Here they equal full-sequence SDPA on the
head-tail shards (outputs and gradients), and a real step of a small model (FSDP2 over the
ranks as ``dp_shard_cp``, its attention through torch's ring functions, at N = 2 and 4,
with both rotate methods, with and without activation checkpointing) issues the
collectives the plan lists, count and bytes, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aotdist.testing import run_distributed

DEPTH, DIM, HEADS, VOCAB, SEQ = 2, 32, 2, 64, 32


def _shard(t: torch.Tensor, rank: int, n: int, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s head-tail chunks (torch's ``_HeadTailLoadBalancer``)."""
    chunks = t.chunk(2 * n, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * n - 1 - rank]], dim=dim)


def _set_rotate(rotate: str) -> None:
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    method = cp._RotateMethod.ALL_TO_ALL if rotate == "alltoall" else cp._RotateMethod.ALL_GATHER
    cp._cp_options.rotate_method = method


def _ring_forward(group, q, k, v):
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse, *_ = cp._templated_ring_attention(
        group, 2, op, q, k, v, is_causal=True, dropout_p=0.0, scale=None
    )
    return out, lse


def _ring_backward(group, grad, q, k, v, out, lse):
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    dq, dk, dv, *_ = cp._templated_ring_attention_backward(
        group,
        2,
        op,
        grad_out=grad.contiguous(),
        grad_out_name="grad_out",
        query=q,
        key=k,
        value=v,
        out=out,
        logsumexp=lse,
        is_causal=True,
        dropout_p=0.0,
        scale=None,
    )
    return dq, dk, dv


class _Ring(torch.autograd.Function):
    """Causal SDPA over the sequence sharded on ``group``: torch's ring attention."""

    group = None

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = _ring_forward(_Ring.group, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _ring_backward(_Ring.group, grad, *ctx.saved_tensors)


class Block(nn.Module):
    """Attention in bfloat16 (its key and value gradients go around the ring in float32),
    through SDPA, or through torch's ring (``ring``: the real context-parallel run)."""

    def __init__(self, ring: bool = False, attention: str = "causal"):
        super().__init__()
        self.ring = ring
        self.attention = attention  # causal, bidirectional, or masked (a causal mask)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, d // HEADS).unbind(2)
        q, k, v = (z.transpose(1, 2).to(torch.bfloat16) for z in (q, k, v))
        if self.ring:
            y = _Ring.apply(q, k, v)
        elif self.attention != "causal":
            mask = torch.ones(t, t, dtype=torch.bool).tril() if self.attention == "masked" else None
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.float().transpose(1, 2).reshape(b, t, d))


class Net(nn.Module):
    def __init__(self, depth: int = DEPTH, ring: bool = False, attention: str = "causal"):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(ring, attention) for _ in range(depth))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _build(depth: int = DEPTH, ring: bool = False):
    torch.manual_seed(0)
    return Net(depth, ring), (torch.randint(0, VOCAB, (2, SEQ)),)


class _Counted:
    """The collectives a rank issues as they run, by kind, dimension and phase: count and
    bytes (a gather's output, a reduce-scatter's input, a ring permute's input)."""

    def __init__(self, names: dict[str, str]):
        from torch.utils._python_dispatch import TorchDispatchMode

        from aotdist._compat.distributed import group_of

        counted = self.counted = {}
        outer = self
        self.phase = "forward"

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                space, _, op = func.name().partition("::")
                flat = op.replace("_", "")
                kind = next((v for k, v in KINDS.items() if flat.startswith(k) or k in flat), None)
                if space in ("c10d", "_c10d_functional") and kind is not None:
                    leaves = torch.utils._pytree.tree_leaves(args)
                    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
                    nbytes = max(t.numel() * t.element_size() for t in tensors)
                    # a functional collective names its group; c10d's takes the group object
                    named = next((a for a in leaves if isinstance(a, str)), None)
                    dim = names[named or group_of(leaves).group_name]
                    if space == "_c10d_functional" and kind == "all_gather":
                        nbytes *= args[1]  # (input, group_size, group): the output's
                    if kind == "all_to_all":  # torch's ring: one peer's whole buffer
                        kind, nbytes = "permute", tensors[0].numel() * tensors[0].element_size()
                    key = (kind, dim, outer.phase if dim == "cp" else "")
                    n, b = counted.get(key, (0, 0))
                    counted[key] = (n + 1, b + nbytes)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


KINDS = {"allgather": "all_gather", "reducescatter": "reduce_scatter"}
KINDS |= {"allreduce": "all_reduce", "alltoall": "all_to_all"}


def _real_step(rank: int, world_size: int, rotate: str, ac: bool, depth: int) -> dict:
    """One step of the context-parallel job for real: FSDP2 (eager, hooks) over every rank
    (``dp_shard_cp``: dp_shard 1 x cp N), each rank's head-tail share of the tokens, the
    attention through torch's ring on a ``cp`` group of the same ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import aotdist
    from aotdist.simulate import Plan, _memory

    _set_rotate(rotate)
    _Ring.group = dist.new_group(list(range(world_size)))
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    config = {"fsdp": {"enabled": True, "mode": "hooks"}, "compile": {"enabled": False}}
    config["ac"] = {"enabled": ac}
    model, (tokens,) = _build(depth, ring=True)
    aotdist.parallelize(model, config=config, mesh=mesh)
    out = Plan(
        world=world_size, mesh=(1,), mesh_dims=("dp_shard",), fsdp_mode="hooks", optimizer="adamw"
    )
    _memory(out, model, "adamw")
    names = {mesh.get_group("dp_shard").group_name: "dp_shard_cp", _Ring.group.group_name: "cp"}
    counter = _Counted(names)
    mine = _shard(tokens, rank, world_size, dim=1)
    with counter.mode:
        loss = model(mine).float().mean()
        counter.phase = "backward"
        loss.backward()
    return {
        "params": out.param_bytes,
        "collectives": sorted((k, d, ph, n, b) for (k, d, ph), (n, b) in counter.counted.items()),
    }


def _planned(simulated) -> list:
    return sorted(
        (c.kind, c.dim, c.phase, c.count, c.bytes)
        for c in (*simulated.collectives, *simulated.context_parallel)
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("n", "rotate", "ac", "depth"),
    [
        (2, "allgather", False, 1),
        (2, "alltoall", False, 1),
        (4, "allgather", False, 1),
        (4, "alltoall", False, 1),
        (2, "allgather", True, DEPTH),
        (4, "alltoall", True, DEPTH),
    ],
)
def test_the_cp_plan_is_what_the_ranks_run(n, rotate, ac, depth):
    """Depth 1: the figures of one SDPA call; with ``ac``, two calls, each recomputed in
    backward with its forward's transfers."""
    from aotdist.simulate import plan

    config = {"fsdp": {"mode": "hooks"}, "ac": {"enabled": ac}}
    simulated = plan(lambda: _build(depth), world=n, config=config, cp=n, cp_rotate=rotate)
    real = run_distributed(_real_step, n, rotate, ac, depth, timeout=240)
    for rank, ran in enumerate(real):
        assert simulated.param_bytes == ran["params"], rank
        assert _planned(simulated) == ran["collectives"], (rank, ran["collectives"])
    assert simulated.cp_calls == depth and simulated.mesh == (1, n)
    # per call, read from torch: bf16 keys and values of seq / n tokens, float32 gradients
    kv = 2 * 2 * HEADS * (SEQ // n) * (DIM // HEADS) * 2  # k and v, batch 2, bf16
    rows = {(c.phase, c.kind): (c.count, c.bytes) for c in simulated.context_parallel}
    again = 2 if ac else 1  # the recompute's transfers
    if rotate == "allgather":
        assert rows["forward", "all_gather"] == (depth, depth * n * kv)
        assert rows["backward", "all_gather"] == (again * depth, again * depth * n * kv)
        grads = (depth * n, depth * n * 2 * kv)
    else:
        assert rows["forward", "permute"] == (depth * (n - 1), depth * (n - 1) * kv)
        grads = (
            again * depth * (n - 1) + depth * n,
            (again * depth * (n - 1) + depth * 2 * n) * kv,
        )
    assert rows["backward", "permute"] == grads


def _ring_equals_sdpa(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, HEADS, SEQ, 8, requires_grad=True) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(full)
    full.backward(grad)
    errors = {}
    for rotate in ("allgather", "alltoall"):
        _set_rotate(rotate)
        local = [_shard(t.detach(), rank, world_size) for t in (q, k, v)]
        out, lse = _ring_forward(dist.group.WORLD, *local)
        grads = _ring_backward(dist.group.WORLD, _shard(grad, rank, world_size), *local, out, lse)
        expected = [_shard(t, rank, world_size) for t in (full.detach(), q.grad, k.grad, v.grad)]
        errors[rotate] = max(
            (a - b).abs().max().item() for a, b in zip((out, *grads), expected, strict=True)
        )
    return errors


@pytest.mark.parametrize("n", [2, 4])
def test_torch_ring_attention_on_cpu_equals_full_sdpa(n):
    """The real run above is context parallelism: torch's ring functions with CPU's SDPA
    kernel give each rank its head-tail rows of full-sequence causal SDPA, and their
    gradients, with either rotate method."""
    for rank, errors in enumerate(run_distributed(_ring_equals_sdpa, n, timeout=120)):
        assert max(errors.values()) < 1e-5, (rank, errors)


def test_a_cp_plan_shards_state_over_dp_shard_cp_and_traces_seq_over_n_tokens():
    from aotdist.simulate import plan

    whole = plan(lambda: _build(), world=2, config={"fsdp": {"mode": "hooks"}})
    simulated = plan(lambda: _build(), world=8, mesh=(2,), config={"fsdp": {"mode": "hooks"}}, cp=4)
    quarter = plan(
        lambda: (_build()[0], (torch.randint(0, VOCAB, (2, SEQ // 4)),)),
        world=8,
        mesh=(8,),
        config={"fsdp": {"mode": "hooks"}},
    )
    assert simulated.mesh == (2, 4) and simulated.mesh_dims == ("dp_shard", "cp")
    assert simulated.param_bytes == quarter.param_bytes < whole.param_bytes
    assert simulated.activation_bytes == quarter.activation_bytes < whole.activation_bytes
    assert {c.dim for c in simulated.collectives} == {"dp_shard_cp"}
    table = simulated.table()
    assert "traced at 8 of 32 tokens" in table and "rotate allgather" in table
    assert simulated.peak_bytes == quarter.peak_bytes + simulated.cp_buffer_bytes


def test_cp_across_nodes_crosses_the_network():
    from aotdist.simulate import plan

    simulated = plan(
        lambda: (_build()[0], (torch.randint(0, VOCAB, (1, 64)),)),
        world=32,
        config={"fsdp": {"mode": "hooks"}},
        cp=16,
        gpus_per_node=8,
    )
    assert all(c.network for c in simulated.context_parallel)
    inside = plan(lambda: _build(), world=16, config={"fsdp": {"mode": "hooks"}}, cp=8)
    assert not any(c.network for c in inside.context_parallel)
    assert any(c.network for c in inside.collectives)  # dp_shard_cp spans 2 nodes


class _WrittenOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + torch.softmax(block(x) @ x.transpose(1, 2), -1) @ x
        return x


@pytest.mark.parametrize(
    ("kwargs", "build", "message", "fix"),
    [
        ({"world": 6, "cp": 4}, _build, "cp 4 does not divide the 6 ranks", "--cp N with N"),
        ({"world": 4, "cp": 2, "mesh": (4,)}, _build, "x cp 2 does not give 4", "times --cp"),
        ({"world": 4, "cp": 2, "cp_rotate": "ring"}, _build, "unknown cp rotate", "allgather"),
        (
            {"world": 4, "cp": 4},
            lambda: (_build()[0], (torch.randint(0, VOCAB, (2, 12)),)),
            "input 0 has 12 tokens",
            "--seq a multiple of 8",
        ),
        (
            {"world": 2, "cp": 2},
            lambda: (_WrittenOut(), (torch.randint(0, VOCAB, (2, SEQ)),)),
            "calls no SDPA kernel",
            "F.scaled_dot_product_attention(q, k, v, is_causal=True)",
        ),
        (
            {"world": 2, "cp": 2},
            lambda: (Net(attention="bidirectional"), (torch.randint(0, VOCAB, (2, SEQ)),)),
            "2 SDPA call(s) of the step are neither causal nor masked",
            "context parallelism for a causal model",
        ),
        (
            {"world": 4, "cp": 2, "config": {"pipeline": {"enabled": True, "degree": 2}}},
            _build,
            "with pipeline.enabled (--pp) is not planned",
            "plan them apart",
        ),
        (
            {"world": 2, "cp": 2, "config": {"fsdp": {"expert_params": ["blocks.*"]}}},
            _build,
            "with fsdp.expert_params",
            "plan them apart",
        ),
    ],
)
def test_what_a_cp_plan_cannot_do_is_refused_with_the_fix(kwargs, build, message, fix):
    from aotdist.errors import ConfigError
    from aotdist.simulate import plan

    with pytest.raises(ConfigError, match="plan: ") as err:
        plan(build, **kwargs)
    assert message in str(err.value) and fix in str(err.value), str(err.value)


@pytest.mark.parametrize("ac", [False, True])
def test_graph_mode_fsdp_plans_the_same_ring_transfers(ac):
    """The ring's transfers follow the SDPA calls, whatever the FSDP mode; graph-mode FSDP's
    regions run as invoke_subgraph under the plan's fake tensors."""
    from aotdist.simulate import plan

    rows = [
        sorted(
            (c.phase, c.kind, c.count, c.bytes)
            for c in plan(
                _build, world=4, config={"fsdp": {"mode": mode}, "ac": {"enabled": ac}}, cp=4
            ).context_parallel
        )
        for mode in ("hooks", "graph")
    ]
    assert rows[0] == rows[1] and rows[0]


def test_a_masked_sdpa_call_is_planned_as_causal_with_a_note():
    """transformers builds a causal mask under fake tensors (its real step calls SDPA with
    is_causal=True); torch's ring takes no mask: planned as causal, and the table says so."""
    from aotdist.simulate import plan

    def rows(attention):
        simulated = plan(
            lambda: (Net(attention=attention), (torch.randint(0, VOCAB, (2, SEQ)),)),
            world=2,
            config={"fsdp": {"mode": "hooks"}},
            cp=2,
        )
        return simulated, sorted(
            (c.phase, c.kind, c.count, c.bytes) for c in simulated.context_parallel
        )

    masked, planned = rows("masked")
    causal, expected = rows("causal")
    assert planned == expected and not causal.cp_note
    assert masked.cp_note.startswith("2 SDPA call(s) took an attention mask")
    assert "planned as causal" in masked.table()


def test_the_cli_plans_cp_and_refuses_a_bad_one_on_one_screen(tmp_path, monkeypatch, capsys):
    import json

    from aotdist.cli import main

    (tmp_path / "cp_model.py").write_text(
        "import torch\n"
        "from aotdist.testing.models import build_model\n\n"
        "def build():\n"
        "    return build_model('gpt', depth=2), (torch.randint(0, 64, (1, 32)),)\n"
    )
    monkeypatch.chdir(tmp_path)
    argv = ["plan", "--model", "cp_model:build", "--world", "32", "--cp", "16"]
    assert main([*argv, "--cp-rotate", "alltoall", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mesh"] == [2, 16] and out["cp"] == 16 and out["cp_rotate"] == "alltoall"
    assert {(c["phase"], c["kind"], c["network"]) for c in out["context_parallel"]} == {
        ("forward", "permute", True),
        ("backward", "permute", True),
    }
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "ring attention per step, cp 16, rotate allgather, 2 SDPA calls" in table
    assert "traced at 2 of 32 tokens" in table
    assert main([*argv[:-1], "3"]) == 2
    err = capsys.readouterr().err
    assert "cp 3 does not divide the 32 ranks" in err and "Fix:" in err
    assert "Traceback" not in err
