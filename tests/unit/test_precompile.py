"""``cache.precompile``: the whole-model graph saved with the bundle and run untraced.

Fast tests drive the guard filter, the reasons a model gets no saved graph, the
compiled call's use of a loaded graph (a stand-in for torch's, so no Inductor), and the
pieces FSDP2 hooks mode's per-frame graphs need (stand-in classes at FSDP2's depth, a
frame's kept example and stand-in parameters, decorated forwards). The slow ones run real
processes: save, then warm starts that must train like eager, fall back on a batch the
guards do not cover, and notice an edited model source; the 2-rank FSDP2 warm start is in
``tests/distributed/test_cache_fsdp.py``.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import subprocess
import sys
import types
import warnings
from types import SimpleNamespace

import pytest
import torch

import aotdist
from aotdist import _compat, per_process
from aotdist.cache import CacheWarning, precompile
from aotdist.compile import mark_regions
from aotdist.compile.frames import frame_example
from aotdist.compile.state import STATE_ATTR
from aotdist.testing import build_model, example_inputs

needs_precompile = pytest.mark.skipif(
    _compat.precompile_unavailable() is not None, reason=str(_compat.precompile_unavailable())
)


def _entry(guard_type, value=None, derived=(), name="L['x']", is_global=False):
    return SimpleNamespace(
        guard_type=guard_type,
        derived_guard_types=derived,
        name=name,
        has_value=value is not None,
        value=value,
        is_global=is_global,
    )


def test_guard_filter_drops_region_types_and_unserializable_guards_only():
    model = build_model("gpt", depth=2)
    mark_regions(model)
    block, plain = model.blocks[0], torch.nn.Linear(1, 1)
    bad = sorted(_compat.unserializable_guard_types())
    entries = [
        _entry("TYPE_MATCH", block),
        _entry("TYPE_MATCH", plain),
        _entry("TENSOR_MATCH", torch.zeros(1)),
        _entry("EQUALS_MATCH", 3),
        _entry("SEQUENCE_LENGTH", block, ("TYPE_MATCH",)),
    ]
    entries += [_entry(kind) for kind in bad[:2]] + [_entry("HASATTR", None, (bad[0],))]
    inner = "dict(type(self._modules['blocks']._modules['0']).__dict__)['_aotdist_impl']"
    entries += [
        _entry("EQUALS_MATCH", 1, name=inner + ".__closure__[0].cell_contents"),
        _entry("EQUALS_MATCH", 1, name="dict(type(self).__mro__[2].__dict__)['eps']"),
        _entry("EQUALS_MATCH", 1, name="G['_pytree']", is_global=True),
    ]
    keep = precompile.guard_filter(entries)
    assert keep == [False, True, True, True, False] + [False] * 3 + [False, True, False], keep


def _cached(tmp_path, backend="aot_eager", **cache):
    torch.manual_seed(0)
    model = build_model("gpt", depth=2)
    aotdist.parallelize(
        model,
        config={
            "compile": {"backend": backend},
            "cache": {"mode": "local", "dir": str(tmp_path), **cache},
        },
    )
    return model


def test_a_model_without_a_saved_graph_says_why(tmp_path):
    config = aotdist.parallelize_info(model := _cached(tmp_path)).config
    (x,), _ = example_inputs(model, 2)
    model(x).sum().backward()
    entries = precompile.build(model, config)  # what save() adds to the bundle
    assert precompile.ENTRY not in entries
    why = entries[precompile.SKIPPED].decode()
    assert why == precompile.unavailable_reason(model, config)
    assert ("aot_eager" in why) if _compat.precompile_unavailable() is None else "torch" in why
    assert (
        vars(model)[STATE_ATTR].hooks.cache.example is None
    )  # the first batch is not held any longer
    off = _cached(tmp_path, precompile=False)
    assert (
        vars(off)[aotdist.cache.STATE_ATTR]["load"].precompile_reason == "cache.precompile is false"
    )


class _FakeLoaded:
    """Stands in for torch's loaded function: covers batches of 2, runs a reference."""

    def __init__(self, ref):
        self.ref, self.calls = ref, 0

    def check(self, args, kwargs):
        return args[1].shape[0] == 2

    def why(self, args, kwargs):
        return f"size mismatch: expected 2, got {args[1].shape[0]}"

    def __call__(self, args, kwargs):
        self.calls += 1
        return self.ref(*args[1:], **kwargs)


