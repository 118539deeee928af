"""aotdist on models it did not write: torchvision ViT and ResNet-18, a transformers Llama.

Every model is built from its constructor or config with random weights (no download),
and every repeated block has its own random weights, so a region mechanism that fed
one block's weights to all blocks would break parity. ``_assert_blocks_differ`` checks
that premise for each model: loading block 0's weights into every block changes the
output.

Observed with torch 2.15 (see the individual tests for details):

* torchvision ViT, train mode: the first encoder block gets its own subgraph, because
  its input is contiguous while the later blocks' inputs carry the transposed strides
  that ``nn.MultiheadAttention(batch_first=True)`` produces; Dynamo then inlines that
  single-use subgraph (``torch._dynamo.config.inline_single_use_invoke_subgraph``). So
  the metrics show 2 call sites + 1 inlined instance, 1 subgraph. In eval mode under
  ``no_grad`` (MHA fast path, contiguous outputs) all 3 blocks call one subgraph.
* transformers Llama: the decoder layers differ only in ``LlamaAttention.layer_idx``, a
  user-module attribute the structural signature leaves out, so they form one region and
  compile to one subgraph.
* inductor: with Inductor's buffer reuse the reused region's saved input is overwritten
  (silently wrong gradients, a torch 2.15 bug); aotdist's post-grad pass
  (``aotdist.backends.buffer_reuse``) makes reuse safe, and a strict xfail test compiling
  without that pass tracks the bug.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from torch import nn

import aotdist
import aotdist.compile.state
import aotdist.metrics
from aotdist import Region, RegionCompileWarning, RegionPlan
from aotdist.regions import structural_signature
from aotdist.testing import TinyGPT, example_inputs
from aotdist.testing.distributed import one_rank_group
from aotdist.testing.parity import assert_parity

VIT_FQNS = tuple(f"encoder.layers.encoder_layer_{i}" for i in range(3))
LLAMA_FQNS = tuple(f"lm.model.layers.{i}" for i in range(3))


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _caught_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def _region_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RegionCompileWarning)]


def _assert_blocks_differ(model: nn.Module, fqns, args) -> None:
    """The blocks' weights differ, and running block 0's weights everywhere changes the output.

    This is what makes the parity tests able to catch a region mechanism that feeds the
    first block's parameters to every call site.
    """
    sds = [model.get_submodule(f).state_dict() for f in fqns]
    for other, fqn in zip(sds[1:], fqns[1:], strict=True):
        float_keys = [k for k, v in sds[0].items() if v.is_floating_point() and v.numel() > 1]
        assert float_keys, "blocks have no weights to compare"
        assert any(not torch.equal(sds[0][k], other[k]) for k in float_keys), (
            f"{fqn} has the same weights as {fqns[0]}; parity could not detect weight mix-ups"
        )
    wrong = copy.deepcopy(model)
    for fqn in fqns[1:]:
        wrong.get_submodule(fqn).load_state_dict(sds[0])
    with torch.no_grad():
        good, bad = model(*args), wrong(*args)
    assert (good - bad).abs().max() > 1e-3, (
        "running block 0's weights in every block does not change the output"
    )


def _assert_blocks_got_gradients(model: nn.Module, fqns) -> None:
    """Each block received a non-zero gradient (else gradient parity would prove nothing)."""
    for fqn in fqns:
        grads = [p.grad for p in model.get_submodule(fqn).parameters() if p.grad is not None]
        assert grads and any(g.abs().max() > 0 for g in grads), f"{fqn} got no gradient"


def _stats(m: aotdist.metrics.CompileMetrics, name: str) -> aotdist.metrics.RegionStats:
    assert name in m.regions, f"no stats for region {name!r}: {m.summary()}"
    assert "<unknown>" not in m.regions, f"unattributed invoke_subgraph calls: {m.summary()}"
    return m.regions[name]


# --------------------------------------------------------------------------- torchvision ViT


def _vit() -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    model = VisionTransformer(
        image_size=32,
        patch_size=8,
        num_layers=3,
        num_heads=2,
        hidden_dim=32,
        mlp_dim=64,
        num_classes=10,
    )
    # torchvision zero-initialises the classifier head: the output would be all zeros and
    # every gradient upstream of it zero, so parity would hold for any wrong encoder.
    with torch.no_grad():
        model.heads.head.weight.normal_(0.0, 0.2)
        model.heads.head.bias.normal_(0.0, 0.2)
    return model


@pytest.mark.timeout(60)
def test_vit_regions_inside_ordered_dict_sequential():
    from torchvision.models.vision_transformer import EncoderBlock

    model = _vit()
    # The blocks live in an nn.Sequential built from an OrderedDict (named children).
    assert isinstance(model.encoder.layers, nn.Sequential)
    plan = aotdist.find_regions(model)
    assert len(plan) == 1, str(plan)
    (region,) = plan
    assert region.module_type is EncoderBlock
    assert region.name == "EncoderBlock"
    assert region.fqns == VIT_FQNS
    assert region.count == 3


@pytest.mark.timeout(180)
def test_vit_train_parity_and_metrics():
    model = _vit().train()
    # Dropout defaults to 0 in torchvision's ViT, so train mode is deterministic.
    assert model.dropout == 0.0 and model.attention_dropout == 0.0
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, nn.Dropout))
    assert all(m.dropout == 0.0 for m in model.modules() if isinstance(m, nn.MultiheadAttention))
    x = torch.randn(2, 3, 32, 32)
    reference = copy.deepcopy(model)
    _assert_blocks_differ(reference, VIT_FQNS, (x,))

    aotdist.compile_regions(model, backend="aot_eager")
    with _caught_warnings() as caught, aotdist.metrics.track(model) as m:
        assert_parity(model, reference, (x,))
    _assert_blocks_got_gradients(model, VIT_FQNS)
    assert _region_warnings(caught) == [] and "EncoderBlock" not in m.reuse, m.summary()
    assert m.graph_breaks == {}, m.summary()
    assert m.recompiles == [] and m.failures == [], m.summary()
    assert m.demoted == {} and m.fixes == {}, m.summary()
    st = _stats(m, "EncoderBlock")
    # Each block returns its output in the transposed layout MultiheadAttention
    # (batch_first=True) computes, strides (32, 64, 1), where encoder_layer_0's input is
    # contiguous (544, 32, 1): invoke_subgraph reuse compares strides, so block 0 was
    # traced apart. aotdist returns a region's residual stream contiguous while compiling,
    # so all three blocks call one subgraph, on every torch.
    assert (st.instances, st.call_sites, st.subgraphs, st.inlined) == (3, 3, 1, 0), m.summary()

    # A second step reuses the compiled graph: no recompile.
    with aotdist.metrics.track(model) as m2:
        assert_parity(model, reference, (torch.randn(2, 3, 32, 32),))
    assert m2.frames_compiled == 0 and m2.recompiles == [], m2.summary()


@pytest.mark.timeout(120)
def test_vit_under_fsdp2_hooks_compiles_each_block_frame_once():
    # The README's `accelerate launch` recipe: FSDP2 hooks mode, each region one compiled
    # frame. The frame's residual stream leaves in MultiheadAttention's transposed layout,
    # so block 0 (contiguous input) and blocks 1-2 compiled two frames, and the user was
    # told to call .contiguous() inside torchvision; aotdist returns it contiguous itself.
    model = _vit().train()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 32, 32)
    with one_rank_group():
        aotdist.parallelize(
            model, config={"fsdp": {"enabled": True}, "compile": {"backend": "aot_eager"}}
        )
        with _caught_warnings() as caught, aotdist.metrics.track(model) as m:
            out = model(x)
            out.sum().backward()
        ref = reference(x)
        ref.sum().backward()
        torch.testing.assert_close(out, ref)
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)
    assert _region_warnings(caught) == [] and m.reuse == {}, m.summary()
    st = _stats(m, "EncoderBlock")
    assert (m.mode, st.call_sites, st.standalone_graphs) == ("frames", 3, 1), m.summary()


def _compiled_eval_matches(model: nn.Module, block_fqns) -> aotdist.metrics.CompileMetrics:
    """Compiles ``model`` in eval mode and checks one no-grad forward against eager: same
    output, no region warning but a named reuse loss, no graph break. Returns the forward's metrics."""
    model = model.eval()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 32, 32)
    _assert_blocks_differ(reference, block_fqns, (x,))
    aotdist.compile_regions(model, backend="aot_eager")
    with _caught_warnings() as caught, aotdist.metrics.track(model) as m, torch.no_grad():
        out = model(x)
        ref = reference(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    # A region compiled more than once (block 0's input layout, on torch 2.11) is named
    # in a warning and in metrics.reuse; nothing else may warn.
    unexplained = [w for w in _region_warnings(caught) if "' is compiled " not in w]
    assert unexplained == []
    assert sorted(m.reuse) == sorted(
        w.split("'")[1] for w in _region_warnings(caught) if "' is compiled " in w
    )
    assert m.graph_breaks == {}, m.summary()
    return m


def _assert_two_layouts_reuse(st, m) -> None:
    """Three instances whose first input layout differs from the other two: each instance
    is a call site or inlined, and at most two traces (the later blocks share one)."""
    assert st.call_sites + st.inlined == 3, m.summary()
    assert 1 <= st.subgraphs and st.subgraphs + st.inlined <= 2, m.summary()


@pytest.mark.timeout(120)
def test_vit_eval_no_grad_reuses_one_subgraph_for_all_blocks():
    # Under no_grad in eval mode, torch 2.15's MultiheadAttention returns contiguous
    # outputs, so every block sees the same input strides and all three call one subgraph
    # (3, 1, 0). torch 2.11's returns the transposed layout as in training, so block 0
    # gets a subgraph of its own (3, 2, 0): the same promise as in training.
    m = _compiled_eval_matches(_vit(), VIT_FQNS)
    st = _stats(m, "EncoderBlock")
    _assert_two_layouts_reuse(st, m)
    assert st.call_sites == 3 and st.inlined == 0, m.summary()


# --------------------------------------------------------------------------- torchvision ResNet-18


def _resnet() -> nn.Module:
    from torchvision.models import resnet18

    return resnet18(num_classes=10)


@pytest.mark.timeout(60)
def test_resnet18_regions():
    from torchvision.models.resnet import BasicBlock

    model = _resnet()
    plan = aotdist.find_regions(model)
    # Only layer1's two blocks are identical. layerN.0 (N > 1) has a downsample and
    # layerN.1 has its stage's width: each of those is a class of one, below
    # min_repeats=2.
    assert len(plan) == 1, str(plan)
    (region,) = plan
    assert region.module_type is BasicBlock
    assert region.name == "BasicBlock"
    assert region.fqns == ("layer1.0", "layer1.1")
    sig = {
        f: structural_signature(model.get_submodule(f))
        for f in ("layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer3.1", "layer4.1")
    }
    assert sig["layer1.0"] == sig["layer1.1"] == region.signature
    singletons = [sig[f] for f in ("layer2.0", "layer2.1", "layer3.1", "layer4.1")]
    assert len(set(singletons)) == 4 and region.signature not in singletons
    assert not any(f.startswith(("layer2", "layer3", "layer4")) for f in plan.fqns)


@pytest.mark.timeout(180)
def test_resnet18_train_keeps_its_batchnorm_blocks_reused_with_eager_s_running_stats():
    model = _resnet().train()
    reference = copy.deepcopy(model)
    aotdist.compile_regions(model, backend="aot_eager")
    for step in (1, 2):
        x = torch.randn(2, 3, 32, 32)
        with _caught_warnings() as caught, aotdist.metrics.track(model) as m:
            assert_parity(model, reference, (x,))
        assert _region_warnings(caught) == [] and m.demoted == {}, m.summary()
        if step == 1:
            _assert_blocks_got_gradients(model, ("layer1.0", "layer1.1"))
            st = _stats(m, "BasicBlock")
            assert (st.call_sites, st.subgraphs, st.inlined) == (2, 1, 0), m.summary()
            assert m.graph_breaks == {}, m.summary()
        # BatchNorm running stats advanced once per step, as in eager.
        assert model.layer1[0].bn1.num_batches_tracked.item() == step
        ref_buffers = dict(reference.named_buffers())
        for name, buf in model.named_buffers():
            torch.testing.assert_close(
                buf,
                ref_buffers[name],
                rtol=1e-4,
                atol=1e-5,
                msg=lambda s, n=name: f"buffer {n} differs: {s}",
            )


@pytest.mark.timeout(120)
def test_resnet18_eval_no_grad_compiles_region_as_subgraph():
    m = _compiled_eval_matches(_resnet(), ("layer1.0", "layer1.1"))
    assert m.demoted == {}, m.summary()
    st = _stats(m, "BasicBlock")
    assert (st.call_sites, st.subgraphs, st.inlined) == (2, 1, 0), m.summary()


# --------------------------------------------------------------------------- transformers Llama


class _Logits(nn.Module):
    """Returns only the logits, without a KV cache."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


def _llama(attn_implementation: str = "sdpa") -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn_implementation,
    )
    model = _Logits(transformers.LlamaForCausalLM(config))
    assert model.lm.config._attn_implementation == attn_implementation
    return model


@pytest.mark.timeout(60)
def test_llama_regions_are_the_decoder_layers():
    model = _llama()  # skips without transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    plan = aotdist.find_regions(model)
    assert [(r.module_type, r.fqns) for r in plan] == [(LlamaDecoderLayer, LLAMA_FQNS)], str(plan)


@pytest.mark.timeout(60)
def test_llama_decoder_layers_differ_only_in_layer_idx():
    # The only difference between the layers is a user-module attribute, which the
    # structural signature leaves out (it used to split the layers into singletons).
    model = _llama()
    layers = [model.get_submodule(f) for f in LLAMA_FQNS]
    diffs = set()
    for mods in zip(*(layer.named_modules() for layer in layers), strict=True):
        names = {n for n, _ in mods}
        assert len(names) == 1
        attrs = [
            {k: v for k, v in vars(m).items() if isinstance(v, (int, float, str, bool))}
            for _, m in mods
        ]
        diffs |= {(mods[0][0], k) for k in attrs[0] if any(a.get(k) != attrs[0][k] for a in attrs)}
    assert diffs == {("self_attn", "layer_idx")}


@pytest.mark.timeout(180)
def test_llama_default_plan_parity_and_metrics():
    model = _llama()
    plan = aotdist.find_regions(model)
    assert len(plan) == 1 and plan[0].count == 3, str(plan)
    name = plan[0].name
    assert name == "LlamaDecoderLayer"
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16))
    _assert_blocks_differ(reference, plan[0].fqns, (ids,))
    aotdist.compile_regions(model, backend="aot_eager")
    with _caught_warnings() as caught, aotdist.metrics.track(model) as m:
        assert_parity(model, reference, (ids,))
    _assert_blocks_got_gradients(model, plan[0].fqns)
    assert _region_warnings(caught) == []
    assert m.graph_breaks == {} and m.recompiles == [], m.summary()
    st = _stats(m, name)
    assert (st.call_sites, st.subgraphs, st.inlined) == (3, 1, 0), m.summary()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_llama_decoder_layer_plan_parity_and_metrics(attn_implementation):
    model = _llama(attn_implementation)  # skips without transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    # An explicit plan works too (and is what find_regions now finds by itself).
    # Dynamo's reuse guards still check anything layer_idx would change.
    plan = RegionPlan([Region("LlamaDecoderLayer", LlamaDecoderLayer, LLAMA_FQNS, "explicit")])
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 16))
    _assert_blocks_differ(reference, LLAMA_FQNS, (ids,))
    aotdist.compile_regions(model, plan=plan, backend="aot_eager")
    # The layers get position_embeddings (a tuple) and attention_mask/position_ids
    # keywords; reuse still works.
    with _caught_warnings() as caught, aotdist.metrics.track(model) as m:
        assert_parity(model, reference, (ids,))
    _assert_blocks_got_gradients(model, LLAMA_FQNS)
    assert _region_warnings(caught) == []
    assert m.graph_breaks == {} and m.recompiles == [], m.summary()
    assert m.demoted == {} and m.fixes == {}, m.summary()
    st = _stats(m, "LlamaDecoderLayer")
    assert (st.call_sites, st.subgraphs, st.inlined) == (3, 1, 0), m.summary()


# --------------------------------------------------------------------------- inductor


def _tinygpt_inductor_parity(options, *, check_pass=False, outer="auto"):
    model = TinyGPT(depth=2)
    reference = copy.deepcopy(model)
    args, _ = example_inputs(model)
    _assert_blocks_differ(reference, ("blocks.0", "blocks.1"), args)
    aotdist.compile_regions(model, backend="inductor", options=options, outer=outer)
    with _caught_warnings() as caught, aotdist.metrics.track(model) as m:
        assert_parity(model, reference, args, rtol=1e-3, atol=1e-4)
    _assert_blocks_got_gradients(model, ("blocks.0", "blocks.1"))
    if check_pass:
        _assert_reuse_pass_forwarded(model)
    return m, _region_warnings(caught)


def _assert_reuse_pass_forwarded(model):
    """Where aotdist installs its buffer-reuse pass, it rewrote the reused block's saved
    input (the pattern behind the torch bug) and replayed the views of its inputs it saves
    (torch 2.15: 8 weight transposes in TinyGPT's forward), so no graph needed buffer
    reuse off."""
    config = vars(model)[aotdist.compile.state.STATE_ATTR].backend.inner.config
    assert config["allow_buffer_reuse"] is True
    reports = config["post_grad_custom_post_pass"].reports
    assert sum(len(r.forwarded) for r in reports) >= 1, reports
    assert all(r.views == [] for r in reports), reports


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tinygpt_inductor_end_to_end():
    # Buffer reuse on (Inductor's default): with torch 2.15 the outer graph would reuse
    # the storage of blocks.0's output (which blocks.1's partitioned forward returns as
    # a saved activation), so blocks.1's LayerNorm weight gradient would come out wrong;
    # aotdist's post-grad pass forwards that output to the argument it aliases. See
    # test_tinygpt_inductor_buffer_reuse_torch_bug.
    # (Inductor's caches off: a cache hit would skip the pass, whose work is checked; torch
    # 2.11's torch.compile refuses the force_disable_caches option: the pass runs, unchecked)
    try:
        torch.compile(lambda x: x, backend="inductor", options={"force_disable_caches": True})
        can_disable = True
    except RuntimeError:  # "Unexpected optimization option"
        can_disable = False
    m, region_warnings = _tinygpt_inductor_parity(
        {"force_disable_caches": True} if can_disable else {}, check_pass=can_disable
    )
    assert region_warnings == []
    assert m.graph_breaks == {} and m.recompiles == [] and m.failures == [], m.summary()
    st = _stats(m, "GPTBlock")
    assert (st.call_sites, st.subgraphs, st.inlined) == (2, 1, 0), m.summary()


# The single-process TinyGPT reproduction: torch 2.15 (checked) shows the bug there, 2.11
# does not (2.11 shows it in graph-mode FSDP instead: docs/internals.md,
# aotdist/backends/buffer_reuse.py).
_TINYGPT_SHOWS_BUG = torch.torch_version.TorchVersion(torch.__version__) >= (2, 12)


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.xfail(
    _TINYGPT_SHOWS_BUG,
    strict=True,
    raises=AssertionError,
    reason=(
        "torch >= 2.12 (checked: 2.15) inductor: buffer reuse overwrites a reused "
        "invoke_subgraph's saved input (gradient of blocks.1.ln1.weight wrong by ~70%)"
    ),
)
def test_tinygpt_inductor_buffer_reuse_torch_bug():
    """Buffer reuse on *without* aotdist's post-grad pass reproduces the torch bug.

    Strict xfail on torch 2.15: when it starts passing there (XPASS fails), torch has
    fixed it and aotdist's buffer-reuse pass (installed by
    ``aotdist.backends.named.inductor_options`` on every torch) can be gated. On torch
    2.11 this model does not show the bug: the same run must match eager (its
    reproduction there is graph-mode FSDP's Inductor parity test).
    """
    from aotdist.backends.named import _without_reuse_pass

    # the bug is in Inductor's buffer planning of the whole lowered graph (compile.outer:
    # inductor); with region bodies compiled on their own (fx) no buffer crosses a call
    with pytest.warns(RegionCompileWarning, match="allow_buffer_reuse"), _without_reuse_pass():
        m, region_warnings = _tinygpt_inductor_parity(
            {"allow_buffer_reuse": True}, outer="inductor"
        )
    st = _stats(m, "GPTBlock")
    assert (st.call_sites, st.subgraphs, st.inlined) == (2, 1, 0), m.summary()


# --------------------------------------------------------------------------- convolutions + inductor


class _ConvNeXtStage(nn.Module):
    """A stem convolution feeding torchvision's ConvNeXt blocks (``CNBlock``), so the first
    block takes a convolution's output of the whole-model graph and the others take a
    block's output (layer scale 1, not ConvNeXt's 1e-6, so the blocks' weights show)."""

    def __init__(self, dim: int = 16, depth: int = 3):
        from torchvision.models.convnext import CNBlock

        super().__init__()
        self.stem = nn.Conv2d(3, dim, kernel_size=4, stride=4)
        self.blocks = nn.Sequential(*[CNBlock(dim, 1.0, 0.0) for _ in range(depth)])
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


_CNBLOCK_FQNS = ("blocks.0", "blocks.1", "blocks.2")


def _convnext_inductor_parity(options, memory_format=torch.contiguous_format, outer="auto"):
    torch.manual_seed(0)
    model = _ConvNeXtStage().to(memory_format=memory_format)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 16, 16).to(memory_format=memory_format)
    _assert_blocks_differ(reference, _CNBLOCK_FQNS, (x,))
    aotdist.compile_regions(model, backend="inductor", options=options, outer=outer)
    with _caught_warnings() as caught, aotdist.metrics.track(model) as m:
        assert_parity(model, reference, (x,), rtol=1e-3, atol=1e-4)
    _assert_blocks_got_gradients(model, _CNBLOCK_FQNS)
    return m, _region_warnings(caught)


@pytest.mark.inductor
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "memory_format",
    [torch.contiguous_format, torch.channels_last],
    ids=["contiguous", "channels_last"],
)
def test_convnext_blocks_after_a_convolution_train_with_inductor(memory_format):
    """A reused region whose first call site takes a convolution's output trains with
    Inductor: aotdist compiles with Inductor's layout optimization off (see
    test_convnext_inductor_layout_optimization_torch_bug), on every torch."""
    pytest.importorskip("torchvision")
    m, region_warnings = _convnext_inductor_parity(None, memory_format)
    assert region_warnings == []
    assert m.graph_breaks == {} and m.recompiles == [] and m.failures == [], m.summary()
    st = _stats(m, "CNBlock")
    assert (st.call_sites, st.subgraphs, st.inlined) == (3, 1, 0), m.summary()


