"""What a compiled backward recomputes: values a region computes from integer or boolean
inputs alone (attention masks) are recomputed in its backward, not saved once per call
site; a checkpointed region call's output that the next one takes is saved."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aotdist.backends import recompute
from aotdist.backends.recompute import is_recompute_pass, recompute_pass, tag_index_derived


def _joint_like_graph() -> torch.fx.Graph:
    """primals: a bool mask and float activations; the mask becomes a float bias."""
    g = torch.fx.Graph()
    mask = g.placeholder("primals_1")
    mask.meta["val"] = torch.zeros(2, 4, dtype=torch.bool)
    x = g.placeholder("primals_2")
    x.meta["val"] = torch.zeros(2, 4)
    tangent = g.placeholder("tangents_1")
    tangent.meta["val"] = torch.zeros(2, 4, dtype=torch.bool)
    aten = torch.ops.aten
    zero = g.call_function(aten.full.default, ([], 0.0), {"dtype": torch.float32})
    ninf = g.call_function(aten.full.default, ([], float("-inf")), {"dtype": torch.float32})
    bias = g.call_function(aten.where.self, (mask, zero, ninf))
    wide = g.call_function(aten.expand.default, (bias, [2, 4]))
    mixed = g.call_function(aten.add.Tensor, (x, wide))  # reads a float input: not derived
    soft = g.call_function(aten._softmax.default, (mixed, -1, False))
    from_tangent = g.call_function(aten.logical_not.default, (tangent,))  # not a primal
    g.output((soft, from_tangent))
    return g


def test_only_cheap_ops_of_index_inputs_are_tagged():
    from torch.utils.checkpoint import CheckpointPolicy

    g = _joint_like_graph()
    assert tag_index_derived(g) == ["where_self", "expand_default"]
    nodes = {n.name: n for n in g.nodes}
    assert nodes["where_self"].meta["recompute"] == CheckpointPolicy.PREFER_RECOMPUTE
    for name in (
        "full_default",
        "full_default_1",
        "add_tensor",
        "_softmax_default",
        "logical_not_default",
    ):
        assert "recompute" not in nodes[name].meta, name  # constants, float work, backward


def test_a_users_checkpoint_tag_wins():
    from torch.utils.checkpoint import CheckpointPolicy

    g = _joint_like_graph()
    where = next(n for n in g.nodes if n.name == "where_self")
    where.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    assert tag_index_derived(g) == ["expand_default"]
    assert where.meta["recompute"] == CheckpointPolicy.MUST_SAVE


def test_every_aotdist_inductor_compile_carries_the_pass_once():
    from aotdist.backends.named import inductor_options

    def ours(options):
        slot = options["joint_custom_pre_pass"]
        flat = slot if isinstance(slot, list) else [slot]
        flat = [p for q in flat for p in getattr(q, "passes", [q])]
        return [p for p in flat if is_recompute_pass(p)]

    once = inductor_options({})
    assert len(ours(once)) == 1
    assert len(ours(inductor_options(once))) == 1  # completing again adds nothing


def test_the_checkpoint_boundaries_pass_runs_after_inductor_s_joint_passes_once():
    """In the post slot: Inductor's own joint passes remove a copy as a no-op, so the
    boundary copies are added after them, just before the partitioner."""
    from aotdist.backends.named import inductor_options

    def uuids(options):
        slot = options.get("joint_custom_post_pass")
        flat = slot if isinstance(slot, list) else [slot]
        return [p.uuid() for q in flat for p in getattr(q, "passes", [q]) if p is not None]

    once = inductor_options({})
    assert uuids(once) == ["aotdist.checkpoint_boundaries.v1"]
    assert uuids(inductor_options(once)) == ["aotdist.checkpoint_boundaries.v1"]


def _checkpointed_calls_graph() -> torch.fx.Graph:
    """Two checkpointed multi-output calls (region calls), the first's output 0 the
    second's input, as Dynamo tags them (``ac_graph_id`` 1, 2)."""
    from torch.utils.checkpoint import CheckpointPolicy

    g = torch.fx.Graph()
    x = g.placeholder("primals_1")
    x.meta["val"] = torch.empty(2, 3)
    calls = []
    prev = x
    for ac_id in (1, 2):
        call = g.call_function(torch.ops.aten.split_with_sizes.default, (prev, [1, 1], 0))
        out = g.call_function(operator.getitem, (call, 0))
        for n in (call, out):
            n.meta.update(recompute=CheckpointPolicy.PREFER_RECOMPUTE, ac_graph_id=ac_id)
        out.meta["val"] = torch.empty(1, 3)
        calls.append((call, out))
        prev = out
    g.output([prev])
    return g, calls