def test_the_kept_example_is_the_first_training_call_and_is_dropped_at_the_save(tmp_path):
    """Lightning validates before it trains: the saved graph must be the training call's."""
    model = _cached(tmp_path)
    state = vars(model)[STATE_ATTR].hooks.cache  # the cache's record (cache.load made it)
    state.keep_example = True  # as with Inductor (aot_eager gets no saved graph)
    (x,), _ = example_inputs(model, 2, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.eval()
        model(x)
        model.train()
    assert state.example is None  # a validation call is not kept as the training call
    # but as the eval call, with its modes, saved as a second graph
    ev = state.eval_example
    assert ev is not None and ev.args[0] is x and ev.graphs == 1, ev
    assert (ev.modes.grad, ev.modes.inference) == (False, False), ev
    assert not any(ev.modes.training), ev
    with ev.modes.applied(model):  # the save re-enters them
        assert not torch.is_grad_enabled() and not any(m.training for m in model.modules())
    assert torch.is_grad_enabled() and all(m.training for m in model.modules())
    model(x).sum().backward()
    assert state.example is not None and state.example[0][0] is x, state.example
    assert state.example_from == 1  # the validation graph came before it
    with torch.no_grad():
        model.eval()
        model(x)  # a later eval call: the first one stays kept
        model.train()
    assert state.eval_example is ev
    aotdist.cache.save(model)
    assert state.example is None and state.eval_example is None and not state.keep_example
    model(x).sum().backward()
    with torch.inference_mode():
        model(x)
    assert state.example is None and state.eval_example is None  # no batch held after the save


def _eval_call(model, x):
    with torch.no_grad():
        model.eval()
        model(x)
        model.train()


def test_the_first_eval_call_after_the_save_is_kept_for_a_second_save(tmp_path, monkeypatch):
    """An eval loop that first runs after the save (Accelerate's loop; Lightning without
    a sanity check): its call is kept, the next save writes the bundle again with it, and
    then nothing more is watched or held."""
    from aotdist.cache import store

    packed = []
    monkeypatch.setattr(store, "pack", lambda key, entries: packed.append(entries) or b"x")
    model = _cached(tmp_path)
    state = vars(model)[STATE_ATTR].hooks.cache
    (x,), _ = example_inputs(model, 2, generator=torch.Generator().manual_seed(0))
    model(x).sum().backward()
    assert aotdist.cache.save(model) is not None and len(packed) == 1
    assert store.watching(model) and not store.pending(model)
    assert aotdist.cache.save(model) is None and len(packed) == 1  # nothing new yet
    model(x).sum().backward()  # training calls are not kept any more
    assert state.example is None and not store.pending(model)
    _eval_call(model, x)
    assert state.eval_example is not None and state.eval_example.args[0] is x
    assert store.pending(model) and state.eval_example.graphs == 1
    (x3,), _ = example_inputs(model, 3)
    _eval_call(model, x3)  # a later eval call (it compiles too): the first stays kept
    assert state.eval_example.args[0] is x
    assert aotdist.cache.save(model) is not None and len(packed) == 2
    assert packed[1] == packed[0]  # aot_eager: no graph to add; Inductor's new kernels would be
    assert state.eval_example is None and not store.watching(model)
    (x5,), _ = example_inputs(model, 5)
    _eval_call(model, x5)  # compiles, but nothing is watched or held any more
    assert state.eval_example is None and not store.pending(model)
    assert aotdist.cache.save(model) is None and len(packed) == 2
    assert vars(model)[aotdist.cache.STATE_ATTR]["entries"] is None


def test_an_eval_call_after_the_save_that_compiles_nothing_ends_the_watch(tmp_path, monkeypatch):
    """The run validated before the save without a kept call (no saved graph possible):
    the first eval call after the save compiles nothing, so nothing is saved again."""
    from aotdist.cache import store

    monkeypatch.setattr(store, "pack", lambda key, entries: b"x")
    model = _cached(tmp_path)
    (x,), _ = example_inputs(model, 2)
    _eval_call(model, x)
    model(x).sum().backward()
    aotdist.cache.save(model)
    assert store.watching(model)  # the eval call before it was not kept (aot_eager)
    _eval_call(model, x)  # a hit: nothing new to save
    assert not store.watching(model) and not store.pending(model)
    assert vars(model)[STATE_ATTR].hooks.cache.eval_example is None


def test_a_frames_mode_watch_ends_when_every_region_s_first_eval_call_compiled_nothing():
    from aotdist.cache.examples import eval_pending, record, release_examples, watches_eval
    from aotdist.compile.state import CompileMode, CompileSettings, RegionState

    plan = [SimpleNamespace(name="A"), SimpleNamespace(name="B")]
    state = RegionState(plan=plan, settings=CompileSettings(mode=CompileMode.FRAMES))
    assert state.hooks.cache is None and not watches_eval(state) and not eval_pending(state)
    rec = record(state)
    rec.keep_eval = True
    assert watches_eval(state) and not eval_pending(state)
    rec.frame_eval_examples["A"] = SimpleNamespace(graphs=0)
    assert watches_eval(state) and not eval_pending(state)  # B's may still compile
    rec.frame_eval_examples["B"] = SimpleNamespace(graphs=1)
    assert watches_eval(state) and eval_pending(state)
    rec.frame_eval_examples["B"] = SimpleNamespace(graphs=0)
    assert not watches_eval(state) and not eval_pending(state)  # nothing can come
    release_examples(state)
    assert not rec.keep_eval and rec.frame_eval_examples == {}


def test_a_frames_mode_eval_call_after_the_save_in_several_graphs_says_why_it_is_not_saved():
    from aotdist.cache.examples import watches_eval
    from aotdist.compile.state import (
        CacheRecord,
        CallHooks,
        CompileMode,
        CompileSettings,
        RegionState,
    )

    plan = [SimpleNamespace(name="A"), SimpleNamespace(name="B")]
    state = RegionState(
        plan=plan,
        settings=CompileSettings(mode=CompileMode.FRAMES),
        hooks=CallHooks(cache=CacheRecord(keep_eval=True)),
    )
    state.hooks.cache.frame_eval_examples.update(
        A=SimpleNamespace(graphs=2), B=SimpleNamespace(graphs=0)
    )
    model = torch.nn.Linear(2, 2)
    vars(model)[STATE_ATTR] = state
    frame_a, frame_b = precompile._frame_entry("A"), precompile._frame_entry("B")
    records = {"A": {"seconds": 1.0}, "B": {"seconds": 2.0}}
    entries = {frame_a: b"a", frame_b: b"b", precompile.FRAME_RECORDS: json.dumps(records).encode()}

    out = precompile.add_eval(model, entries)

    saved = json.loads(out[precompile.FRAME_RECORDS])
    assert saved["A"] == {
        "seconds": 1.0,
        "eval": {"skipped": "its first eval call compiled 2 frame graphs"},
    }
    assert saved["B"] == {"seconds": 2.0}  # compiled nothing: nothing to say
    assert out[frame_a] == b"a" and out[frame_b] == b"b"
    assert precompile._frame_entry("A", "eval") not in out
    assert json.loads(entries[precompile.FRAME_RECORDS]) == records  # the input is not changed
    assert not watches_eval(state) and state.hooks.cache.frame_eval_examples == {}


def test_the_cache_saves_after_the_first_step_and_after_the_first_eval(tmp_path, monkeypatch):
    from aotdist.cache import save_after_first_step, store

    calls = []
    monkeypatch.setattr(store, "pack", lambda key, entries: calls.append(len(calls)) or b"x")
    model = _cached(tmp_path)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    save_after_first_step(opt, model)  # as the Accelerate hook calls it
    (x,), _ = example_inputs(model, 2)
    for _ in range(2):
        model(x).sum().backward()
        opt.step()
    assert len(calls) == 1 and opt._optimizer_step_post_hooks  # still watching
    _eval_call(model, x)
    model(x).sum().backward()
    opt.step()  # the step after the eval loop saves again, and the hook goes
    assert len(calls) == 2 and not opt._optimizer_step_post_hooks


def test_the_compiled_call_runs_a_loaded_graph_and_falls_back_on_a_miss(tmp_path):
    model = _cached(tmp_path)
    ref = build_model("gpt", depth=2)
    ref.load_state_dict(model.state_dict())
    fake = _FakeLoaded(ref)
    record = {
        "num_ops": 7,
        "call_sites": {"GPTBlock": ["blocks.0", "blocks.1"]},
        "subgraphs": {"GPTBlock": ["0:repeated_subgraph0"]},
        "inlined": {},
    }
    vars(model)[STATE_ATTR].hooks.cache.precompiled = precompile.Precompiled(model, fake, [record])
    (x,), _ = example_inputs(model, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a hit warns about nothing
        with aotdist.metrics.track(model) as hit:
            out = model(x)
    assert fake.calls == 1 and torch.equal(out, ref(x))
    assert hit.precompiled and hit.frames_compiled in (0, None) and hit.graphs == 1
    assert (hit.regions["GPTBlock"].call_sites, hit.regions["GPTBlock"].subgraphs) == (2, 1)
    (x3,), _ = example_inputs(model, 3)
    with pytest.warns(CacheWarning, match="does not cover this call .*got 3"):
        with aotdist.metrics.track(model) as miss:
            out3 = model(x3)
    assert fake.calls == 1 and not miss.precompiled and miss.graphs == 1  # compiled here
    torch.testing.assert_close(out3, ref(x3))
    assert miss.precompile_misses == ["size mismatch: expected 2, got 3"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not at every miss
        model(x3)


def test_a_saved_graph_brings_its_region_fixes_and_demotions_along(tmp_path):
    """The saved graph was traced with a region inline: the loading model demotes it
    too (else the region's guards would never match), warning as the saving run did."""
    from aotdist.compile.guard import replay_outcomes

    model = _cached(tmp_path)
    state = vars(model)[STATE_ATTR]
    marked = type(model.blocks[0])
    with pytest.warns(aotdist.RegionCompileWarning, match="'GPTBlock' cannot be a reusable.*X"):
        replay_outcomes(model, state, {}, {"GPTBlock": "X", "Gone": "not in this plan"})
    assert state.applied.demoted == {"GPTBlock": "X"}
    assert type(model.blocks[0]) is not marked and not hasattr(
        type(model.blocks[0]), "_aotdist_region"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replay_outcomes(model, state, {}, {"GPTBlock": "X"})  # once only
    (x,), _ = example_inputs(model, 2)
    ref = build_model("gpt", depth=2)
    ref.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x), ref(x))


_MODEL = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(self.norm(x)).relu()

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
"""

_CHILD = r"""
import json, sys, warnings, torch
sys.path.insert(0, sys.argv[1])
import pcmodel, aotdist, aotdist.cache
torch.manual_seed(0)
model, ref = pcmodel.Net(), pcmodel.Net()
ref.load_state_dict(model.state_dict())
out = {"steps": [], "warnings": []}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    aotdist.parallelize(model, config={"compile": {"backend": "inductor"},
                                       "cache": {"mode": "local", "dir": sys.argv[2]}})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    g = torch.Generator().manual_seed(1)
    for i, n in enumerate(json.loads(sys.argv[3])):
        x = torch.randn(n, 8, generator=g)
        with aotdist.metrics.track(model) as m:
            loss = model(x).square().mean()
            loss.backward()
        want = ref(x).square().mean()
        want.backward()
        grad = max((p.grad - q.grad).abs().max().item()
                   for p, q in zip(model.parameters(), ref.parameters()))
        out["steps"].append({"precompiled": m.precompiled, "frames": m.frames_compiled,
                             "loss": abs(loss.item() - want.item()), "grad": grad})
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if i == 0:
            aotdist.cache.save(model)
load = vars(model)[aotdist.cache.STATE_ATTR]["load"]
out.update(status=str(load.status), precompiled=load.precompiled, why=load.precompile_reason,
           warnings=[str(w.message) for w in caught if w.category is aotdist.cache.CacheWarning])
print(json.dumps(out))
"""


@needs_precompile
@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_warm_start_runs_the_saved_graph_trains_like_eager_and_notices_edits(tmp_path):
    (tmp_path / "pcmodel.py").write_text(_MODEL)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}

    def run(sizes):
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, str(tmp_path), str(tmp_path / "b"), json.dumps(sizes)],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        for step in result["steps"]:  # every step, saved graph or not, trains like eager
            assert step["loss"] < 1e-5 and step["grad"] < 1e-4, result
        return result

    cold = run([4, 4])
    assert cold["status"] == "missing" and not cold["warnings"], cold
    assert cold["steps"][0]["frames"] >= 1 and not cold["steps"][0]["precompiled"]

    warm = run([4, 4, 4, 3])
    assert (warm["status"], warm["precompiled"]) == ("loaded", True), warm
    assert [s["precompiled"] for s in warm["steps"]] == [True, True, True, False], warm
    assert [s["frames"] for s in warm["steps"][:3]] == [0, 0, 0]  # Dynamo traced nothing
    assert warm["steps"][3]["frames"] >= 1  # a batch of 3: compiled as usual, and said so
    assert len(warm["warnings"]) == 1 and "does not cover this call" in warm["warnings"][0]

    (tmp_path / "pcmodel.py").write_text(_MODEL.replace(".relu()", ".tanh()"))
    edited = run([4, 4])  # the saved graph computes relu: it must not run
    assert (edited["status"], edited["precompiled"]) == ("loaded", False), edited
    assert "source changed" in edited["why"] and "pcmodel" in edited["why"], edited
    assert not any(s["precompiled"] for s in edited["steps"])
    again = run([4, 4])  # the edited run saved the bundle again
    assert again["precompiled"] and again["steps"][0]["precompiled"], again


def test_a_global_instance_of_a_local_class_pickles_by_path_while_saving(monkeypatch):
    # transformers 5.25's hub-kernel functions (apply_rotary_pos_emb) are module globals
    # whose class kernels makes in a function; torch refuses a type guard on such a class
    module = types.ModuleType("aotdist_test_local_types")
    monkeypatch.setitem(sys.modules, module.__name__, module)

    def make():
        class Func(torch.nn.Module):
            def forward(self, x):
                return x

        return Func

    func_cls = make()
    func_cls.__module__ = module.__name__
    names = (func_cls.__name__, func_cls.__qualname__)
    assert "<locals>" in names[1]
    module.rotate = func_cls()
    holder = type("Holder", (torch.nn.Module,), {"__module__": module.__name__})
    with _compat.precompile._local_types_saved_by_path(holder()):
        assert func_cls.__name__ == func_cls.__qualname__ == "rotate.__class__"
        data = pickle.dumps(func_cls)
    assert (func_cls.__name__, func_cls.__qualname__) == names
    assert pickle.loads(data) is func_cls  # found again through the module's global


_FAMILY_CHILD = r"""
import json, sys, warnings, torch
import aotdist, aotdist.cache
from aotdist.check.families import family, without_randomness
fam = family(sys.argv[1])
(model, inputs), (ref, _) = fam.build(0), fam.build(0)
model, ref = without_randomness(model), without_randomness(ref)
ref.load_state_dict(model.state_dict())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    aotdist.parallelize(model, config={"compile": {"backend": "inductor"},
                                       "cache": {"mode": "local", "dir": sys.argv[2]}})
    with aotdist.metrics.track(model) as m:
        loss = fam.loss_of(model(**inputs))
        loss.backward()
    aotdist.cache.save(model)
want = fam.loss_of(ref(**inputs))
want.backward()
grad = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())
           if p.grad is not None)