@pytest.mark.inductor
@pytest.mark.timeout(300)
@pytest.mark.xfail(
    strict=True,
    raises=(AssertionError, RuntimeError),
    reason=(
        "torch 2.11-2.14 inductor: layout optimization saves the stem convolution's output "
        "channels-last for backward while the reused CNBlock's backward subgraph was compiled "
        "for a contiguous input (2.14: InductorError 'subgraph args must have consistent "
        "values', 2.11: a stride assert)"
    ),
)
def test_convnext_inductor_layout_optimization_torch_bug():
    """Layout optimization on (Inductor's default, which aotdist turns off) reproduces the
    torch bug. Strict xfail: when it passes (XPASS fails), torch has fixed it and
    ``aotdist.backends.named.inductor_options`` can leave the option alone there. The
    whole graph lowered (``compile.outer: inductor``): that is where layout optimization
    picks the stem's output layout."""
    pytest.importorskip("torchvision")
    _convnext_inductor_parity({"layout_optimization": True}, outer="inductor")


@pytest.mark.timeout(120)
def test_llama_dynamic_sequence_lengths_one_graph_one_subgraph_as_eager():
    """``dynamic=True`` over varying sequence lengths: the first call compiles one graph in
    which every decoder layer calls one subgraph; other lengths compile nothing more, and
    each length trains as eager does."""
    model = _llama()
    reference = copy.deepcopy(model)
    aotdist.compile_regions(model, backend="aot_eager", dynamic=True)
    for i, length in enumerate((16, 24, 40, 56)):
        ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(i))
        with _caught_warnings() as caught, aotdist.metrics.track(model) as m:
            assert_parity(model, reference, (ids,))
        if i == 0:
            st = _stats(m, "LlamaDecoderLayer")
            assert (m.graphs, st.call_sites) == (1, 3), m.summary()
            # torch 2.11 traces the first layer apart (its input's symbolic strides differ):
            # the recording backend merges it back, with the input copied to that layout
            assert st.subgraphs == 1 and not _region_warnings(caught), m.summary()
        else:
            assert m.graphs == 0 and not m.recompiles, (length, m.summary())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sliding_window_model_with_its_default_cache_says_to_turn_it_off():
    """Phi-3 called as users call it in training (``use_cache`` left at its default, True):
    the cache's sliding-window layers keep a view of the keys, which torch cannot return
    from a reused subgraph; the layers compile inline, train as eager, and the warning
    names the fix, with which the layers share one subgraph."""
    transformers = pytest.importorskip("transformers")
    from aotdist.check.tiny_config import hf_config

    config = hf_config("phi3", sliding_window=8)
    config.use_cache = True
    for use_cache in (None, False):  # None: the config's default, as users call it
        torch.manual_seed(0)
        lm = transformers.AutoModelForCausalLM.from_config(config).train()
        reference = copy.deepcopy(lm)
        aotdist.compile_regions(lm, backend="aot_eager")
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        kwargs = {} if use_cache is None else {"use_cache": use_cache}
        with _caught_warnings() as caught, aotdist.metrics.track(lm) as m:
            got = lm(input_ids=ids, labels=ids, **kwargs).loss
            got.backward()
        want = reference(input_ids=ids, labels=ids, **kwargs).loss
        torch.testing.assert_close(got, want)
        st = _stats(m, "Phi3DecoderLayer")
        if use_cache is None:
            assert "use_cache=False" in " ".join(_region_warnings(caught)), m.summary()
        else:
            assert (st.call_sites, st.subgraphs) == (3, 1) and not _region_warnings(caught)
