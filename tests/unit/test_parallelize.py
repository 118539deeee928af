"""``aotdist.parallelize`` in one process: compile, activation checkpointing, Float8, errors.

FSDP2 needs a process group: see tests/distributed/test_parallelize.py.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import aotdist
from aotdist import ConfigError, ConfigWarning, OrderingError, metrics
from aotdist.config import Float8Config
from aotdist.float8 import convert_to_float8
from aotdist.testing import build_model, example_inputs
from aotdist.testing.models import BatchNormRelu
from aotdist.testing.parity import assert_parity

AOT_EAGER = {"compile": {"backend": "aot_eager"}}


def _saved_bytes(model, x) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).float().pow(2).mean().backward()
    return total


def test_regional_compile_matches_eager_and_keeps_keys():
    model = build_model("gpt", depth=3)
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    out = aotdist.parallelize(model, config=AOT_EAGER)
    assert out is model and list(model.state_dict()) == keys
    (x,), _ = example_inputs(model, 4)
    with metrics.track(model) as t:
        assert_parity(model, ref, (x,))
    region = t.regions["GPTBlock"]
    assert (region.call_sites, region.subgraphs) == (3, 1)
    info = aotdist.parallelize_info(model)
    assert list(info.plan.fqns) == ["blocks.0", "blocks.1", "blocks.2"]
    assert info.sharded_fqns == () and info.mesh is None


def test_activation_checkpointing_recomputes_and_still_reuses_the_region():
    torch.manual_seed(0)
    model = build_model("gpt", depth=3)
    ref = copy.deepcopy(model)
    plain = copy.deepcopy(model)
    aotdist.parallelize(model, config={**AOT_EAGER, "ac": {"enabled": True}})
    aotdist.parallelize(plain, config=AOT_EAGER)
    (x,), _ = example_inputs(model, 16)
    with metrics.track(model) as t:
        assert_parity(model, ref, (x,))
    region = t.regions["GPTBlock"]
    assert (region.call_sites, region.subgraphs) == (3, 1)
    with_ac, without = _saved_bytes(model, x), _saved_bytes(plain, x)
    assert with_ac < without / 3, (with_ac, without)


def test_checkpointed_regions_save_their_inputs_and_recompute_one_at_a_time(monkeypatch):
    """Checkpointing lowers the peak only if the backward recomputes one region, runs its
    backward, then the next: each region's input saved, not one hidden state from which
    every region's forward is recomputed before the first backward (what torch's
    partitioner did with region calls, as much memory at once as no checkpointing)."""
    import torch._dynamo.backends.debugging as debugging

    orders = []
    partition = debugging.min_cut_rematerialization_partition

    def spy(*args, **kwargs):
        fw, bw = partition(*args, **kwargs)
        orders.append(
            [
                "fw" if "fw" in n.args[0].target else "bw"
                for n in bw.graph.nodes
                if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph
            ]
        )
        return fw, bw

    monkeypatch.setattr(debugging, "min_cut_rematerialization_partition", spy)
    torch.manual_seed(0)
    depth = 4
    model = build_model("gpt", depth=depth)
    ref = copy.deepcopy(model)
    aotdist.parallelize(model, config={**AOT_EAGER, "ac": {"enabled": True}})
    (x,), _ = example_inputs(model, 8)
    for _ in range(3):  # several optimizer steps, blocks with different weights
        assert_parity(model, ref, (x,))
        for m in (model, ref):
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
    assert ["fw", "bw"] * depth in orders, orders
    hidden = x.shape[0] * x.shape[1] * model.blocks[0].ln1.normalized_shape[0] * 4
    saved = _saved_bytes(model, x)
    assert saved >= depth * hidden, (saved, depth * hidden)


@pytest.mark.parametrize("norm", [nn.BatchNorm2d, BatchNormRelu], ids=["torch", "own_forward"])
def test_activation_checkpointing_updates_batchnorm_statistics_once_per_step(norm):
    # the checkpointed region call is recomputed in backward; BatchNorm's running
    # statistics follow eager without checkpointing (one update a step), and stay reused:
    # torch's class through its swap, a subclass with its own forward through the copy
    # written back after the call (aotdist.fixes.hoist)
    torch.manual_seed(0)
    model = build_model("resnet", depth=3)
    for m in model.modules():
        if type(m) is nn.BatchNorm2d:
            m.__class__ = norm
    ref = copy.deepcopy(model)
    aotdist.parallelize(model, config={**AOT_EAGER, "ac": {"enabled": True}})
    (x,), _ = example_inputs(model, 4)
    tracked = []
    for step in (1, 2):
        with metrics.track(model) as t:
            assert_parity(model, ref, (x * step,))
        tracked.append(t)
        for (n, b), (_, r) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
            torch.testing.assert_close(b, r, msg=f"buffer {n}")
    first = tracked[0]
    assert not first.demoted and first.regions, first.summary()
    assert all(
        (st.call_sites, st.subgraphs) == (st.instances, 1) for st in first.regions.values()
    ), first.summary()
    assert model.stages[0][1].bn1.num_batches_tracked.item() == 2


def test_activation_checkpointing_without_compile():
    torch.manual_seed(0)
    model = build_model("vit", depth=2)
    ref = copy.deepcopy(model)
    aotdist.parallelize(model, config={"compile": {"enabled": False}, "ac": {"enabled": True}})
    (x,), _ = example_inputs(model, 4)
    assert_parity(model, ref, (x,))
    assert _saved_bytes(model, x) < _saved_bytes(ref, x) / 2


def test_float8_compile_matches_float8_eager():
    torch.manual_seed(0)
    model = build_model("gpt", depth=2)
    ref = copy.deepcopy(model)
    convert_to_float8(ref, Float8Config(enabled=True, exclude=("head",)))
    aotdist.parallelize(
        model, config={**AOT_EAGER, "float8": {"enabled": True, "exclude": ["head"]}}
    )
    from torchao.float8.float8_linear import Float8Linear

    assert isinstance(model.blocks[0].mlp.fc, Float8Linear)
    assert type(model.head) is nn.Linear
    assert aotdist.parallelize_info(model).float8_fqns == tuple(
        f"blocks.{i}.{n}" for i in range(2) for n in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    )
    (x,), _ = example_inputs(model, 4)
    with warnings.catch_warnings(record=True) as caught, metrics.track(model) as t:
        warnings.simplefilter("always")
        assert_parity(model, ref, (x,))
    region = t.regions["GPTBlock"]
    split = [w for w in caught if "torch.autograd.Function" in str(w.message)]
    # One subgraph for both blocks. torch 2.11 traces Float8Linear's matmul (an
    # autograd.Function) as a fresh trampoline per call site, which its subgraph dedup
    # compared by identity (one subgraph per call site, with a warning) until
    # _compat.tolerant_subgraph_dedup.
    assert region.call_sites == 2, t.summary()
    assert region.subgraphs == 1 and not split, (t.summary(), [str(w.message) for w in caught])
    # a different float8 result than high precision: the conversion really happened
    hp = build_model("gpt", depth=2)
    hp.load_state_dict(ref.state_dict())
    assert not torch.allclose(hp(x), ref(x))
    assert aotdist.precompute_float8_scales(model) is False  # no FSDP: nothing to do


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 48)
        self.b = nn.Linear(48, 30)  # 30 is not a multiple of 16
        self.c = nn.Linear(30, 32)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def test_float8_filter_skips_misaligned_and_excluded_layers():
    model = Odd()
    assert convert_to_float8(model, Float8Config(enabled=True)) == ["a"]
    with pytest.raises(ConfigError, match=r"float8.exclude: patterns \['nope\*'\]"):
        convert_to_float8(Odd(), Float8Config(enabled=True, exclude=("nope*",)))
    with pytest.raises(ConfigError, match="no Linear layer .* can run in float8"):
        convert_to_float8(Odd(), Float8Config(enabled=True, exclude=("a",)))


def test_fsdp_without_process_group_is_a_config_error():
    with pytest.raises(ConfigError, match="init_process_group"):
        aotdist.parallelize(build_model("gpt", depth=2), config={"fsdp": {"enabled": True}})


def test_one_sharding_step_per_fsdp_setting():
    from aotdist.fsdp import GraphSharding, HooksSharding, NoSharding, Sharding, sharding_for

    def kind(fsdp):
        return type(sharding_for(aotdist.AOTDistConfig.from_dict({"fsdp": fsdp})))

    assert kind({}) is NoSharding
    assert kind({"enabled": True}) is HooksSharding
    assert kind({"enabled": True, "mode": "graph"}) is GraphSharding
    # siblings behind one interface: no setting inherits another's steps
    assert {c.__base__ for c in (NoSharding, HooksSharding, GraphSharding)} == {Sharding}
    # FSDP off: a mesh is ignored with a warning, the model is not sharded
    with pytest.warns(ConfigWarning, match=r"mesh=\.\.\.\) has no effect"):
        model = aotdist.parallelize(
            build_model("gpt", depth=2), mesh=object(), config={"compile": {"enabled": False}}
        )
    info = aotdist.parallelize_info(model)
    assert (info.mesh, info.sharded_fqns) == (None, ())


def test_config_forms(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("compile: {backend: aot_eager}\nac: {enabled: true}\n")
    model = aotdist.parallelize(build_model("gpt", depth=2), config=str(path))
    assert aotdist.parallelize_info(model).config.ac.enabled
    with pytest.raises(ConfigError, match="config must be"):
        aotdist.parallelize(build_model("gpt", depth=2), config=42)
    with pytest.raises(ConfigError, match="compile.backnd"):
        aotdist.parallelize(build_model("gpt", depth=2), config={"compile": {"backnd": "x"}})
    with pytest.warns(ConfigWarning, match="mesh"):
        aotdist.parallelize(build_model("gpt", depth=2), config=AOT_EAGER, mesh=object())


def test_wrong_orderings_are_refused():
    model = build_model("gpt", depth=2)
    aotdist.parallelize(model, config=AOT_EAGER)
    with pytest.raises(OrderingError, match="already applied"):
        aotdist.parallelize(model, config=AOT_EAGER)
    aotdist.restore(model)  # nothing irreversible was applied: it may start over
    assert aotdist.parallelize_info(model) is None
    aotdist.parallelize(model, config=AOT_EAGER)
    converted = build_model("gpt", depth=2)
    aotdist.parallelize(converted, config={**AOT_EAGER, "float8": {"enabled": True}})
    aotdist.restore(converted)  # Float8 stays: still recorded, still refused
    with pytest.raises(OrderingError, match="already applied"):
        aotdist.parallelize(converted, config=AOT_EAGER)

    with pytest.raises(OrderingError, match="_orig_mod"):
        aotdist.parallelize(torch.compile(build_model("gpt", depth=2)), config=AOT_EAGER)

    model = build_model("gpt", depth=2)
    model.blocks[0].compile(backend="aot_eager")
    with pytest.raises(OrderingError, match=r"\['blocks.0'\] are already compiled"):
        aotdist.parallelize(model, config=AOT_EAGER)

    model = build_model("gpt", depth=2)
    aotdist.compile_regions(model, backend="aot_eager")
    with pytest.raises(OrderingError, match="restore"):
        aotdist.parallelize(model, config=AOT_EAGER)


def test_fsdp1_is_refused():
    from torch.distributed.fsdp import FullyShardedDataParallel

    # FSDP1 cannot even be built on CPU; the check only needs the type.
    wrapper = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(wrapper)
    wrapper._fsdp_wrapped_module = build_model("gpt", depth=2)
    with pytest.raises(OrderingError, match="FSDP1"):
        aotdist.parallelize(wrapper, config=AOT_EAGER)


@pytest.mark.parametrize(
    "compile_cfg",
    [
        {"mode": "max-autotune-no-cudagraphs", "dynamic": False},
        {"options": {"max_autotune": False, "epilogue_fusion": False}, "dynamic": True},
    ],
)
def test_compile_mode_dynamic_and_options_reach_inductor(compile_cfg, monkeypatch):
    # What the config says is what Inductor is built with (plus aotdist's default
    # options); Inductor itself is replaced by aot_eager here so no C++ is compiled.
    from aotdist import _compat
    from aotdist.backends.buffer_reuse import comparable_options
    from aotdist.backends.named import inductor_options

    built = []

    def wrapper(mode, options, dynamic):
        built.append((mode, options, dynamic))
        return _compat.lookup_backend("aot_eager")

    monkeypatch.setattr(_compat, "inductor_wrapper", wrapper)
    model = build_model("gpt", depth=2)
    ref = copy.deepcopy(model)
    aotdist.parallelize(model, config={"compile": compile_cfg})
    (x,), _ = example_inputs(model)
    with metrics.track(model) as m:
        assert_parity(model, ref, (x,))
    # dynamic: true reaches torch as automatic dynamic with the inputs marked dynamic (module
    # constants stay static, the regions stay reusable subgraphs)
    assert [(mode, comparable_options(opts), dyn) for mode, opts, dyn in built] == [
        (
            compile_cfg.get("mode"),
            comparable_options(inductor_options(compile_cfg.get("options"))),
            None if compile_cfg["dynamic"] else compile_cfg["dynamic"],
        )
    ]
    assert not m.demoted, m.summary()
    assert m.frames_compiled >= 1


def test_graph_mode_fsdp_logs_no_activation_checkpointing_notice_but_a_user_s_ac_does(monkeypatch):
    # Graph-mode FSDP recomputes its all-gathers in backward through a selective checkpoint
    # (a context_fn), and torch logged "Detected that context_fn is passed to
    # torch.utils.checkpoint under torch.compile" (8 lines under 2-rank `aotdist inspect`)
    # to users who asked for no checkpointing. A user's own such checkpoint still logs it.
    import logging

    import torch._higher_order_ops.wrap as wrap
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from aotdist.testing.distributed import one_rank_group

    # torch says it once a process (functools.cache): uncached here, so every one is seen
    monkeypatch.setattr(wrap, "warning_once", lambda log, *a, **k: log.warning(*a, **k))
    notices = []
    handler = logging.Handler()
    handler.emit = lambda record: notices.append(record.getMessage())
    logging.getLogger(wrap.__name__).addHandler(handler)
    try:
        model = build_model("gpt", depth=2)
        reference = copy.deepcopy(model)
        (x,), _ = example_inputs(model)
        with one_rank_group():
            aotdist.parallelize(
                model, config={"fsdp": {"enabled": True, "mode": "graph"}, **AOT_EAGER}
            )
            out = model(x)
            out.float().mean().backward()
        torch.testing.assert_close(out, reference(x))
        assert notices == []

        def user_context():
            return create_selective_checkpoint_contexts(lambda *a, **k: None)

        @torch.compile(backend="aot_eager")
        def users(t):
            return checkpoint(torch.sin, t, use_reentrant=False, context_fn=user_context)

        users(torch.randn(4, requires_grad=True)).sum().backward()
        assert notices and all("context_fn is passed" in n for n in notices)
    finally:
        logging.getLogger(wrap.__name__).removeHandler(handler)


def test_the_float8_all_gather_warning_names_the_measured_cause():
    # It said "the cause is not found" and told users to turn the all-gather off, which
    # keeps the drift: Inductor's rounding, the same without the all-gather and under
    # torch.compile of the whole model (docs/guide/limits.md has the figures).
    from aotdist.config import as_config
    from aotdist.float8 import warn_unverified_combination

    config = as_config(
        {
            "fsdp": {"enabled": True},
            "compile": {"backend": "inductor"},
            "float8": {"enabled": True, "fsdp_all_gather": True},
        }
    )
    with pytest.warns(aotdist.RegionCompileWarning) as caught:
        warn_unverified_combination(config)
    message = str(caught[0].message)
    assert "The all-gather is not the cause" in message and "whole model" in message
    assert "aot_eager" in message and "limits.md" in message
    assert "not found" not in message
