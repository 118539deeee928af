"""``compile.outer: eager``: no graph around the regions, each compiled as a function of its
own shared by its instances (the short run's choice under ``auto``), trains as eager does,
says so in ``metrics``, and is refused where the sharding needs the whole graph."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from saved_bytes import saved_activation_bytes

import aotdist
from aotdist.compile.state import STATE_ATTR, CompileMode
from aotdist.errors import ConfigError, RegionCompileWarning
from aotdist.metrics import track
from aotdist.testing import assert_training_parity
from aotdist.testing.models import TinyResNet, build_model, example_inputs


def _gpt():
    torch.manual_seed(0)  # each block initialised from its own draws: weights that differ
    model = build_model("gpt", depth=3)
    g = torch.Generator().manual_seed(1)
    return model, [example_inputs(model, generator=g)[0] for _ in range(3)]


def test_each_region_compiles_once_and_training_matches_eager():
    model, batches = _gpt()
    reference = copy.deepcopy(model)
    aotdist.compile_regions(model, backend="aot_eager", outer="eager")
    with track(model) as m:
        assert_training_parity(model, reference, batches)
    assert m.mode == CompileMode.FRAMES and "mode frames" in m.summary()
    stats = m.regions["GPTBlock"]
    assert (stats.call_sites, stats.subgraphs) == (3, 1), m.summary()
    assert not m.eager and not m.reuse, m.summary()


def test_buffers_train_as_eager_with_batchnorm_regions():
    torch.manual_seed(0)
    model = TinyResNet(widths=(4, 8), blocks_per_stage=2, image_size=8)
    reference = copy.deepcopy(model)
    batches = [(torch.randn(2, 3, 8, 8),) for _ in range(3)]
    aotdist.compile_regions(model, backend="aot_eager", outer="eager")
    assert_training_parity(model, reference, batches)  # running statistics included


def test_a_compiled_call_path_keeps_its_hooks_and_runs_the_region_frames():
    """Accelerate's path (``compile_callable``): the call path stays the user's, eager, and
    the regions inside it run their compiled frames."""
    model, batches = _gpt()
    reference = copy.deepcopy(model)
    forward = model.forward
    call = aotdist.compile.compile_callable(model, forward, backend="aot_eager", outer="eager")
    assert call is forward
    with track(model) as m:
        for (x,) in batches:
            F.cross_entropy(call(x).flatten(0, 1), x.flatten()).backward()
            F.cross_entropy(reference(x).flatten(0, 1), x.flatten()).backward()
    assert (m.regions["GPTBlock"].call_sites, m.regions["GPTBlock"].subgraphs) == (3, 1)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_without_regions_the_whole_model_compiles_as_usual():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.warns(RegionCompileWarning, match="no repeated regions"):
        aotdist.compile_regions(model, backend="aot_eager", outer="eager")
    with track(model) as m:
        model(torch.randn(3, 4)).sum().backward()
    assert m.mode == CompileMode.GRAPH and m.graphs >= 1, m.summary()


def test_graph_mode_fsdp_is_refused_before_anything_changes(monkeypatch):
    import aotdist.compile as compile_mod
    from aotdist.fsdp.modes import Sharding

    class GraphSharded(Sharding):  # graph-mode FSDP's compile mode, without a process group
        check = mesh = shard = None

    monkeypatch.setattr(
        compile_mod, "sharding_of", lambda model: GraphSharded.__new__(GraphSharded)
    )
    model, _ = _gpt()
    with pytest.raises(ConfigError, match="graph-mode FSDP.*Fix: compile.outer: auto"):
        aotdist.compile_regions(model, backend="aot_eager", outer="eager")
    assert STATE_ATTR not in vars(model)  # nothing marked: the user can compile again
    assert type(model.blocks[0]).__name__ == "GPTBlock"


def test_a_short_run_partitions_its_regions_as_per_block_compile_does():
    """``outer="eager"`` is the shortest compile: its region frames keep torch's default
    partition (each norm's statistics saved, not recomputed in the backward, the fewer
    backward kernels per-block compile generates), so they save what per-block compile
    saves; the one-graph default recomputes them and saves less. Min-cut partitioning
    (``aot_eager_decomp_partition``: Inductor's partitioner, no codegen)."""
    backend = "aot_eager_decomp_partition"
    model, batches = _gpt()
    x = batches[0][0]
    short, default, per_block = (copy.deepcopy(model) for _ in range(3))
    reference = copy.deepcopy(model)
    aotdist.compile_regions(short, backend=backend, outer="eager")
    aotdist.compile_regions(default, backend=backend)
    for block in per_block.blocks:
        block.compile(backend=backend)
    assert_training_parity(short, reference, batches[:2])
    saved = {
        name: saved_activation_bytes(m, x)
        for name, m in (("short", short), ("default", default), ("per_block", per_block))
    }
    assert torch._functorch.config.ban_recompute_reductions  # torch's default, restored
    assert saved["short"] == saved["per_block"] > saved["default"], saved
