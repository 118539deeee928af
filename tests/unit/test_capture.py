"""``aotdist.capture``: each report field against a fact computed independently."""

from __future__ import annotations

import copy
import json
import math
import re

import pytest
import torch
from torch import nn

import aotdist
from aotdist.testing import TinyGPT, TinyResNet, example_inputs
from aotdist.testing.models import CountingBlock, GPTBlock, ReadAfterUpdateBlock

pytestmark = pytest.mark.timeout(300)


def _loss(out):
    return out.float().mean()


def _saved_by_autograd(model, x):
    """Count and bytes of the tensors the compiled step saves, seen by autograd's pack hook."""
    aotdist.compile_regions(model, backend="aot_eager")
    model(x)  # compile outside the hook
    packed = []

    def pack(t):
        packed.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    aotdist.restore(model)
    return len(packed), sum(packed)


def test_gpt_regions_call_sites_subgraphs_and_param_names():
    model = TinyGPT(depth=3)
    reference = copy.deepcopy(model)
    (x,), _ = example_inputs(model)
    cap = aotdist.capture(model, x, loss_fn=_loss)
    blocks = [f"blocks.{i}" for i in range(3)]
    region = cap.regions["GPTBlock"]
    assert region.call_sites == blocks
    assert region.num_subgraphs == 1 and len(region.forward) == 1 and len(region.backward) == 1
    assert isinstance(region.forward_gm, torch.fx.GraphModule)
    assert "def forward" in region.forward_code and "def forward" in region.backward_code
    # Every parameter of a block is an input of the subgraph, fed by each call site's own.
    own = {n for n, _ in model.blocks[0].named_parameters()}
    params = [i for i in region.forward[0].inputs if i["kind"] == "parameter"]
    assert {i["name"] for i in params} == own
    for inp in params:
        assert inp["sources"] == [f"{b}.{inp['name']}" for b in blocks]
        shape = list(model.get_submodule(blocks[0]).get_parameter(inp["name"]).shape)
        assert inp["shape"] == shape
    # The readable code says which tensor each input is (capture.md), in the forward and in
    # the backward, which saves some of them; the GraphModule keeps torch's placeholders.
    signature = region.forward_code.split("def forward(self, ")[1].split("\n")[0]
    assert re.findall(r"(\w+): \"", signature) == [
        "activation",
        *(n.replace(".", "_") for n, _ in model.blocks[0].named_parameters()),
    ]
    assert "ln1_weight" in region.backward_code
    assert not re.search(r"\bprimals_\d", region.forward_code + region.backward_code)
    assert any(n.name.startswith("primals_") for n in region.forward_gm.graph.nodes)
    # Top-level forward: every model parameter appears once, by its FQN; the tokens are input.
    fw = cap.graphs[0]
    assert fw.kind == "forward" and cap.graphs[1].kind == "backward"
    top_params = sorted(i["name"] for i in fw.inputs if i["kind"] == "parameter")
    assert top_params == sorted(n for n, _ in model.named_parameters())
    assert [i["kind"] for i in cap.graphs[1].inputs].count("tangent") == 1
    assert sum(1 for i in fw.inputs if i["kind"] == "input") == 1
    # Op counts: three invoke_subgraph calls in the forward graph.
    assert fw.op_counts["invoke_subgraph"] == 3
    assert "blocks_2_mlp_proj_bias" in fw.code.split("class ")[1]  # its own, not a subgraph's
    # The model is as it was: no marking left, no gradients, same weights as the reference.
    assert "_aotdist_state" not in vars(model) and type(model.blocks[0]).__bases__ == (nn.Module,)
    assert all(p.grad is None for p in model.parameters())
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


def test_frames_capture_of_a_sharded_model_reports_one_story(capsys):
    # `aotdist inspect --fsdp`: parallelize shards without compiling, capture compiles each
    # region's frame. Its metrics line read "mode graph ... 0 call sites, 0 distinct
    # subgraph(s)" above a table of "frames ... sites 4 subgr 1".
    from aotdist.testing.distributed import one_rank_group

    model = TinyGPT(depth=3)
    (x,), _ = example_inputs(model)
    with one_rank_group():
        aotdist.parallelize(
            model, config={"fsdp": {"enabled": True}, "compile": {"enabled": False}}
        )
        cap = aotdist.capture(model, x, loss_fn=_loss)
    region, st = cap.regions["GPTBlock"], cap.metrics.regions["GPTBlock"]
    assert cap.mode == cap.metrics.mode == "frames"
    assert region.call_sites == [f"blocks.{i}" for i in range(3)]
    assert (st.call_sites, st.subgraphs) == (3, region.num_subgraphs) == (3, 1), cap.summary()
    assert "mode frames" in cap.metrics.summary()
    assert "GPTBlock: 3 instances, 3 call sites, 1 distinct subgraph(s)" in cap.metrics.summary()
    assert "ln1_weight" in region.forward_code  # named relative to the block here too


