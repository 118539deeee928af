"""Saved compiled graphs: a warm start that runs without Dynamo (``cache.precompile``).

At :func:`~aotdist.cache.save`, a graph-mode model's first training call and first eval
call (one after the save is added by the next save) are traced again with torch's
``aot_compile`` (same backend and options; Inductor's caches serve the kernels; under
graph-mode FSDP with the local shards), and each graph travels in the bundle; under FSDP2
hooks mode, each region's frame does, with stand-ins of the unsharded parameters. At
:func:`~aotdist.cache.load` they are loaded; each compiled call then runs the graph whose
guards cover it, with no Dynamo trace and no AOTAutograd cache lookup. A call no guards
cover, or a model whose source changed since the save, compiles as usual, with a
``CacheWarning``.

Guards not saved: torch's unserializable kinds (object identities), and the type of each
region instance or graph-mode FSDP gathering module, classes each process creates anew:
the bundle's key (region plan, parameters, versions) and the source check stand in.
"""

from __future__ import annotations

import json
import time
import warnings
from typing import Any

from torch import nn

from aotdist import _compat
from aotdist.backends.recording import RecordingBackend
from aotdist.cache.examples import record, release_examples
from aotdist.cache.loaded import Precompiled
from aotdist.compile.guard import compiled_graphs, replay_outcomes
from aotdist.compile.state import STATE_ATTR, CompileMode
from aotdist.errors import CacheWarning, first_line
from aotdist.fixes import SAVE, dynamo_patches
from aotdist.fsdp import sharding_of
from aotdist.log import get_logger
from aotdist.per_process import made_per_process, pickled_with_region_depth

_log = get_logger(__name__)

ENTRY, RECORDS, SKIPPED = (
    "aotdist/precompiled",
    "aotdist/precompiled-records",
    "aotdist/precompile-skipped",
)
FRAME_RECORDS, EVAL_ENTRY = "aotdist/precompiled-frames", "aotdist/precompiled-eval"
_CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def _frame_entry(region: str, call: str = "") -> str:
    """The bundle entry of a region frame's saved graph (one path level: no "/"), of its
    training call or of its eval call (``call="eval"``)."""
    return f"aotdist/precompiled-{call + '-' if call else ''}frame-" + region.replace(
        "%", "%25"
    ).replace("/", "%2F")


def guard_filter(entries) -> list[bool]:
    """Which of Dynamo's guards the saved graph keeps: not the unserializable kinds, not
    guards on globals (torch's own default for ``aot_compile``: the loaded function
    lacks the module globals they read), not the type of a region instance (a
    per-process class), not the constants inside the region class's forward wrapper
    (aotdist's own: the plan and the replayed fixes decide them)."""
    bad = _compat.unserializable_guard_types()
    keep = []
    for entry in entries:
        kinds = {entry.guard_type, *entry.derived_guard_types}
        made = entry.has_value and made_per_process(type(entry.value))
        keep.append(
            not (kinds & bad)
            and not entry.is_global
            and not (made and "TYPE_MATCH" in kinds)
            and "['_aotdist_impl']" not in entry.name
        )
    return keep


def unavailable_reason(model: nn.Module, config) -> str | None:
    """Why ``model`` gets no saved graph with this config and torch, or ``None``."""
    state = vars(model).get(STATE_ATTR)
    if not config.cache.precompile:
        return "cache.precompile is false"
    if (why := _compat.precompile_unavailable()) is not None:
        return why
    if state is None or not state.compiled:
        return "the model was not compiled by aotdist"
    frames = state.settings.mode == CompileMode.FRAMES
    if not frames and state.hooks.call_fn is None:
        return "compiled without one whole-model call (aotdist.capture)"
    if config.cache.mode == "shared" and _world() > 1:
        if not _on_cpu(model):
            return "shared across ranks: rank 0's graph would be specialized to its own device"
        if (uneven := _uneven_shard(model)) is not None:
            return (
                f"shared across ranks: graph-mode FSDP shards {uneven} unevenly, so rank "
                "0's graph would not fit the other ranks' shards (cache.mode: local "
                "saves each rank's own)"
            )
    if getattr(state.backend, "compiler_name", None) != "inductor":
        return f"backend {config.compile.backend!r}: torch saves Inductor's output only"
    if config.compile.mode in _CUDAGRAPH_MODES:
        return f"compile.mode {config.compile.mode!r} (CUDA graphs are not saved)"
    return None