load = vars(model)[aotdist.cache.STATE_ATTR]["load"]
print(json.dumps({"ran_saved": m.precompiled, "frames": m.frames_compiled, "why": load.precompile_reason,
                  "loss": abs(loss.item() - want.item()), "grad": grad,
                  "warnings": [str(w.message) for w in caught if w.category is CacheWarning]}))
"""


@needs_precompile
@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["llama", "jamba"])
def test_transformers_models_warm_start_from_their_saved_graph(tmp_path, name):
    """Real models reach what toy ones do not: a module Dynamo's code loads through a
    made-up global, class attributes guarded by MRO position, guards on module globals."""
    pytest.importorskip("transformers")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    child = "from aotdist.cache import CacheWarning\n" + _FAMILY_CHILD

    def run():
        proc = subprocess.run(
            [sys.executable, "-c", child, name, str(tmp_path / "b")],
            env=env,
            capture_output=True,
            text=True,
            timeout=280,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["loss"] < 1e-5 and result["grad"] < 1e-4, result
        return result

    cold = run()
    assert not cold["ran_saved"] and not cold["warnings"], cold
    warm = run()
    assert (warm["ran_saved"], warm["frames"], warm["why"], warm["warnings"]) == (
        True,
        0,
        "",
        [],
    ), warm


def test_region_instances_pickle_at_their_class_depth_under_a_class_made_from_theirs():
    """FSDP2 makes ``FSDP<cls>`` from a region class: its instances' guards name the MRO
    two levels above the user class, and their stand-in must keep both levels."""
    import pickle

    model = build_model("gpt", depth=2)
    mark_regions(model)
    region_cls = type(model.blocks[0])
    base = region_cls._aotdist_base
    wrapped = type("FSDPGPTBlock", (_Mixin, region_cls), {})  # as fully_shard does
    model.blocks[1].__class__ = wrapped
    with per_process.pickled_with_region_depth(model):
        for block in model.blocks:
            copy = pickle.loads(pickle.dumps(block))
            assert type(copy) is not type(block) and isinstance(copy, base)
            assert type(copy).__mro__.index(base) == type(block).__mro__.index(base)
            assert type(copy).__name__ == type(block).__name__  # guards read it too
    assert "__reduce_ex__" not in vars(wrapped)  # inherits the region class's again
    assert type(pickle.loads(pickle.dumps(model.blocks[1]))) is base


class _Mixin:
    pass


def test_a_regions_batchnorm_pickles_as_its_swapped_class_made_again_while_saving():
    """Marking swaps a region's BatchNorm to a class made at run time: a saved graph holds
    the module, so while saving it pickles as that class made again from the user's."""
    import pickle

    model = build_model("resnet", depth=2)
    mark_regions(model)
    bn = next(
        m
        for m in model.modules()
        if isinstance(m, torch.nn.BatchNorm2d) and type(m) is not torch.nn.BatchNorm2d
    )
    with per_process.pickled_with_region_depth(model):
        copy = pickle.loads(pickle.dumps(bn))
    assert type(copy) is type(bn) and vars(type(bn))["_aotdist_bn_base"] is torch.nn.BatchNorm2d
    torch.testing.assert_close(copy.running_var, bn.running_var)
    aotdist.restore(model)
    assert type(bn) is torch.nn.BatchNorm2d