def test_saved_for_backward_matches_autograd_pack_hook():
    model = TinyGPT(depth=2)
    (x,), _ = example_inputs(model)
    count, nbytes = _saved_by_autograd(copy.deepcopy(model), x)
    cap = aotdist.capture(model, x, loss_fn=_loss)
    fw = cap.graphs[0]
    assert (fw.saved_count, fw.saved_bytes) == (count, nbytes)
    # A region's saved tensors are forward-subgraph outputs beyond its one real output.
    sub = cap.regions["GPTBlock"].forward[0]
    assert sub.saved_count == len(sub.outputs) - 1
    assert sub.saved_bytes == sum(math.prod(o["shape"]) * 4 for o in sub.outputs[1:])


def test_resnet_regions_each_have_their_instances_as_call_sites():
    # Blocks of one class with different widths are different regions.
    # eval(): invoke_subgraph rejects BatchNorm's running-stat updates in training.
    model = TinyResNet(blocks_per_stage=3, widths=(8, 16)).eval()
    plan = aotdist.find_regions(model)
    (x,), _ = example_inputs(model)
    cap = aotdist.capture(model, x, loss_fn=_loss, plan=plan)
    for region in plan:
        assert cap.regions[region.name].call_sites == list(region.fqns)
        assert cap.regions[region.name].num_subgraphs == 1
    assert len(plan) >= 2


def test_num_subgraphs_counts_the_subgraphs_the_graph_calls():
    # The last block sees a shorter sequence: with torch 2.15 Dynamo inlines that call
    # instead of compiling a second subgraph. The report must say so, and count the
    # distinct subgraph modules the forward graph really calls.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(16, 16)  # a block fed the raw input is inlined by Dynamo
            self.blocks = nn.ModuleList(GPTBlock(16, 2) for _ in range(3))

        def forward(self, x):
            x = self.embed(x)
            for i, block in enumerate(self.blocks):
                x = block(x[:, :4] * 1 if i == 2 else x)
            return x

    cap = aotdist.capture(Net(), torch.randn(2, 8, 16), loss_fn=_loss)
    region = cap.regions["GPTBlock"]
    gm = cap.graphs[0].gm
    called = {
        id(getattr(gm, str(n.args[0].target)))
        for n in gm.graph.nodes
        if n.target is torch.ops.higher_order.invoke_subgraph
    }
    assert region.num_subgraphs == len(called) == len(region.forward) >= 1
    assert len(region.call_sites) + region.inlined == 3
    assert {tuple(g.inputs[0]["shape"]) for g in region.forward} <= {(2, 8, 16), (2, 4, 16)}