def _on_cpu(model: nn.Module) -> bool:
    """Every parameter on the CPU: a region frame traced on rank 0 fits every rank (no
    collective is in it, and no device index)."""
    return all(p.device.type == "cpu" for p in model.parameters())


def _uneven_shard(model: nn.Module) -> str | None:
    """A parameter that graph-mode FSDP splits into shards of different sizes, or ``None``."""
    for fqn, mod in model.named_modules():
        for name, spec in getattr(type(mod), "_aotdist_gather", {}).items():
            if spec.shape and spec.shape[0] % spec.world:
                return f"{fqn + '.' if fqn else ''}{name} (first dim {spec.shape[0]}, {spec.world} ranks)"
    return None


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def build(model: nn.Module, config) -> dict[str, bytes]:
    """The bundle entries of ``model``'s saved graph (after its first step), or an entry
    saying why there is none. A failure is a ``CacheWarning``, never an error."""
    why = unavailable_reason(model, config)
    state = vars(model).get(STATE_ATTR)
    if why is None and state.settings.mode == CompileMode.FRAMES:
        return _build_frames(model, state)
    rec = record(state) if state is not None else None
    example = rec.example if rec is not None else None
    eval_example = rec.eval_example if rec is not None else None
    if rec is not None:  # the batches are not held any longer, whatever happens here
        rec.example, rec.eval_example, rec.keep_example = None, None, False
        rec.keep_eval = eval_example is None  # the first eval call after the save is kept
    if why is None:
        graphs = compiled_graphs(state) - rec.example_from
        if eval_example is not None and eval_example.compiled_before >= rec.example_from:
            graphs -= eval_example.graphs  # an eval call after the training call
        if example is None:
            why = "the model had no training call (grad enabled, train mode) before the save"
        elif graphs != 1:
            why = (
                f"its first training call compiled into {graphs} graphs (graph breaks or "
                "recompiles); a saved graph must be the whole model"
            )
    if why is not None:
        _log.info("cache: no saved whole-model graph: %s", why)
        return {SKIPPED: why.encode()}
    try:
        data, saved = _save_call(model, state, *example)
    except Exception as exc:  # the bundle is still saved without it
        why = f"aot_compile failed: {first_line(exc)}"
        warnings.warn(
            f"aotdist cache: the whole-model graph could not be saved ({why}); the "
            "next run loads the compiled kernels but traces the model again.",
            CacheWarning,
            stacklevel=3,
        )
        return {SKIPPED: why.encode()}
    saved.update(fixes=state.applied.fixes, demoted=state.applied.demoted)
    entries = {ENTRY: data}
    if eval_example is not None:  # a validation step's graph, in its own modes
        _add_eval(model, state, eval_example, entries, saved)
    entries[RECORDS] = json.dumps(saved).encode()
    return entries


def _add_eval(model: nn.Module, state, example, entries: dict, saved: dict) -> None:
    """The first eval call's saved graph into ``entries`` (its records into ``saved``)."""
    if example.graphs != 1:
        saved["eval"] = {
            "skipped": f"its first eval call compiled into {example.graphs} graphs (graph breaks)"
        }
        return
    try:
        with example.modes.applied(model):
            entries[EVAL_ENTRY], saved["eval"] = _save_call(
                model, state, example.args, example.kwargs
            )
    except Exception as exc:  # the training graph is still saved
        why = f"aot_compile failed: {first_line(exc)}"
        warnings.warn(
            f"aotdist cache: the eval call's graph could not be saved ({why}); "
            "the next run traces its eval calls again (the compiled kernels "
            "still load).",
            CacheWarning,
            stacklevel=4,
        )
        saved["eval"] = {"skipped": why}


