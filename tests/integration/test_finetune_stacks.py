"""The stacks people fine-tune with, built tiny from their configs: a diffusers DiT and peft
LoRA adapters on a frozen transformers Llama train as eager does over several SGD steps,
every region named (their classes define ``__getattr__``, so Dynamo spells their module
paths ``__dict__['_modules'][...]``) and every instance a call site of one subgraph."""

from __future__ import annotations

import copy
import importlib.util
import types
import warnings

import pytest
import torch

import aotdist
from aotdist import _compat, metrics
from aotdist.fixes import kernel_funcs
from aotdist.testing import assert_training_parity

STEPS = 3


def _train(model, batches, loss_fn=None):
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aotdist.compile_regions(model, backend="aot_eager")
        with metrics.track(model) as tracked:
            assert_training_parity(model, ref, batches, loss_fn=loss_fn)
    warned = [
        str(w.message) for w in caught if issubclass(w.category, aotdist.RegionCompileWarning)
    ]
    return tracked, warned


def _reused(tracked, region: str, count: int) -> None:
    assert set(tracked.regions) == {region}, tracked.summary()  # no <unknown>
    st = tracked.regions[region]
    assert (st.instances, st.call_sites, st.subgraphs) == (count, count, 1), tracked.summary()


def test_a_diffusers_dit_trains_as_eager_with_its_blocks_named():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=3,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
    ).train()
    g = torch.Generator().manual_seed(1)

    def batch():
        return (torch.randn(2, 4, 8, 8, generator=g), torch.tensor([1, 2]), torch.tensor([0, 1]))

    tracked, warned = _train(model, [batch() for _ in range(STEPS)])
    assert not warned, warned
    _reused(tracked, "BasicTransformerBlock", 3)


def test_a_diffusers_unet_has_the_blocks_it_declares_as_regions():
    """UNet2DConditionModel declares ``_repeated_blocks = ["BasicTransformerBlock"]``: those
    are its attention region (not the ``Transformer2DModel`` around each), as diffusers'
    ``compile_repeated_blocks()`` would compile them; its ResNet blocks are found as well."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    model = diffusers.UNet2DConditionModel(
        block_out_channels=(16, 32),
        layers_per_block=1,
        cross_attention_dim=16,
        attention_head_dim=4,
        norm_num_groups=8,
        sample_size=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    ).train()
    g = torch.Generator().manual_seed(1)

    def batch():
        return (torch.randn(2, 4, 8, 8, generator=g), torch.tensor([3, 7]), torch.randn(2, 5, 16))

    tracked, warned = _train(model, [batch() for _ in range(STEPS)])
    assert not warned, warned
    assert set(tracked.regions) == {"BasicTransformerBlock", "ResnetBlock2D"}, tracked.summary()
    for region, count in (("BasicTransformerBlock", 3), ("ResnetBlock2D", 2)):
        st = tracked.regions[region]
        assert (st.instances, st.call_sites, st.subgraphs) == (count, count, 1), tracked.summary()


def _lora_llama(layers: int = 4):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        use_cache=False,
    )
    base = transformers.LlamaForCausalLM(cfg)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, lora).train()
    for name, p in model.named_parameters():  # adapters start at zero: make them count
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def _token_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (2, 8), generator=g),) for _ in range(STEPS)]


def test_lora_on_a_frozen_llama_trains_as_eager_and_names_the_inlined_first_layer():
    # the first layer's input (a frozen embedding's output) needs no gradient: it compiles
    # once more, inline, and the warning says why and what the alternatives cost
    model = _lora_llama()
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora" not in n)
    tracked, warned = _train(model, _token_batches())
    st = tracked.regions["LlamaDecoderLayer"]
    # torch 2.14+ inlines a subgraph called once (the first layer's); 2.11 keeps it apart
    assert (st.instances, st.call_sites, st.subgraphs) in ((4, 3, 1), (4, 4, 2)), tracked.summary()
    assert tracked.num_graph_breaks == 0, tracked.summary()
    split = [w for w in warned if "'LlamaDecoderLayer'" in w]
    assert split and "requires_grad" in split[0], warned
    assert "frozen embedding" in split[0] and "enable_input_require_grads()" in split[0], split


def _kernel_func_stack(kernels, depth: int = 4) -> torch.nn.Module:
    """Blocks whose mixer calls a hub-replaceable function the way transformers 5.25's
    Llama attention calls ``apply_rotary_pos_emb``: ``kernels``' two decorators."""

    def rotate(x):
        return torch.cat([-x[..., 1::2], x[..., ::2]], dim=-1)

    rotate = kernels.use_kernel_forward_from_hub("AotdistTestRotate")(rotate)

    @kernels.use_kernelized_func(rotate)
    class Mixer(torch.nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.proj = torch.nn.Linear(dim, dim)

        def forward(self, x):
            return self.proj(rotate(x))

    class Block(torch.nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(dim)
            self.mix = Mixer(dim)

        def forward(self, x):
            return x + self.mix(self.norm(x)).tanh()

    torch.manual_seed(0)
    blocks = [Block(16) for _ in range(depth)]
    return torch.nn.Sequential(torch.nn.Linear(8, 16), *blocks, torch.nn.Linear(16, 1)).train()


def _side_effect_refusals(model) -> list[str]:
    refusals = vars(model)["_aotdist_state"].log.refusals
    return [why for code, why in refusals.items() if _compat.is_region_code(code, "Block")]


def test_hub_kernel_wrappers_keep_a_region_reused_and_traced_once(monkeypatch):
    # kernels' wrapper writes a context variable on every call; while compiling that is
    # a side effect, and torch then traces every instance again (about 90 ms a layer on
    # a transformers 5.25 Llama) before merging their bodies. aotdist runs the wrapped
    # forward while compiling, as kernels does for a function nothing kernelized.
    kernels = pytest.importorskip("kernels")
    model = _kernel_func_stack(kernels)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 8, generator=g),) for _ in range(STEPS)]
    tracked, warned = _train(model, batches)
    assert not warned, warned
    _reused(tracked, "Block", 4)
    assert all(type(b.mix)._aotdist_kf_base.__name__ == "Mixer" for b in list(model)[1:-1])
    assert _side_effect_refusals(model) == []
    aotdist.restore(model)
    assert {type(b.mix).__name__ for b in list(model)[1:-1]} == {"Mixer"}
    assert all("_aotdist_kf_base" not in vars(type(b.mix)) for b in list(model)[1:-1])

    # without the fix torch refuses its reuse check for the side effect (torch 2.14+
    # logs why; 2.11 traces every instance either way)
    monkeypatch.setattr(kernel_funcs, "swap", lambda module: [])
    unfixed = _kernel_func_stack(kernels)
    tracked, _ = _train(unfixed, batches)
    _reused(tracked, "Block", 4)  # torch still merges the traced bodies
    if importlib.util.find_spec("torch._dynamo.variables.invoke_subgraph") is not None:
        assert _side_effect_refusals(unfixed) == ["not eligible -- subgraph has side effects"]