def test_a_block_dynamo_inlined_is_not_reported_as_a_call_site():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(GPTBlock(16, 2) for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    # blocks.0 is fed the raw graph input; torch 2.15 inlines its single-use trace,
    # torch 2.11 keeps it a call site. Either way the report must match the graph: the
    # call sites are exactly the invoke_subgraph calls, and the rest are inlined.
    cap = aotdist.capture(Net(), torch.randn(2, 8, 16), loss_fn=_loss)
    region = cap.regions["GPTBlock"]
    gm = cap.graphs[0].gm
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(region.call_sites) == len(calls)
    assert len(region.call_sites) + region.inlined == 3
    assert region.call_sites in (["blocks.1", "blocks.2"], ["blocks.0", "blocks.1", "blocks.2"])


def test_to_dict_is_json_and_save_writes_code(tmp_path):
    model = TinyGPT(depth=2)
    (x,), _ = example_inputs(model)
    cap = aotdist.capture(model, x, loss_fn=_loss)
    text = json.dumps(cap.to_dict())
    assert "GraphModule" not in text.split('"code"')[0]
    files = cap.save(tmp_path)
    names = {f.name for f in files}
    assert "capture.json" in names and "graph0.forward.py" in names
    assert any(n.startswith("GPTBlock.forward") for n in names)
    assert json.loads((tmp_path / "capture.json").read_text())["regions"]["GPTBlock"][
        "call_sites"
    ] == ["blocks.0", "blocks.1"]
    assert "invoke_subgraph" in (tmp_path / "graph0.forward.py").read_text()
    summary = cap.summary()
    assert re.search(r"GPTBlock\s+2\s+2\s+1\s", summary), summary


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count.add_(1)
        return self.fc(x)


def test_buffer_mutation_is_reported_and_undone():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(_Scale(), _Scale())

        def forward(self, x):
            return self.layers(x)

    model = Net()
    cap = aotdist.capture(model, torch.randn(2, 4), loss_fn=_loss, plan=aotdist.RegionPlan([]))
    data = {(m["input"], m["kind"]) for m in cap.mutations if m["graph"].endswith("forward")}
    assert data == {("layers.0.count", "data"), ("layers.1.count", "data")}
    assert all(float(m.count) == 0 for m in model.layers)


def test_unsupported_backend_and_foreign_plan_are_errors():
    model = TinyGPT(depth=2)
    (x,), _ = example_inputs(model)
    with pytest.raises(aotdist.ConfigError, match="aot_eager"):
        aotdist.capture(model, x, backend="eager")
    assert "_aotdist_state" not in vars(model)
    aotdist.compile_regions(model, backend="aot_eager")
    with pytest.raises(aotdist.ConfigError, match="plan"):
        aotdist.capture(model, x, plan=aotdist.find_regions(TinyGPT(depth=2)))


def test_capture_of_a_compiled_model_leaves_it_compiled():
    model = TinyGPT(depth=2)
    (x,), _ = example_inputs(model)
    aotdist.compile_regions(model, backend="aot_eager")
    with aotdist.metrics.track(model) as before:
        expected = model(x)
    cap = aotdist.capture(model, x, loss_fn=_loss)
    assert cap.regions["GPTBlock"].call_sites == ["blocks.0", "blocks.1"]
    with aotdist.metrics.track(model) as after:
        torch.testing.assert_close(model(x), expected)
    assert before.frames_compiled == 1 and after.frames_compiled == 0


def tiny_factory():
    """A zero-argument factory for ``aotdist inspect --model module:factory``."""
    return TinyGPT(depth=2)


def test_inspect_cli_prints_plan_and_summary_and_saves(tmp_path, capsys):
    from aotdist.cli import main

    assert main(["inspect", "--model", "gpt", "--depth", "3", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "blocks.{0..2}" in text and re.search(r"GPTBlock\s+3\s+3\s+1\s", text), text
    saved = json.loads((tmp_path / "capture.json").read_text())
    assert saved["regions"]["GPTBlock"]["call_sites"] == ["blocks.0", "blocks.1", "blocks.2"]
    assert (tmp_path / "GPTBlock.forward0.py").exists()
    assert main(["inspect", "--model", f"{__name__}:tiny_factory"]) == 0
    assert "(no built-in example inputs" not in capsys.readouterr().out


def test_capture_with_inductor_uses_the_options_of_compile_regions(monkeypatch):
    # One decision for every aotdist compile: capture's rebuilt Inductor gets the same
    # config patches (buffer reuse and aotdist's reuse pass) as compile_regions' Inductor wrapper.
    from aotdist import _compat
    from aotdist.backends.buffer_reuse import comparable_options
    from aotdist.backends.named import inductor_options, make_backend

    seen = []
    real = _compat.inductor_compile_fx

    def fake_compile_fx(gm, example_inputs, *, inner_compile, config_patches):
        seen.append(dict(config_patches))
        return _compat.lookup_backend("aot_eager")(gm, example_inputs)  # no C++ compile

    monkeypatch.setattr(_compat, "inductor_compile_fx", lambda: (fake_compile_fx, real()[1]))
    model = TinyGPT(depth=2)
    (x,), _ = example_inputs(model)
    aotdist.capture(model, x, loss_fn=_loss, backend="inductor")
    assert seen, "capture's inductor backend never ran"
    expected = make_backend("inductor", None, None, None).config
    common = inductor_options()
    for patches in seen:  # the same joint pass, then capture's storage-resize repair
        mine = str(comparable_options(patches).pop("joint_custom_pre_pass"))
        assert mine.index("aotdist.recompute_index_derived.v1") < mine.index(
            "aotdist.fix_storage_resizes.v1"
        )
        patches.pop("joint_custom_pre_pass")
        assert comparable_options(patches) == {
            k: v for k, v in comparable_options(common).items() if k != "joint_custom_pre_pass"
        }
        assert patches.get("allow_buffer_reuse") == expected.get("allow_buffer_reuse")


class _BreakingBlock(CountingBlock):
    """Breaks the graph inside its forward: a region that cannot be a reused subgraph."""

    def forward(self, x):
        out = torch.relu(self.lin(x))
        torch._dynamo.graph_break()
        return out + 1


def test_a_region_that_cannot_be_a_subgraph_is_demoted_and_reported():
    # capture must demote the region as compile_regions does, not crash
    model = nn.Sequential(nn.Linear(8, 8), *[_BreakingBlock() for _ in range(3)]).train()
    x = torch.randn(2, 8)
    stats = {n: b.clone() for n, b in model.named_buffers()}
    with pytest.warns(aotdist.RegionCompileWarning, match="cannot be a reusable subgraph"):
        cap = aotdist.capture(model, x, loss_fn=_loss)
    assert list(cap.demoted) == ["_BreakingBlock"]
    region = cap.regions["_BreakingBlock"]
    assert region.demoted == cap.demoted["_BreakingBlock"]
    assert region.call_sites == [] and "graph_break" in region.demoted
    assert "demoted: _BreakingBlock" in cap.summary()
    assert json.loads(json.dumps(cap.to_dict()))["demoted"] == cap.demoted
    assert "_aotdist_state" not in vars(model)  # unmarked again, buffers as before
    for n, b in model.named_buffers():
        torch.testing.assert_close(b, stats[n])


def test_a_region_reading_its_buffer_after_writing_it_stays_one_subgraph_in_capture():
    # the write runs on a copy in the region and is written back by the caller
    # (aotdist.fixes.hoist); capture reports it as the outer graph's buffer write
    model = nn.Sequential(nn.Linear(8, 8), *[ReadAfterUpdateBlock() for _ in range(3)]).train()
    x = torch.randn(2, 8)
    stats = {n: b.clone() for n, b in model.named_buffers()}
    cap = aotdist.capture(model, x, loss_fn=_loss)
    region = cap.regions["ReadAfterUpdateBlock"]
    assert not cap.demoted and (len(region.call_sites), region.num_subgraphs) == (3, 1), (
        cap.summary()
    )
    mutated = {m["input"] for m in cap.mutations if m["kind"] == "data"}
    assert {"1.seen", "2.seen", "3.seen"} <= mutated, cap.mutations
    for n, b in model.named_buffers():  # capture leaves the model's state as it was
        torch.testing.assert_close(b, stats[n])


def test_a_region_traced_once_per_instance_is_warned_and_reported_as_compile_regions_does():
    # two instances whose inputs differ (the first block's needs no gradient, the second's
    # does): two subgraphs used once each (torch 2.14+ inlines them); not silent
    model = nn.Sequential(CountingBlock(), CountingBlock()).eval()
    x = torch.randn(2, 8)
    with pytest.warns(aotdist.RegionCompileWarning, match="compiled 2 times, not once"):
        cap = aotdist.capture(model, x, loss_fn=_loss)
    region = cap.regions["CountingBlock"]  # inlined (2.14+) or two subgraphs (2.11)
    assert region.inlined + region.num_subgraphs == 2 and not cap.demoted, cap.summary()
    assert "requires_grad" in cap.metrics.reuse["CountingBlock"]
    assert "reuse: CountingBlock: 2 distinct subgraphs for 2 instances" in cap.summary()


def test_inspect_cli_on_resnet_in_train_mode_keeps_its_batchnorm_blocks(capsys):
    from aotdist.cli import main

    assert main(["inspect", "--model", "resnet", "--depth", "2"]) == 0  # built in train()
    text = capsys.readouterr().out
    assert "cannot be a reusable subgraph" not in text and "demoted" not in text, text


@pytest.mark.inductor
def test_capture_with_inductor_records_graphs_on_a_warm_compile_cache():
    # A second capture of the same model hits AOTAutograd's cache, which skips the graph
    # compiler where capture records: before the fix it reported 0 graphs, silently.
    model = TinyGPT(depth=2)
    (x,), _ = example_inputs(model)
    for attempt in range(2):
        cap = aotdist.capture(copy.deepcopy(model), x, loss_fn=_loss, backend="inductor")
        kinds = sorted(g["kind"] for g in cap.to_dict()["graphs"])
        assert kinds == ["backward", "forward"], (attempt, cap.summary())