def add_eval(model: nn.Module, entries: dict[str, bytes]) -> dict[str, bytes]:
    """``entries`` (the bundle's, from :func:`build`) with the graph of the first eval call
    compiled after that save, whole model or per region frame, when a saved graph is
    there to go with it; the kept call is dropped, and no later eval call is watched."""
    state = vars(model)[STATE_ATTR]
    rec = record(state)
    example, frames = rec.eval_example, rec.frame_eval_examples
    release_examples(state)
    entries = dict(entries)
    if ENTRY in entries and example is not None:
        saved = json.loads(entries[RECORDS])
        _add_eval(model, state, example, entries, saved)
        entries[RECORDS] = json.dumps(saved).encode()
    elif FRAME_RECORDS in entries and frames:
        saved = json.loads(entries[FRAME_RECORDS])
        for name, ev in frames.items():
            if _frame_entry(name) in entries and ev.graphs:  # (more than 1: says why not)
                _add_frame_eval(model, state, name, ev, entries, saved[name])
        entries[FRAME_RECORDS] = json.dumps(saved).encode()
    return entries


def _save_call(model: nn.Module, state, args: tuple, kwargs: dict) -> tuple[bytes, dict]:
    """One call of the whole-model function traced again and saved: (data, its records)."""
    recorder = RecordingBackend(state.backend.inner, plan=state.plan)
    start = time.perf_counter()
    with (
        pickled_with_region_depth(model),
        _as_sharded_call_runs(model),
        dynamo_patches(SAVE),  # the graph the live call compiles
    ):
        data, modules = _compat.aot_compile(
            state.hooks.call_fn,
            (*state.hooks.call_bound, *args),
            kwargs,
            model=model,
            backend=recorder,
            dynamic=state.settings.dynamic,
            guard_filter=guard_filter,
        )
    seconds = time.perf_counter() - start
    records = [
        {
            "num_ops": r.num_ops,
            "call_sites": r.call_sites,
            "inlined": _sorted_sets(r.inlined),
            "subgraphs": _sorted_sets(r.subgraphs),
        }
        for r in recorder.records
    ]
    _log.info("cache: whole-model graph saved (%d bytes, %.2f s)", len(data), seconds)
    return data, {"records": records, "seconds": seconds, "modules": modules}


def _build_frames(model: nn.Module, state) -> dict[str, bytes]:
    """FSDP2 hooks mode: one saved graph per region frame, traced again from its first
    training call, with stand-ins of the unsharded parameters it saw (FSDP2 has resharded
    them; a trace needs their metadata, not their values); and its first eval call's."""
    rec = record(state)
    examples, evals = rec.frame_examples, rec.frame_eval_examples
    rec.frame_examples, rec.frame_eval_examples, rec.keep_example = {}, {}, False
    entries, saved = {}, {}
    for region in state.plan:
        name, example = region.name, examples.get(region.name)
        frames = compiled_graphs(state, name) - (example.compiled_before if example else 0)
        if (
            example is not None
            and (ev := evals.get(name)) is not None
            and ev.compiled_before >= example.compiled_before
        ):  # an eval call after it
            frames -= ev.graphs
        why = (
            f"region {name!r} is demoted"
            if name in state.applied.demoted
            else f"region {name!r} had no training call before the save"
            if example is None
            else f"a parameter is a tensor subclass ({example.subclass})"
            if example.subclass
            else f"region {name!r}'s frame compiled {frames} times in training"
            if frames != 1
            else None
        )
        loaded = rec.frame_precompiled.get(name)
        if example is None and loaded is not None:  # save(force=True) after a warm start
            saved[name] = loaded.saved[1]
            entries.update(loaded.saved[0])
            continue
        if why is None:
            try:
                data, saved[name] = _save_frame(model, state, name, example)
            except Exception as exc:  # the bundle is still saved without it
                why = f"aot_compile failed: {first_line(exc)}"
                warnings.warn(
                    f"aotdist cache: region {name!r}'s compiled frame could not be "
                    f"saved ({why}); the next run loads its compiled kernels but "
                    "traces it again.",
                    CacheWarning,
                    stacklevel=4,
                )
        if why is not None:
            _log.info("cache: no saved graph for region frame %s: %s", name, why)
            saved[name] = {"skipped": why}
            continue
        entries[_frame_entry(name)] = data
        if (ev := evals.get(name)) is not None:  # a validation step's
            _add_frame_eval(model, state, name, ev, entries, saved[name])
    rec.keep_eval = not evals  # no eval call yet: the first one after the save is kept
    entries[FRAME_RECORDS] = json.dumps(saved).encode()
    return entries


