"""Region bodies compiled once each, the outer graph unlowered (compile.outer: fx)."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch

import aotdist
from aotdist import _compat
from aotdist.backends.regional import (
    LONG_RUN_STEPS,
    SHORT_RUN_STEPS,
    RegionBody,
    configured_outer,
    regional_inner_compile,
    resolve_outer,
)
from aotdist.errors import ConfigError, ConfigWarning
from aotdist.metrics import track
from aotdist.testing import assert_training_parity
from aotdist.testing.models import TinyGPT


def _model_and_batches(steps=3):
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, depth=3, heads=2, seq_len=8)
    with torch.no_grad():  # blocks whose weights differ
        for i, block in enumerate(model.blocks):
            for p in block.parameters():
                p.add_(0.01 * (i + 1))
    return model, [(torch.randint(0, 64, (2, 8)),) for _ in range(steps)]


def _counting_backend(compiled: list, outer_graphs: list):
    """aot_eager whose forward/backward compilers are the regional inner compile, with a
    body "compiler" that runs the body as it is and counts what it was given."""
    aot_eager, _ = _compat.aot_eager_parts()

    def body_compiler(body, inputs, **kwargs):
        compiled.append((kwargs["is_backward"], len(inputs)))
        return _compat.boxed_function(body.forward)

    inner = regional_inner_compile(body_compiler)

    def graph_compiler(backward, gm, example_inputs):
        out = inner(gm, example_inputs, is_backward=backward)
        outer_graphs.append(gm)
        return out

    return functools.partial(
        aot_eager,
        fw_compiler=functools.partial(graph_compiler, False),
        bw_compiler=functools.partial(graph_compiler, True),
    )


def test_each_body_is_compiled_once_and_training_matches_eager():
    model, batches = _model_and_batches()
    reference = copy.deepcopy(model)
    compiled, outer_graphs = [], []
    aotdist.compile_regions(model, backend=_counting_backend(compiled, outer_graphs))
    assert_training_parity(model, reference, batches, rtol=0, atol=0)
    # one forward and one backward body for the 3 blocks, each compiled once
    assert [backward for backward, _ in compiled] == [False, True]
    for gm in outer_graphs:  # every call site calls the compiled body; no region call left
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        assert not [n for n in calls if n.target is torch.ops.higher_order.invoke_subgraph]
        assert sum(isinstance(n.target, RegionBody) for n in calls) == 3


def test_symbolic_shapes_group_call_sites_too():
    """dynamic=True: operands' sizes are symbols (unhashable SymInts); the call sites still
    share one compiled body, and other lengths run it without a new compile."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, depth=3, heads=2, seq_len=32)
    reference = copy.deepcopy(model)
    compiled, outer_graphs = [], []
    aotdist.compile_regions(model, backend=_counting_backend(compiled, outer_graphs), dynamic=True)
    batches = [(torch.randint(0, 64, (2, length)),) for length in (8, 16, 24)]
    assert_training_parity(model, reference, batches, rtol=1e-5, atol=1e-6)
    # one compiled graph; its forward and backward bodies compiled once each for the 3 call
    # sites (torch 2.11 traces the first block apart under dynamic=True: 2 bodies each way,
    # docs/guide/limits.md)
    assert len(outer_graphs) == 2
    bodies = (
        1 if tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 14) else len(compiled) // 2
    )
    assert [backward for backward, _ in compiled] == [False] * bodies + [True] * bodies
    assert bodies in (1, 2)


def test_a_graph_without_region_calls_is_compiled_whole():
    seen = []

    def body_compiler(gm, inputs, **kwargs):
        seen.append(kwargs)
        return "whole"

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert regional_inner_compile(body_compiler)(gm, [], is_backward=False) == "whole"
    assert seen == [{"is_backward": False}]


