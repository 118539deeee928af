"""Regional compile: parity with eager, invariants, failure handling, ordering errors."""

from __future__ import annotations

import contextlib
import copy
import operator
import pickle
import types
import warnings

import pytest
import torch
from saved_bytes import saved_activation_bytes
from torch import nn

import aotdist
from aotdist import _compat, metrics
from aotdist.backends.recording import RecordingBackend
from aotdist.testing import AliasingNet, TinyGPT, TinyResNet, TinyViT, example_inputs
from aotdist.testing.distributed import fake_world
from aotdist.testing.models import CountingBlock, GPTBlock, ReadAfterUpdateBlock
from aotdist.testing.parity import assert_parity, assert_training_parity

pytestmark = pytest.mark.timeout(300)


def _pair(model: nn.Module):
    """A model and an eager reference with identical weights; blocks differ from each other."""
    reference = copy.deepcopy(model)
    return model, reference


def _blocks_differ(model: nn.Module, plan) -> bool:
    first = [p for p in model.get_submodule(plan[0].fqns[0]).parameters()]
    second = [p for p in model.get_submodule(plan[0].fqns[1]).parameters()]
    return any(not torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize(
    "factory",
    [
        lambda: TinyGPT(depth=4),
        lambda: TinyViT(depth=3),
        lambda: TinyResNet(blocks_per_stage=3).eval(),
        lambda: AliasingNet(depth=3),
    ],
    ids=["gpt", "vit", "resnet-eval", "aliasing"],
)
def test_parity_with_eager(factory):
    model, reference = _pair(factory())
    plan = aotdist.find_regions(model)
    assert _blocks_differ(model, plan)
    aotdist.compile_regions(model, backend="aot_eager")
    (x,), _ = example_inputs(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", aotdist.RegionCompileWarning)
        with metrics.track(model) as m:
            assert_parity(model, reference, (x,))
            assert_parity(model, reference, (x * 0.5 if x.is_floating_point() else x,))
    assert m.graphs >= 1
    for name, stats in m.regions.items():
        if name in m.demoted:
            continue
        assert stats.call_sites == stats.instances, m.summary()
        assert stats.subgraphs == 1, m.summary()


def test_a_mechanism_running_one_blocks_weights_everywhere_fails_parity():
    """The parity check catches the failure mode aotdist exists to avoid."""
    model, reference = _pair(TinyGPT(depth=3))
    shared = model.blocks[0].forward
    for block in model.blocks:  # a wrong 'region' mechanism: every call runs block 0
        block.forward = shared
    (x,), _ = example_inputs(model)
    with pytest.raises(AssertionError):
        assert_parity(model, reference, (x,))


def test_each_call_site_feeds_its_own_parameters():
    """Structural check on the captured graph: no two call sites share weight inputs."""
    model = TinyGPT(depth=4)
    aotdist.compile_regions(model, backend="aot_eager")
    model._aotdist_state.backend.keep_graphs = True
    (x,), _ = example_inputs(model)
    model(x).sum().backward()
    records = metrics.model_records(model)
    assert len(records) == 1
    assert records[0].call_sites["GPTBlock"] == [f"blocks.{i}" for i in range(4)]
    invoke = torch.ops.higher_order.invoke_subgraph
    weight_inputs = []
    for node in records[0].gm.graph.nodes:
        if node.op == "call_function" and node.target is invoke:
            weight_inputs.append(
                {
                    a.name
                    for a in node.args[2:]
                    if isinstance(a, torch.fx.Node) and a.op == "placeholder"
                }
            )
    assert len(weight_inputs) == 4
    assert all(len(w) == 12 for w in weight_inputs)  # every GPTBlock parameter, lifted
    for i, wi in enumerate(weight_inputs):
        assert f"blocks_modules_{i}_" in " ".join(sorted(wi))
        for wj in weight_inputs[i + 1 :]:
            assert not wi & wj, "two call sites were fed the same parameters"


def test_naive_bound_method_marking_is_wrong_on_this_torch_and_aotdist_is_not():
    """Documents why aotdist swaps classes: binding a marked forward per instance
    lets Dynamo reuse the first block's weights (torch 2.15). If torch fixes this, the
    first half stops failing and the test says so."""
    naive, reference = _pair(TinyGPT(depth=3))
    from aotdist.compile.marking import copy_function  # never mark the shared class function

    fn = torch.compiler.nested_compile_region(copy_function(GPTBlock.forward))
    for block in naive.blocks:
        block.forward = types.MethodType(fn, block)
    naive.compile(backend="aot_eager")
    (x,), _ = example_inputs(naive)
    naive_ok = True
    try:
        assert_parity(naive, reference, (x,))
    except AssertionError:
        naive_ok = False
    torch._dynamo.reset()
    model, reference = _pair(TinyGPT(depth=3))
    aotdist.compile_regions(model, backend="aot_eager")
    assert_parity(model, reference, (x,))
    if naive_ok:
        pytest.skip("this torch reuses subgraphs correctly for bound-method marking too")


def test_state_dict_keys_and_parameters_unchanged():
    model = TinyGPT(depth=3)
    keys = list(model.state_dict())
    params = [(n, p) for n, p in model.named_parameters()]
    aotdist.compile_regions(model, backend="aot_eager")
    (x,), _ = example_inputs(model)
    model(x)
    assert list(model.state_dict()) == keys
    assert [(n, id(p)) for n, p in model.named_parameters()] == [(n, id(p)) for n, p in params]
    assert not any("_orig_mod" in k for k in model.state_dict())
    fresh = TinyGPT(depth=3)
    fresh.load_state_dict(model.state_dict())  # loads into an uncompiled model, strict
    model.load_state_dict(fresh.state_dict())  # and back


def test_hooks_still_run():
    model = TinyGPT(depth=3)
    calls: list[str] = []
    model.blocks[1].register_forward_pre_hook(lambda m, a: calls.append("pre"))
    model.blocks[1].register_forward_hook(lambda m, a, o: calls.append("fwd"))
    model.blocks[2].register_full_backward_hook(lambda m, gi, go: calls.append("bwd"))
    model.register_forward_hook(lambda m, a, o: calls.append("root"))
    model.blocks[0].mlp.fc.weight.register_hook(lambda g: calls.append("grad"))
    aotdist.compile_regions(model, backend="aot_eager")
    (x,), _ = example_inputs(model)
    for step in range(2):
        calls.clear()
        with aotdist.metrics.track(model) as m:
            model(x).sum().backward()
        assert sorted(calls) == sorted(["pre", "fwd", "root", "bwd", "grad"])
        # compiled at the first step (hooks break the graph), reused at the second
        assert (m.frames_compiled >= 1) if step == 0 else (m.frames_compiled == 0), m


def test_marking_does_not_leak_into_other_instances():
    model, other = TinyGPT(depth=2), TinyGPT(depth=2)
    aotdist.compile_regions(model, backend="aot_eager")
    assert type(other.blocks[0]) is GPTBlock
    assert GPTBlock.forward is GPTBlock.__dict__["forward"]
    assert not hasattr(GPTBlock.forward, "__marked_compile_region_config__")
    assert type(model.blocks[0]) is not GPTBlock and isinstance(model.blocks[0], GPTBlock)
    # The unmarked model compiled plainly inlines its blocks: no invoke_subgraph.
    recorder = RecordingBackend("aot_eager", plan=aotdist.find_regions(other))
    other.compile(backend=recorder)
    (x,), _ = example_inputs(other)
    other(x)
    assert recorder.records[0].call_sites == {}
    assert recorder.records[0].inlined == {"GPTBlock": {"blocks.0", "blocks.1"}}
    # Pickling a compiled model's block stores the user's class.
    clone = pickle.loads(pickle.dumps(model.blocks[0]))
    assert type(clone) is GPTBlock


def test_second_call_is_detected():
    model = TinyGPT(depth=2)
    aotdist.compile_regions(model, backend="aot_eager")
    with pytest.raises(aotdist.OrderingError, match="restore"):
        aotdist.compile_regions(model, backend="aot_eager")


def test_restore_returns_model_to_eager():
    model, reference = _pair(TinyGPT(depth=3))
    aotdist.compile_regions(model, backend="aot_eager")
    (x,), _ = example_inputs(model)
    model(x)
    assert aotdist.restore(model) is model
    assert type(model.blocks[0]) is GPTBlock and model._compiled_call_impl is None
    assert not hasattr(model, "_aotdist_state")
    assert_parity(model, reference, (x,))
    aotdist.compile_regions(model, backend="aot_eager")  # can be applied again
    assert_parity(model, reference, (x,))


class _Wrapper(_compat.CallWrapper):
    """A call wrapper as an integration installs one (Accelerate's first-call metrics)."""

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


class _Staying(_Wrapper):
    """A wrapper the model needs (graph-mode FSDP's shards): restore keeps it, over eager."""

    stays = True

    def __call__(self, *args, **kwargs):
        return (self.inner or self.eager)(*args, **kwargs)


def test_restore_undoes_every_wrapper_of_the_compiled_call():
    model, reference = _pair(TinyGPT(depth=2))
    aotdist.compile_regions(model, backend="aot_eager")
    guarded = _compat.compiled_call(model)
    staying = _compat.wrap_compiled_call(model, _Staying())
    staying.eager = _compat.call_impl(model)
    outer = _compat.wrap_compiled_call(model, _Wrapper())
    assert (outer.inner, staying.inner, guarded.inner) == (staying, guarded, None)
    (x,), _ = example_inputs(model)
    model(x)
    aotdist.restore(model)
    assert _compat.compiled_call(model) is staying and staying.inner is None
    assert_parity(model, reference, (x,))  # eager, through the wrapper that stays
    _compat.unwrap_compiled_call(model)  # nothing left to undo: the same
    assert _compat.compiled_call(model) is staying and staying.inner is None


def test_ordering_errors():
    wrapped = torch.compile(TinyGPT(depth=2), backend="eager")
    with pytest.raises(aotdist.OrderingError, match="_orig_mod"):
        aotdist.compile_regions(wrapped)
    model = TinyGPT(depth=2)
    model.compile(backend="eager")
    with pytest.raises(aotdist.OrderingError, match="model.compile"):
        aotdist.compile_regions(model)
    inner = TinyGPT(depth=2)
    inner.blocks[0] = torch.compile(inner.blocks[0], backend="eager")
    with pytest.raises(aotdist.OrderingError, match="blocks.0"):
        aotdist.compile_regions(inner)


def test_an_outer_torch_compile_of_a_compiled_model_is_refused_with_the_fix():
    # it once traced into aotdist's own call: 2 graph breaks, a Dynamo warning, no error
    model = aotdist.compile_regions(TinyGPT(depth=2), backend="aot_eager")
    outer = torch.compile(model, backend="eager")
    (x,), _ = example_inputs(model)
    with pytest.raises(aotdist.OrderingError, match="compiled already.*Fix: drop the outer"):
        outer(x)
    torch._dynamo.reset()  # the outer compile's frames, not to be seen by other tests


def test_model_compile_on_a_compiled_model_is_refused_and_restore_lifts_it():
    # nn.Module.compile() would replace aotdist's compiled call: once silently
    model = aotdist.compile_regions(TinyGPT(depth=2), backend="aot_eager")
    with pytest.raises(aotdist.OrderingError, match="compiled already.*model.compile()"):
        model.compile(backend="eager")
    (x,), _ = example_inputs(model)
    with metrics.track(model) as m:
        model(x)
    assert m.regions["GPTBlock"].call_sites == 2, m.summary()  # aotdist's call still runs
    aotdist.restore(model)
    assert "compile" not in vars(model)  # nn.Module.compile again
    model.compile(backend="eager")
    model(x)
    torch._dynamo.reset()


def test_a_model_class_with_its_own_compile_method_keeps_it():
    class Compiles(TinyGPT):
        def compile(self, *args, **kwargs):  # a user method of the same name
            return "own"

    model = aotdist.compile_regions(Compiles(depth=2), backend="aot_eager")
    assert model.compile() == "own" and "compile" not in vars(model)


def test_bad_backend_arguments():
    with pytest.raises(aotdist.ConfigError, match="unknown compile backend"):
        aotdist.compile_regions(TinyGPT(depth=2), backend="no_such_backend")
    with pytest.raises(aotdist.ConfigError, match="named backends"):
        aotdist.compile_regions(TinyGPT(depth=2), backend=lambda gm, ex: gm, mode="max-autotune")


def test_plan_from_another_model_is_rejected():
    plan = aotdist.find_regions(TinyGPT(depth=4))
    with pytest.raises(aotdist.ConfigError, match="does not fit"):
        aotdist.compile_regions(TinyGPT(depth=2), plan=plan, backend="aot_eager")


def test_aliasing_output_is_fixed_with_a_warning():
    model, reference = _pair(AliasingNet(depth=3))
    aotdist.compile_regions(model, backend="aot_eager")
    (x,), _ = example_inputs(model)
    with pytest.warns(aotdist.RegionCompileWarning, match="'AliasingBlock'.*aliases"):
        with metrics.track(model) as m:
            assert_parity(model, reference, (x,))
    assert m.fixes == {"AliasingBlock": "clone_aliasing_outputs"}
    assert m.regions["AliasingBlock"].call_sites == 3 and m.regions["AliasingBlock"].subgraphs == 1


class _Rotated(nn.Module):
    """GPT-J's attention in miniature: ``sin`` and ``cos`` are two halves of one tensor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, sin, cos):
        return x + torch.tanh(self.lin(x * cos + x.flip(-1) * sin))


class _RotatedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(16))
        self.blocks = nn.ModuleList([_Rotated() for _ in range(3)])

    def forward(self, x):
        sin, cos = torch.split(torch.sin(self.pos).expand(x.shape[0], 16), 8, dim=-1)
        for block in self.blocks:
            x = block(x, sin, cos)
        return x


def test_inputs_that_share_storage_are_cloned_before_the_region_and_keep_reuse():
    # invoke_subgraph rejects inputs that alias each other; before the clone the region
    # was demoted (transformers' GPT-J and CodeGen).
    torch.manual_seed(0)
    model, reference = _pair(_RotatedNet())
    aotdist.compile_regions(model, backend="aot_eager")
    x = torch.randn(4, 8, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with metrics.track(model) as m:
            assert_parity(model, reference, (x,), rtol=0, atol=0)
    texts = [str(w.message) for w in caught if issubclass(w.category, aotdist.RegionCompileWarning)]
    assert m.fixes == {"_Rotated": "clone_aliasing_outputs"} and not m.demoted, m.summary()
    assert m.regions["_Rotated"].call_sites == 3 and m.regions["_Rotated"].subgraphs == 1
    assert not m.regions["_Rotated"].inlined and not m.reuse, m.summary()
    assert len(texts) == 1 and "inputs share storage" in texts[0], texts


class _Breaking(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent branch: cannot be one subgraph
            return self.fc(x)
        return -self.fc(x)


class _BreakingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(_Breaking(8) for _ in range(3))
        self.good = nn.ModuleList(GPTBlock(8, 2) for _ in range(2))

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        for g in self.good:
            x = g(x.unsqueeze(1)).squeeze(1)
        return x


def test_graph_breaking_region_is_demoted_with_a_warning_others_still_reused():
    model, reference = _pair(_BreakingNet())
    aotdist.compile_regions(model, backend="aot_eager")
    x = torch.randn(4, 8)
    with pytest.warns(aotdist.RegionCompileWarning, match="'_Breaking'.*branching"):
        with metrics.track(model) as m:
            assert_parity(model, reference, (x,))
    assert list(m.demoted) == ["_Breaking"]
    assert m.regions["_Breaking"].call_sites == 0
    # The data-dependent branch breaks the root graph inside the loop, so Dynamo compiles
    # each later block call as a frame of its own: still one graph for both instances.
    assert m.frames_compiled > 1, m.summary()
    assert m.regions["GPTBlock"].call_sites == 0
    assert m.regions["GPTBlock"].standalone_graphs == 1, m.summary()
    assert_parity(model, reference, (-x,))  # the other branch, still correct


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_batchnorm_training_region_is_reused_and_its_running_stats_follow_eager(momentum):
    net = TinyResNet(widths=(8, 16), blocks_per_stage=3)
    # the regions' BatchNorms only: one outside a region (the stem, the one downsampling
    # block) graph-breaks on float(num_batches_tracked) with momentum=None in torch.compile
    for block in (b for stage in net.stages for b in stage if b.downsample is None):
        block.bn1.momentum = block.bn2.momentum = momentum
    model, reference = _pair(net)
    aotdist.compile_regions(model, backend="aot_eager")
    (x,), _ = example_inputs(model)
    tracked = []
    for step in (1, 2):
        with warnings.catch_warnings(record=True) as caught, metrics.track(model) as m:
            warnings.simplefilter("always")
            assert_parity(model, reference, (x * step,))
        assert not [w for w in caught if issubclass(w.category, aotdist.RegionCompileWarning)]
        assert not m.demoted and not m.recompiles, m.summary()
        tracked.append(m)
        for (n, b), (_, r) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
            torch.testing.assert_close(b, r, msg=f"buffer {n}")
    # one subgraph per stage's block shape, every instance a call site
    stats = sorted((st.call_sites, st.subgraphs) for st in tracked[0].regions.values())
    assert stats == [(2, 1), (3, 1)], tracked[0].summary()
    assert model.stages[0][0].bn1.num_batches_tracked.item() == 2
    aotdist.restore(model)
    assert type(model.stages[0][0].bn1) is nn.BatchNorm2d


def test_a_region_reading_its_buffer_after_updating_it_stays_one_subgraph_and_correct():
    # the update runs on a copy made in the region, written back by each call site
    model, reference = _pair(
        nn.Sequential(nn.Linear(4, 4), *[ReadAfterUpdateBlock(4) for _ in range(3)])
    )
    aotdist.compile_regions(model, backend="aot_eager")
    batches = [(torch.randn(2, 4),) for _ in range(3)]
    with warnings.catch_warnings(), metrics.track(model) as m:
        warnings.simplefilter("error", aotdist.RegionCompileWarning)
        assert_training_parity(model, reference, batches)  # buffers compared every step
    region = m.regions["ReadAfterUpdateBlock"]
    assert not m.demoted and (region.call_sites, region.subgraphs) == (3, 1), m.summary()


@pytest.mark.parametrize("grad_mode", ["detached", "no_grad"])
def test_a_buffer_update_in_training_leaves_the_region_which_stays_reused(grad_mode):
    class Block(CountingBlock):  # torchtitan's MoE counts tokens per expert this way
        def forward(self, x):
            out = torch.relu(self.lin(x))
            if self.training:
                with torch.no_grad() if grad_mode == "no_grad" else contextlib.nullcontext():
                    counts = torch.histc(out.detach().float(), bins=4, min=0, max=1)
                    self.seen.add_(counts * self.seen.new_ones(()))
            return out

    model, reference = _pair(nn.Sequential(nn.Linear(4, 4), *[Block(4) for _ in range(3)]))
    aotdist.compile_regions(model, backend="aot_eager")
    batches = [(torch.randn(2, 4),) for _ in range(3)]
    with warnings.catch_warnings(record=True) as caught, metrics.track(model) as m:
        warnings.simplefilter("always")
        assert_training_parity(model, reference, batches)  # buffers compared every step
    assert not [w for w in caught if issubclass(w.category, aotdist.RegionCompileWarning)]
    assert (m.regions["Block"].call_sites, m.regions["Block"].subgraphs) == (3, 1), m.summary()
    assert model[1].seen.sum() > 0


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_buffer_update_leaves_the_region_with_inductor():
    model, reference = _pair(nn.Sequential(nn.Linear(4, 4), *[CountingBlock(4) for _ in range(3)]))
    aotdist.compile_regions(model, backend="inductor")
    with metrics.track(model) as m:
        assert_training_parity(
            model, reference, [(torch.randn(2, 4),) for _ in range(2)], rtol=1e-3, atol=1e-5
        )
    assert (m.regions["CountingBlock"].call_sites, m.regions["CountingBlock"].subgraphs) == (3, 1)


def test_no_regions_warns_and_still_compiles():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.warns(aotdist.RegionCompileWarning, match="no repeated regions"):
        aotdist.compile_regions(model, backend="aot_eager")
    x = torch.randn(2, 4)
    out = model(x)
    records = vars(model)["_aotdist_state"].backend.records  # graphs the backend compiled
    assert len(records) == 1 and records[0].call_sites == {}  # one plain graph, no regions
    torch.testing.assert_close(out, model[1](model[0](x)))


def test_no_recompiles_across_steps():
    model = TinyGPT(depth=3)
    aotdist.compile_regions(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (x,), _ = example_inputs(model)
    model(x).sum().backward()
    opt.step()
    with metrics.track(model) as m:
        for _ in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    assert m.frames_compiled == 0 and m.recompiles == [] and m.graphs == 0


def test_metrics_attribute_call_sites_when_the_root_is_a_sequential():
    model = nn.Sequential(nn.Linear(8, 8), GPTBlock(8, 2), GPTBlock(8, 2), GPTBlock(8, 2))
    aotdist.compile_regions(model, backend="aot_eager")
    with metrics.track(model) as m:
        model(torch.randn(2, 4, 8)).sum().backward()
    assert "<unknown>" not in m.regions, m.summary()
    assert m.regions["GPTBlock"].call_sites == 3 and m.regions["GPTBlock"].subgraphs == 1


def test_inductor_options_install_the_reuse_pass_and_keep_buffer_reuse_on():
    from aotdist.backends.named import _without_reuse_pass, make_backend

    config = make_backend("inductor", None, None, None).config
    assert config["allow_buffer_reuse"] is True
    assert config["post_grad_custom_post_pass"].uuid() == "aotdist.forward_aliased_outputs.v2"
    # layout optimization off by default (the torch bug in test_external_models.py), the
    # user's choice kept
    assert config["layout_optimization"] is False
    on = make_backend("inductor", None, {"layout_optimization": True}, None).config
    assert on["layout_optimization"] is True
    # the user can still turn reuse off (then no pass), and chain a pass of their own
    off = make_backend("inductor", None, {"allow_buffer_reuse": False}, None).config
    assert off["allow_buffer_reuse"] is False and "post_grad_custom_post_pass" not in off
    mine = lambda graph: None  # noqa: E731
    if not aotdist._compat.inductor_takes_pass_lists():  # torch 2.11: one post-grad pass
        with pytest.raises(aotdist.ConfigError, match="allow_buffer_reuse': False"):
            make_backend("inductor", None, {"post_grad_custom_post_pass": mine}, None)
        return
    chained = make_backend("inductor", None, {"post_grad_custom_post_pass": mine}, None).config
    passes = chained["post_grad_custom_post_pass"]
    assert passes[0] is mine and passes[1].uuid() == "aotdist.forward_aliased_outputs.v2"
    with (
        pytest.warns(aotdist.RegionCompileWarning, match="allow_buffer_reuse"),
        _without_reuse_pass(),
    ):
        bare = make_backend("inductor", None, {"allow_buffer_reuse": True}, None).config
    assert "post_grad_custom_post_pass" not in bare


def test_graph_fsdp_options_reach_inductor():
    """fsdp.bucket_mb / fsdp.overlap: the options inductor_options decides carry the
    bucketing pass and Inductor's overlap keys, as the config patches of Inductor's
    wrapper (scoped to this model's compiles); Inductor accepts every key."""
    from aotdist import _compat
    from aotdist.backends.bucketing import bucketing_pass, is_bucketing_pass
    from aotdist.backends.named import graph_fsdp_backend, inductor_options, overlap_options

    def passes(opts):  # a list, one pass, or (torch 2.11's one slot) aotdist's chain
        p = opts.get("post_grad_custom_post_pass")
        p = list(p) if isinstance(p, (list, tuple)) else [] if p is None else [p]
        return [q for x in p for q in getattr(x, "passes", [x])]

    overlap = overlap_options()
    assert overlap and all(k in _compat.inductor_config_keys() for k in overlap)
    scheduler = "aten_distributed_optimizations.enable_overlap_scheduling"
    assert overlap.get(scheduler) is True  # torch 2.11 and 2.15 have the scheduler
    # bucketing alone: aotdist's pass, with its cap in the cache key
    opts = inductor_options({"max_autotune": False}, bucket_mb=25.0, overlap=False)
    assert opts["max_autotune"] is False
    bucketing = [p for p in passes(opts) if is_bucketing_pass(p)]
    assert len(bucketing) == 1 and bucketing[0].bucket_mb == 25.0
    assert bucketing[0].uuid() != bucketing_pass(30.0).uuid()  # the cap is in the cache key
    assert not any(k in opts for k in overlap)
    # completing again (compile_regions does) adds nothing
    again = inductor_options(opts)
    assert len([p for p in passes(again) if is_bucketing_pass(p)]) == 1
    assert passes(again) == passes(opts)
    # overlap with a bucket cap: the scheduler reorders after the post-grad pass, which
    # breaks aotdist's merged collectives, so the pass is left out, saying so
    with pytest.warns(aotdist.ConfigWarning, match="fsdp.overlap.*unbucketed"):
        both = inductor_options(None, bucket_mb=25.0, overlap=True)
    assert {k: both[k] for k in overlap} == overlap
    assert not any(is_bucketing_pass(p) for p in passes(both))
    # overlap without a cap: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", aotdist.ConfigWarning)
        alone = inductor_options(None, bucket_mb=None, overlap=True)
    assert {k: alone[k] for k in overlap} == overlap
    # off: no pass, no overlap keys
    plain = inductor_options(None, bucket_mb=None, overlap=False)
    assert not any(is_bucketing_pass(p) for p in passes(plain))
    assert not any(k in plain for k in overlap)
    # the wrapper torch.compile uses takes them (it checks every key against the config)
    wrapper = _compat_wrapper(both)
    assert {k: wrapper.config[k] for k in overlap} == overlap
    # graph mode on CUDA: overlap; on CPU overlap is left off with a warning, bucketing stays
    with pytest.warns(aotdist.ConfigWarning, match="unbucketed"):
        backend, cuda_opts = graph_fsdp_backend(
            "inductor", None, bucket_mb=25.0, overlap=True, device_type="cuda"
        )
    assert backend == "inductor" and {k: cuda_opts[k] for k in overlap} == overlap
    with pytest.warns(aotdist.ConfigWarning, match="fsdp.overlap.*no effect"):
        _, cpu_opts = graph_fsdp_backend(
            "inductor", None, bucket_mb=25.0, overlap=True, device_type="cpu"
        )
    assert not any(k in cpu_opts for k in overlap)
    assert any(is_bucketing_pass(p) for p in passes(cpu_opts))
    # aot_eager: a backend that buckets in its graph compilers, named aot_eager
    backend, none = graph_fsdp_backend(
        "aot_eager", None, bucket_mb=25.0, overlap=False, device_type="cpu"
    )
    assert callable(backend) and none is None and backend.compiler_name == "aot_eager"
    assert graph_fsdp_backend(
        "aot_eager", None, bucket_mb=None, overlap=False, device_type="cpu"
    ) == ("aot_eager", None)


def test_aotdist_s_rebuilt_pipeline_keeps_graph_mode_bucketing(monkeypatch):
    """Graph-mode FSDP with aot_eager buckets its collectives in its own graph compiler.
    A graph that aotdist sends through its rebuilt AOTAutograd pipeline (a region with
    complex tensors, a resized storage, aotdist inspect's capture) kept the plain
    aot_eager, so its collectives went unbucketed without a word."""
    from aotdist.backends import bucketing
    from aotdist.backends.aot import aot_backend

    seen = []

    def counting(gm, bucket_mb, **kwargs):
        seen.append(bucket_mb)

    monkeypatch.setattr(bucketing, "bucket_collectives", counting)
    rebuilt = aot_backend(bucketing.bucketing_aot_eager(3.0))
    x = torch.randn(4, requires_grad=True)
    torch.compile(lambda t: (t.sin() * 2).sum(), backend=rebuilt, fullgraph=True)(x).backward()
    assert seen == [3.0, 3.0]  # the forward graph and the backward graph


def _compat_wrapper(options):
    from aotdist import _compat

    return _compat.inductor_wrapper(None, options, None)


def test_bucket_collectives_merges_independent_collectives():
    """The FX pass on a traced graph of functional collectives (no process group needed:
    the graph is only transformed and counted): 4 all-gathers -> 1, 4 reduce-scatters -> 1,
    a cap below two parameters keeps them apart."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from aotdist import _compat
    from aotdist.backends.bucketing import bucket_collectives, count_collectives

    funcol = _compat.functional_collectives()
    ag = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    rs = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor

    def step(a, b, c, d, g):
        import torch.distributed as dist

        group = dist.group.WORLD
        full = [funcol.wait_tensor(ag(t, 0, group)) for t in (a, b, c, d)]
        y = sum((f * g).sum() for f in full)
        grads = [funcol.wait_tensor(rs(f * y, "avg", 0, group)) for f in full]
        return full, grads

    def traced():
        inputs = [torch.randn(4, 8) for _ in range(4)] + [torch.randn(8, 8)]
        return make_fx(step, tracing_mode="fake")(*inputs)

    with fake_world(2):  # the merge asks the group for this rank
        gm = traced()
        assert count_collectives(gm) == {"all_gather": 4, "reduce_scatter": 4, "all_reduce": 0}
        assert bucket_collectives(gm, 100.0) == {
            "all_gather": 1,
            "reduce_scatter": 1,
            "all_reduce": 0,
        }
        gm.graph.lint()
        # each gathered tensor is 8x8 fp32 = 256 B: a 300 B cap holds one per bucket
        small = traced()
        assert bucket_collectives(small, 300 / 2**20) == {
            "all_gather": 4,
            "reduce_scatter": 4,
            "all_reduce": 0,
        }


def _region_call_graph(out_of_sub):
    """An outer graph calling one subgraph ``sub(x, w)`` whose outputs are
    ``(x * w, out_of_sub(x))``, unpacked by ``getitem`` and used after the call."""
    sub_graph = torch.fx.Graph()
    x, w = sub_graph.placeholder("x"), sub_graph.placeholder("w")
    prod = sub_graph.call_function(torch.ops.aten.mul.Tensor, (x, w))
    sub_graph.output((prod, out_of_sub(sub_graph, x)))
    root = nn.Module()
    root.sub = torch.fx.GraphModule(nn.Module(), sub_graph)
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    sub = graph.get_attr("sub")
    call = graph.call_function(torch.ops.higher_order.invoke_subgraph, (sub, "sub", a, b))
    out0 = graph.call_function(operator.getitem, (call, 0))
    saved = graph.call_function(operator.getitem, (call, 1))
    total = graph.call_function(torch.ops.aten.add.Tensor, (out0, saved))
    graph.output(total)
    return torch.fx.GraphModule(root, graph)


def test_reuse_pass_forwards_a_region_output_that_is_its_input():
    from aotdist.backends.buffer_reuse import forward_aliased_outputs

    gm = _region_call_graph(lambda g, x: x)
    report = forward_aliased_outputs(gm.graph)
    assert report.forwarded == ["getitem_1"] and report.views == []
    add = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor)
    assert add.args[1].name == "a"  # the outer argument, not the region's output
    gm.graph.eliminate_dead_code()
    gm.recompile()
    a, b = torch.randn(3), torch.randn(3)
    assert torch.equal(gm(a, b), a * b + a)
    # a graph without the pattern is left alone
    plain = _region_call_graph(lambda g, x: g.call_function(torch.ops.aten.neg.default, (x,)))
    before = str(plain.graph)
    assert forward_aliased_outputs(plain.graph).forwarded == []
    assert str(plain.graph) == before


def test_reuse_pass_turns_buffer_reuse_off_for_a_graph_with_a_view_it_cannot_replay():
    import torch._inductor.config as inductor_config

    from aotdist.backends.buffer_reuse import forward_aliased_outputs, reuse_pass

    def view(g, x):
        return g.call_function(torch.ops.aten.view.default, (x, [3]))

    gm = _region_call_graph(view)  # no fake values on its nodes: nothing to check a replay by
    before = str(gm.graph)
    report = forward_aliased_outputs(gm.graph)
    assert report.views == ["getitem_1"] and report.forwarded == report.replayed == []
    assert str(gm.graph) == before  # not rewritten
    the_pass = reuse_pass()
    prior = inductor_config.allow_buffer_reuse
    with inductor_config.patch(allow_buffer_reuse=True):  # what compile_fx does per graph
        the_pass(gm.graph)
        assert inductor_config.allow_buffer_reuse is False
    assert inductor_config.allow_buffer_reuse == prior  # scoped to that one graph
    assert the_pass.reports[-1].views == ["getitem_1"]


def _with_fake_values(gm, *shapes):
    """``meta["val"]`` on every node of ``gm``'s outer graph, as a post-grad graph has."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    fake = FakeTensorMode()
    FakeTensorProp(gm, fake).propagate(*(fake.from_tensor(torch.empty(s)) for s in shapes))
    return gm


def test_reuse_pass_replays_a_view_of_an_input_on_the_outer_argument():
    import torch._inductor.config as inductor_config

    from aotdist.backends.buffer_reuse import forward_aliased_outputs, reuse_pass

    def double_transpose(g, x):  # what a linear layer's region saves of its weight
        t = g.call_function(torch.ops.aten.permute.default, (x, [1, 0]))
        return g.call_function(torch.ops.aten.permute.default, (t, [1, 0]))

    gm = _with_fake_values(_region_call_graph(double_transpose), (2, 3), (2, 3))
    report = forward_aliased_outputs(gm.graph)
    assert report.replayed == ["getitem_1"] and report.views == report.forwarded == []
    add = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor)
    replayed = add.args[1]
    assert replayed.target is torch.ops.aten.permute.default
    assert replayed.args[0].target is torch.ops.aten.permute.default
    assert replayed.args[0].args[0].name == "a"  # views of the outer argument
    assert replayed.meta["val"].stride() == (3, 1)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    assert torch.equal(gm(a, b), a * b + a)
    the_pass = reuse_pass()  # buffer reuse stays on for a graph whose views all replay
    with inductor_config.patch(allow_buffer_reuse=True):
        the_pass(_with_fake_values(_region_call_graph(double_transpose), (2, 3), (2, 3)).graph)
        assert inductor_config.allow_buffer_reuse is True
    assert the_pass.reports[-1].replayed == ["getitem_1"]


@pytest.mark.parametrize("recompute", [True, False], ids=["aotdist", "torch-default"])
def test_regions_save_no_more_for_backward_than_a_whole_model_compile(recompute, monkeypatch):
    """Min-cut partitioning (aot_eager_decomp_partition: Inductor's partitioner, no
    codegen). A region's body is partitioned on its own; with torch's default (no
    recomputed reductions) it saves each LayerNorm's mean and rstd next to its input, one
    per-row statistic more per norm than the whole-model graph saves, so aotdist saved
    more than full compile. With reductions recomputable in region graphs it saves less,
    and the gradients still match eager."""
    if not recompute:
        monkeypatch.setattr(aotdist._compat, "recomputable_reductions", contextlib.nullcontext)
    backend = "aot_eager_decomp_partition"
    torch.manual_seed(0)
    model, reference = _pair(TinyGPT(depth=4))
    full = copy.deepcopy(model)
    (x,), _ = example_inputs(model, generator=torch.Generator().manual_seed(0))
    aotdist.compile_regions(model, backend=backend)
    compiled_full = torch.compile(full, backend=backend)
    assert_parity(model, reference, (x,))
    model.zero_grad(set_to_none=True)
    ours = saved_activation_bytes(model, x)
    theirs = saved_activation_bytes(full, x, compiled_full)
    assert torch._functorch.config.ban_recompute_reductions  # restored after the compile
    if recompute:
        assert ours <= theirs, (ours, theirs)
    else:  # the gap this fixes, still there in torch: else this test proves nothing
        assert ours > theirs, (ours, theirs)