def _add_frame_eval(
    model: nn.Module, state, name: str, example, entries: dict, saved: dict
) -> None:
    """Region ``name``'s first eval call's saved graph into ``entries`` (its records
    into ``saved``, the region's)."""
    if example.graphs != 1:
        saved["eval"] = {"skipped": f"its first eval call compiled {example.graphs} frame graphs"}
        return
    try:
        with example.modes.applied(example.instance):
            entries[_frame_entry(name, "eval")], saved["eval"] = _save_frame(
                model, state, name, example
            )
    except Exception as exc:  # the training call's graph is still saved
        why = f"aot_compile failed: {first_line(exc)}"
        warnings.warn(
            f"aotdist cache: region {name!r}'s eval call could not be saved "
            f"({why}); the next run traces its eval calls again (the compiled "
            "kernels still load).",
            CacheWarning,
            stacklevel=5,
        )
        saved["eval"] = {"skipped": why}


def _save_frame(model: nn.Module, state, name: str, example) -> tuple[bytes, dict]:
    """One call of region ``name``'s frame traced again and saved: (data, its records)."""
    recorder = RecordingBackend(
        state.backend.inner,
        plan=state.plan,
        region_frame=name,
        recompute_reductions=state.backend.recompute_reductions,  # the live frame's partition
    )
    start = time.perf_counter()
    args, kwargs = example.inputs()
    with pickled_with_region_depth(model), example.stand_in_parameters():
        data, modules = _compat.aot_compile(
            state.applied.classes[name]._aotdist_plain_forward,
            (example.instance, *args),
            kwargs,
            model=example.instance,
            backend=recorder,
            dynamic=state.settings.dynamic,
            guard_filter=guard_filter,
        )
    return data, {
        "modules": modules,
        "seconds": time.perf_counter() - start,
        "records": [
            {
                "num_ops": r.num_ops,
                "call_sites": {},
                "inlined": {},
                "subgraphs": {},
                "standalone": name,
            }
            for r in recorder.records
        ],
    }


def _as_sharded_call_runs(model: nn.Module):
    """The parameters as the model's compiled call reads them (graph-mode FSDP: its local
    shards in place, as ``ShardedCall`` runs the graph)."""
    return sharding_of(model).local_view(model)


def _sorted_sets(d: dict[str, set[str]]) -> dict[str, list[str]]:
    return {k: sorted(v) for k, v in d.items()}