def test_outer_resolution():
    assert resolve_outer("auto", "inductor", None) == "fx"
    assert resolve_outer("auto", "inductor", "max-autotune-no-cudagraphs") == "fx"
    assert resolve_outer("fx", "inductor", None) == "fx"
    assert resolve_outer("inductor", "inductor", "default") == "inductor"
    # CUDA graphs record one lowered graph: auto keeps it whole
    assert resolve_outer("auto", "inductor", "reduce-overhead") == "inductor"
    # so does Inductor's compute/communication overlap (fsdp.overlap), which reorders it
    overlap = {"aten_distributed_optimizations.enable_overlap_scheduling": True}
    assert resolve_outer("auto", "inductor", None, overlap) == "inductor"
    assert resolve_outer("fx", "aot_eager", None) is None  # not Inductor: nothing to choose
    # asked for explicitly where the whole graph should be lowered: said, not silent
    with pytest.warns(ConfigWarning, match="CUDA graphs.*compile.outer: auto"):
        assert resolve_outer("fx", "inductor", "reduce-overhead") == "fx"
    with pytest.warns(ConfigWarning, match="fsdp.overlap"):
        assert resolve_outer("fx", "inductor", None, overlap) == "fx"
    with pytest.raises(ConfigError, match="did you mean 'inductor'"):
        resolve_outer("inductr", "inductor", None)
    # no graph around the regions: what still compiles whole (no regions) is auto's
    assert resolve_outer("eager", "inductor", None) == "fx"
    assert resolve_outer("eager", "inductor", "reduce-overhead") == "inductor"


def test_with_the_artifact_cache_auto_lowers_the_whole_graph():
    """torch's caches keep Inductor's lowered output only: with the artifact cache on, auto
    lowers the whole graph once, and warm starts skip its trace."""
    config = aotdist.AOTDistConfig.from_dict
    assert configured_outer(config({})) == "auto"
    cached = {"cache": {"mode": "local", "dir": "unused"}}
    assert configured_outer(config(cached)) == "inductor"
    assert configured_outer(config({**cached, "compile": {"outer": "fx"}})) == "fx"
    no_saved_graph = {"cache": {"mode": "local", "dir": "unused", "precompile": False}}
    assert configured_outer(config(no_saved_graph)) == "inductor"


def test_a_long_run_lowers_the_whole_graph_and_a_short_one_compiles_frames(caplog):
    """compile.expected_steps: from LONG_RUN_STEPS on, auto lowers the whole graph (its
    faster step pays back the longer compile) and says so; under SHORT_RUN_STEPS an
    unsharded Inductor run builds no graph around the regions (eager) and says so; a run
    between them or of unknown length keeps auto's fx; an explicit outer wins."""
    config = aotdist.AOTDistConfig.from_dict
    assert configured_outer(config({"compile": {"expected_steps": SHORT_RUN_STEPS}})) == "auto"
    assert configured_outer(config({})) == "auto"
    with caplog.at_level(logging.INFO, logger="aotdist"):
        assert configured_outer(config({"compile": {"expected_steps": 500}})) == "eager"
    assert "a run of 500 steps" in caplog.text and "outer: fx" in caplog.text, caplog.text
    # where the whole graph is needed or the compile is not Inductor's, auto stays auto
    for other in (
        {"backend": "aot_eager"},
        {"mode": "reduce-overhead"},
    ):
        assert configured_outer(config({"compile": {"expected_steps": 500, **other}})) == "auto"
    sharded = {"compile": {"expected_steps": 500}, "fsdp": {"enabled": True}}
    assert configured_outer(config(sharded)) == "auto"
    cached = {"compile": {"expected_steps": 500}, "cache": {"mode": "local", "dir": "unused"}}
    assert configured_outer(config(cached)) == "inductor"
    with caplog.at_level(logging.INFO, logger="aotdist"):
        long_run = config({"compile": {"expected_steps": LONG_RUN_STEPS}})
        assert configured_outer(long_run) == "inductor"
    assert f"a run of {LONG_RUN_STEPS} steps" in caplog.text, caplog.text
    kept = {"compile": {"expected_steps": 10 * LONG_RUN_STEPS, "outer": "fx"}}
    assert configured_outer(config(kept)) == "fx"
    with pytest.raises(ConfigError, match="compile.expected_steps: -1 is negative"):
        config({"compile": {"expected_steps": -1}})


def test_config_names_a_bad_outer_value():
    with pytest.raises(ConfigError, match="compile.outer.*did you mean 'inductor'"):
        aotdist.AOTDistConfig.from_dict({"compile": {"outer": "inductr"}})


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize(("outer", "shown"), [("fx", "outer fx"), ("eager", "mode frames")])
def test_inductor_bodies_only_or_frames_match_eager_and_metrics_say_so(outer, shown):
    # fx: the region bodies compiled, the glue unlowered; eager: each region a frame
    model, batches = _model_and_batches()
    reference = copy.deepcopy(model)
    aotdist.compile_regions(model, backend="inductor", outer=outer)
    with track(model) as m:
        assert_training_parity(model, reference, batches, rtol=1e-4, atol=1e-5)
    assert shown in m.summary(), m.summary()
    assert (m.regions["GPTBlock"].call_sites, m.regions["GPTBlock"].subgraphs) == (3, 1)