def test_graph_mode_fsdp_gathering_classes_pickle_as_made_again_while_saving():
    """Graph-mode FSDP's per-process class (a gathering property per parameter): a saved
    graph's guards read its class attributes, so inside the save it pickles as the class
    ``_gather_class`` makes from the same specs, and as the user's class otherwise."""
    import pickle

    from aotdist.fsdp.gather import GatherSpec, _gather_class

    model = build_model("gpt", depth=2)
    spec = GatherSpec(
        shape=(32,), group="g", world=2, reshard=True, param_dtype=None, reduce_dtype=None
    )
    norm = model.blocks[0].ln1
    base, gathering = type(norm), _gather_class(type(norm), (("weight", spec),))
    norm.__class__ = gathering
    with per_process.pickled_with_region_depth(model):
        copy = pickle.loads(pickle.dumps(norm))
        assert type(copy) is gathering and type(copy)._aotdist_gather == {"weight": spec}
    # its type is made per process: no saved guard checks it, as for region classes
    assert precompile.guard_filter([_entry("TYPE_MATCH", norm)]) == [False]
    assert type(pickle.loads(pickle.dumps(norm))) is base  # outside the save, as before
    assert "__reduce_ex__" in vars(gathering)  # its own reducer is back


def test_compiled_call_wrappers_pickle_as_none_only_while_a_graph_is_saved():
    """torch's guard pickler saves a module's callable attributes whole: aotdist's call
    wrappers (run state; in shared mode a process group's store) are left out."""
    import pickle

    from aotdist._compat import precompile as compat_precompile
    from aotdist.compile.guard import RegionGuardedCall
    from aotdist.fsdp.graph import ShardedCall

    model = build_model("gpt", depth=2)
    call = ShardedCall(model)
    call.rewrap(RegionGuardedCall(model, SimpleNamespace(), len))  # over the compiled call
    assert isinstance(pickle.loads(pickle.dumps(call)), ShardedCall)
    with compat_precompile._run_state_unsaved():
        assert pickle.loads(pickle.dumps(call)) is None
        assert pickle.loads(pickle.dumps({"inner": call.inner})) == {"inner": None}
    assert isinstance(pickle.loads(pickle.dumps(call.inner)), RegionGuardedCall)