def test_a_checkpointed_call_s_output_taken_by_a_later_one_is_saved_through_a_copy():
    from torch.utils.checkpoint import CheckpointPolicy

    from aotdist.backends.recompute import save_checkpoint_boundaries

    g, ((_, first_out), (second, _)) = _checkpointed_calls_graph()
    assert save_checkpoint_boundaries(g) == [first_out.name]
    copy = second.args[0]
    assert copy.target is torch.ops.aten.clone.default and copy.args == (first_out,)
    assert copy.meta["recompute"] is CheckpointPolicy.MUST_SAVE
    assert save_checkpoint_boundaries(g) == []  # once


class MaskedAttention(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.out(y.transpose(1, 2).reshape(b, s, d))


class MaskedStack(nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)  # the blocks' input needs a gradient in each
        self.blocks = nn.ModuleList(MaskedAttention() for _ in range(depth))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        mask = keep[:, None, None, :] & torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        for block in self.blocks:
            x = block(x, mask)
        return x


@pytest.mark.inductor
@pytest.mark.timeout(300)
def test_a_boolean_mask_is_saved_once_not_as_a_float_bias_per_layer(monkeypatch):
    """SDPA turns the boolean mask into a float bias in every layer. Without the pass each
    region call saved its own bias for backward (4 here, 4x the mask's bytes each); with
    it the one boolean mask is saved and gradients equal eager. The pass's tags on the
    graph around the regions leave that graph to ``default_partition`` (min-cut there
    cost about 23 ms per region call site)."""
    import aotdist
    from aotdist.backends import partition

    decisions = []
    original = partition.saves_what_backward_needs

    def spy(joint):
        decisions.append(
            (original(joint), any(recompute.AOTDIST_POLICY in n.meta for n in joint.graph.nodes))
        )
        return decisions[-1][0]

    monkeypatch.setattr(partition, "saves_what_backward_needs", spy)

    torch.manual_seed(0)
    eager, model = MaskedStack(4), MaskedStack(4)
    model.load_state_dict(eager.state_dict())
    assert not torch.equal(eager.blocks[0].qkv.weight, eager.blocks[1].qkv.weight)
    x = torch.randn(2, 32, 16)
    keep = torch.ones(2, 32, dtype=torch.bool)
    keep[1, 24:] = False
    aotdist.compile_regions(model, backend="inductor")
    model(x, keep).sum().backward()  # compile
    model.zero_grad()
    seen = []

    def pack(t):
        seen.append((tuple(t.shape), t.dtype, t.untyped_storage().data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x, keep)
    out.sum().backward()
    eager(x, keep).sum().backward()
    square = {
        (ptr, dtype) for shape, dtype, ptr in seen if shape[-2:] == (32, 32) and shape[1] == 1
    }
    assert {dtype for _, dtype in square} == {torch.bool} and len(square) == 1, seen
    torch.testing.assert_close(out, eager(x, keep))
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert (True, True) in decisions, decisions  # the tagged graph around the regions


def test_a_users_joint_pass_runs_first_and_keeps_its_slot_where_it_cannot_be_chained():
    import aotdist
    from aotdist import _compat
    from aotdist.backends.named import add_joint_pass

    class Mine(_compat.custom_graph_pass_base()):
        def __call__(self, graph):
            pass

        def uuid(self):
            return "mine.v1"

    def uuids(slot):
        flat = slot if isinstance(slot, list) else [slot]
        return [p.uuid() for q in flat for p in getattr(q, "passes", [q])]

    options = {"joint_custom_pre_pass": Mine()}
    add_joint_pass(options, recompute_pass())
    assert uuids(options["joint_custom_pre_pass"]) == [
        "mine.v1",
        "aotdist.recompute_index_derived.v1",
    ]
    plain = {"joint_custom_pre_pass": lambda graph: None}
    if _compat.inductor_takes_pass_lists():  # torch 2.14+: a list
        add_joint_pass(plain, recompute_pass())
        assert len(plain["joint_custom_pre_pass"]) == 2
    else:  # torch 2.11: one slot, and a plain function has no uuid to chain under
        with pytest.warns(aotdist.ConfigWarning, match="is left out"):
            add_joint_pass(plain, recompute_pass())
        assert callable(plain["joint_custom_pre_pass"])