def test_a_kernelized_function_keeps_kernels_routing():
    # an instance whose function kernelize replaced runs kernels' wrapper as written: the
    # kernel it routes to is what the user asked for
    kernels = pytest.importorskip("kernels")
    model = _kernel_func_stack(kernels, depth=2)
    mixer = model[1].mix
    (kernel,) = vars(mixer)["_kernel_funcs"].values()
    # what kernelize does: the instance gets a forward of its own
    kernel.forward = types.MethodType(lambda self, x: -x, kernel)
    assert kernel_funcs.swap(model[1]) == []
    assert kernel_funcs.swap(model[2]) == [model[2].mix]
    kernel_funcs.restore(model[2])
    assert "_aotdist_kf_base" not in vars(type(model[2].mix))


def test_lora_adapters_merged_then_unmerged_give_eager_logits_and_train_on():
    # peft's merge_adapter() folds B @ A into the frozen weights and flips each LoRA
    # layer's `merged` flag; unmerge_adapter() undoes both: the compiled model follows
    model = _lora_llama()
    ref = copy.deepcopy(model)
    batches = [*_token_batches(), *_token_batches()[:1]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", aotdist.RegionCompileWarning)
        aotdist.compile_regions(model, backend="aot_eager")
        assert_training_parity(model, ref, batches[:2])
        for m in (model, ref):
            m.merge_adapter()
            m.eval()
        (x,) = batches[2]
        with torch.no_grad():
            torch.testing.assert_close(model(x).logits, ref(x).logits, rtol=1e-5, atol=1e-6)
        for m in (model, ref):
            m.unmerge_adapter()
            m.train()
        assert_training_parity(model, ref, batches[2:])
    merged = [n for n, m in model.named_modules() if getattr(m, "merged", False)]
    assert not merged, merged


def test_transformers_default_kv_cache_under_fsdp2_is_named_with_its_fix(tmp_path):
    """transformers' default ``use_cache=True`` builds a KV cache in training; under FSDP2
    (one frame per layer) each layer's frame specialises on the index it writes the cache
    at. The warning says so and names ``model.config.use_cache = False``, which fixes it."""
    transformers = pytest.importorskip("transformers")
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        seen = {}
        for use_cache in (True, False):
            torch.manual_seed(0)
            cfg = transformers.LlamaConfig(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=3,
                num_attention_heads=2,
                num_key_value_heads=2,
                use_cache=use_cache,
            )
            model = transformers.LlamaForCausalLM(cfg).train()
            ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                aotdist.parallelize(
                    model,
                    config={"fsdp": {"enabled": True}, "compile": {"backend": "aot_eager"}},
                )
                with metrics.track(model) as tracked:
                    model(input_ids=ids, labels=ids).loss.backward()
            warned = [
                str(w.message)
                for w in caught
                if issubclass(w.category, aotdist.RegionCompileWarning)
            ]
            seen[use_cache] = (tracked.regions["LlamaDecoderLayer"].subgraphs, warned)
    finally:
        dist.destroy_process_group()
    subgraphs, warned = seen[True]
    assert subgraphs == 3 and len(warned) == 1, seen
    assert "KV cache" in warned[0] and "model.config.use_cache = False" in warned[0]
    assert seen[False] == (1, []), seen[False]