def test_a_region_frame_example_keeps_metadata_not_data_and_stand_ins_restore():
    model = build_model("gpt", depth=2)
    block = model.blocks[0]
    x = torch.randn(2, 16, 32, requires_grad=True)
    example = frame_example(block, (x * 2,), {"scale": 3})
    assert not any(isinstance(t, torch.Tensor) for t in _compat.tree_leaves(example.args))
    (arg,), kwargs = example.inputs()
    assert arg.shape == x.shape and arg.stride() == x.stride() and arg.requires_grad
    assert arg.grad_fn is None and kwargs == {"scale": 3}
    name, weight = next(iter(block.named_parameters()))
    meta = example.params[name]
    assert (meta.shape, meta.stride, meta.dtype, meta.device, meta.requires_grad) == (
        tuple(weight.shape),
        weight.stride(),
        weight.dtype,
        weight.device,
        True,
    )
    assert example.subclass is None
    before = dict(block.named_parameters())
    with example.stand_in_parameters():
        inside = dict(block.named_parameters())
        assert inside.keys() == before.keys()
        assert all(
            inside[k] is not before[k] and inside[k].shape == before[k].shape for k in before
        )
    assert all(p is before[k] for k, p in block.named_parameters())


def _decorate(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


@_decorate
def _decorated(x):
    return x + 1


def test_a_decorated_functions_wrapped_original_is_saved_by_code_while_saving():
    """transformers decorates decoder layers' forward (``deprecate_kwarg``): pickle finds
    the wrapper under the original's name, so the original must be saved by code."""
    from aotdist._compat import precompile as compat_precompile

    original = _decorated.__closure__[0].cell_contents
    assert original is not _decorated and original.__qualname__ == "_decorated"
    with compat_precompile._closures_saved_by_code(_decorated):
        assert "<locals>" in original.__qualname__  # torch's pickler: code and closure
        assert _decorated.__qualname__ == "_decorated"  # found by its name: as it is
    assert original.__qualname__ == "_decorated" and _decorated(1) == 2


def test_a_failure_reason_is_the_first_line_and_survives_an_empty_message():
    """A save that fails with a bare exception still names it (the reason once indexed
    ``str(exc).splitlines()[0]``, an IndexError inside the handler for ``RuntimeError()``)."""
    from aotdist.errors import first_line

    assert first_line(RuntimeError()) == "RuntimeError"
    assert first_line(ValueError("bad shape\nmore detail")) == "ValueError: bad shape"
    assert len(first_line(ValueError("x" * 1000))) == 300