def attach(model: nn.Module, config, entries: dict[str, bytes]) -> tuple[bool, str, bool]:
    """Loads the saved graph of a bundle onto ``model``; returns (loaded, why not, whether
    this run should save the bundle again: a saved graph it could not use)."""
    why = unavailable_reason(model, config)
    if why is not None:
        return False, why, False
    if vars(model)[STATE_ATTR].settings.mode == CompileMode.FRAMES:
        return _attach_frames(model, entries)
    if ENTRY not in entries:
        saved = entries.get(SKIPPED, b"the bundle was saved without it").decode(errors="replace")
        return False, f"not saved: {saved}", False
    try:
        saved = json.loads(entries[RECORDS])
    except ValueError as exc:
        fn, why = None, f"it could not be loaded (its records: {exc})"
    else:
        fn, why = _load(entries[ENTRY], saved.get("modules", {}))
    if fn is not None:
        state = vars(model)[STATE_ATTR]
        # the graph was traced with these regions fixed or inline: so is the model now
        replay_outcomes(model, state, saved.get("fixes", {}), saved.get("demoted", {}))
        loaded = record(state).precompiled = Precompiled(model, fn, saved["records"])
        if EVAL_ENTRY in entries:  # the first eval call's graph (a validation step)
            _also_eval(loaded, entries[EVAL_ENTRY], saved["eval"])
        return True, "", False
    warnings.warn(
        f"aotdist cache: the saved whole-model graph is not used: {why}; the model "
        "is traced again (the compiled kernels still load from the bundle), and the "
        "bundle is replaced after the first step.",
        CacheWarning,
        stacklevel=3,
    )
    return False, why, True


def _attach_frames(model: nn.Module, entries: dict[str, bytes]) -> tuple[bool, str, bool]:
    """:func:`attach` for FSDP2 hooks mode: each region frame's saved graph."""
    state = vars(model)[STATE_ATTR]
    rec = record(state)
    try:
        saved = json.loads(entries.get(FRAME_RECORDS, b"{}"))
    except ValueError as exc:
        return False, f"the saved frame graphs could not be loaded (their records: {exc})", True
    whys, refresh = [], False
    for region in state.plan:
        info = saved.get(region.name) or {"skipped": "the bundle was saved without it"}
        if "skipped" in info:
            whys.append(f"region {region.name!r} not saved: {info['skipped']}")
            continue
        fn, why = _load(entries[_frame_entry(region.name)], info.get("modules", {}))
        if fn is not None:
            own = {
                k: entries[k]
                for k in (_frame_entry(region.name), _frame_entry(region.name, "eval"))
                if k in entries
            }
            loaded = rec.frame_precompiled[region.name] = Precompiled(
                model,
                fn,
                info["records"],
                label=f"region {region.name!r}'s saved graph",
                saved=(own, info),
            )
            if _frame_entry(region.name, "eval") in entries:  # its first eval call's graph
                _also_eval(loaded, entries[_frame_entry(region.name, "eval")], info["eval"])
            continue
        refresh = refresh or why.startswith("the model's source changed")
        whys.append(f"region {region.name!r}: {why}")
        warnings.warn(
            f"aotdist cache: region {region.name!r}'s saved graph is not used: "
            f"{why}; it is traced again (its compiled kernels still load from the "
            "bundle).",
            CacheWarning,
            stacklevel=4,
        )
    if refresh:
        rec.frame_precompiled.clear()  # so that the run traces every frame and saves anew
    return bool(rec.frame_precompiled), "; ".join(whys), refresh


def _also_eval(loaded: Precompiled, data: bytes, info: dict) -> None:
    fn, why = _load(data, info.get("modules", {}))
    if fn is not None:
        loaded.also(fn, info["records"])
    else:  # its eval calls are traced, as without it
        _log.info("cache: the saved eval graph is not used: %s", why)


def _load(data: bytes, modules: dict[str, str]) -> tuple[Any, str]:
    """A saved graph loaded, with its source checked: ``(function, "")`` or ``(None, why)``."""
    try:
        with (
            _compat.rerooted_autotune_lookups(),
            _compat.remembered_isa_loads(),
            _compat.loading_kernels_only(),
        ):
            fn = _compat.PrecompiledFunction(data, modules)
        changed = fn.changed_source()
    except Exception as exc:  # noqa: BLE001 - a bad entry must not stop the job
        return None, f"it could not be loaded ({first_line(exc)})"
    if changed is not None:
        return None, f"the model's source changed since the save ({changed})"
    return fn, ""
