"""Python's collector around aotdist's compiles: the objects alive before a compile are
left out of its collections, the ones it makes are not, and the process's own choices
(frozen objects, the collector off) are left as they were."""

from __future__ import annotations

import gc

import pytest
import torch

import aotdist
from aotdist.backends.recording import RecordingBackend
from aotdist.compile.collector import older_objects_frozen
from aotdist.testing import build_model, example_inputs


@pytest.fixture
def collector_as_found():
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()
    assert frozen == 0  # the suite itself freezes nothing


def test_a_compile_scope_freezes_older_objects_and_collects_its_own(collector_as_found):
    class Cycle:
        pass

    before = Cycle()
    before.me = before
    with older_objects_frozen():
        assert gc.get_freeze_count() > 0  # `before` among them
        made = Cycle()
        made.me = made
        del made
        assert gc.collect() >= 1  # a cycle made in the scope is collected in it
    assert gc.get_freeze_count() == 0  # all collectable again


def test_a_process_that_froze_its_own_objects_or_stopped_the_collector_keeps_it(
    collector_as_found,
):
    gc.freeze()  # e.g. before forking data-loader workers
    frozen = gc.get_freeze_count()
    with older_objects_frozen():
        pass
    # not handed back to the collector (gc.unfreeze empties the permanent generation);
    # a frozen object may still die by refcount meanwhile, another thread's included
    assert frozen // 2 < gc.get_freeze_count() <= frozen
    gc.unfreeze()
    gc.disable()
    with older_objects_frozen():
        assert gc.get_freeze_count() == 0
    assert not gc.isenabled()


@pytest.mark.parametrize("outer", ["auto", "eager"])
def test_the_first_call_compiles_with_older_objects_frozen_and_later_calls_do_not(
    collector_as_found, monkeypatch, outer
):
    seen = []
    compile_graph = RecordingBackend._compile

    def recording(self, *args, **kwargs):  # each graph Dynamo hands over
        seen.append(gc.get_freeze_count() > 0)
        return compile_graph(self, *args, **kwargs)

    monkeypatch.setattr(RecordingBackend, "_compile", recording)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model("gpt", depth=2)
    config = {"compile": {"backend": "aot_eager", "outer": outer}}
    aotdist.parallelize(model, config=config)
    (x,), _ = example_inputs(model, 2, generator=torch.Generator().manual_seed(1))
    model(x)
    assert seen and all(seen), seen  # every graph of the first call (outer eager: frames)
    assert gc.get_freeze_count() == 0
    graphs, (freezes, freeze) = len(seen), ([], gc.freeze)
    monkeypatch.setattr(gc, "freeze", lambda: freezes.append(1) or freeze())
    model(x)
    assert freezes == [] and len(seen) == graphs  # no compile, no freeze
