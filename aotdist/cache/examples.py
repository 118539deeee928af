"""The calls a save traces again: the cache's record on a model, and its call watcher.

:func:`record` gives a compiled model's :class:`~aotdist.compile.state.CacheRecord`
(``RegionState.hooks.cache``), made on first use with a watcher subscribed to the
model's compiled calls (``RegionState.hooks.watchers``). While the cache keeps calls
(``keep_example``, ``keep_eval``), the watcher keeps the first training call and the
first eval call that compiled, whole model or per region frame, for
:mod:`aotdist.cache.precompile` to trace again at the save; otherwise it returns at once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from aotdist.compile.frames import frame_example
from aotdist.compile.guard import CallModes, compiled_graphs, is_training
from aotdist.compile.state import CacheRecord, CompiledCall, CompileMode, RegionState


@dataclass
class EvalExample:
    """The first eval call (a validation step): ``aotdist.cache`` saves its graph too."""

    args: tuple
    kwargs: dict
    modes: CallModes
    graphs: int  # graphs compiled during the call: a saved graph must be exactly one
    compiled_before: int  # graphs compiled before the call


def record(state: RegionState) -> CacheRecord:
    """``state``'s cache record; the first call makes it and subscribes its watcher."""
    if state.hooks.cache is None:
        state.hooks.cache = CacheRecord()
        state.hooks.watchers.append(functools.partial(_watch, state))  # picklable
    return state.hooks.cache


def watches_eval(state: RegionState) -> bool:
    """After the cache's save (``keep_eval``): whether a first eval call can still make
    :func:`eval_pending` true."""
    rec = state.hooks.cache
    if rec is None or not rec.keep_eval:
        return False
    evals = rec.frame_eval_examples  # frames mode: has every region's first eval call come?
    return (
        state.settings.mode != CompileMode.FRAMES
        or len(evals) < len(state.plan)
        or any(e.graphs for e in evals.values())
    )


def eval_pending(state: RegionState) -> bool:
    """Whether an eval call compiled after the cache's save: a second save adds its graph
    and kernels (``aotdist.cache.precompile.add_eval``)."""
    rec = state.hooks.cache
    return (
        rec is not None
        and rec.keep_eval
        and (
            rec.eval_example is not None or any(e.graphs for e in rec.frame_eval_examples.values())
        )
    )


def release_examples(state: RegionState) -> None:
    """Drops the calls kept for the cache's save and stops keeping them."""
    if (rec := state.hooks.cache) is not None:
        rec.example = rec.eval_example = None
        rec.frame_examples, rec.frame_eval_examples = {}, {}
        rec.keep_example = rec.keep_eval = False


def _watch(state: RegionState, call: CompiledCall) -> Callable[[], None] | None:
    rec = state.hooks.cache
    if rec is None or not (rec.keep_example or rec.keep_eval):  # nothing kept: the usual case
        return None
    if call.frame is not None:
        return _watch_frame(state, rec, call)
    training = is_training(call.module)
    keep = rec.keep_example and rec.example is None and training
    keep_eval = (rec.keep_example or rec.keep_eval) and rec.eval_example is None and not training
    if not (keep or keep_eval):
        return None
    before = compiled_graphs(state)

    def done() -> None:
        if keep:  # aotdist.cache.save traces it again (precompile)
            rec.example, rec.example_from = (call.args, call.kwargs), before
        if keep_eval and (graphs := compiled_graphs(state) - before):  # 0: a hit
            rec.eval_example = EvalExample(
                call.args, call.kwargs, CallModes.of(call.module), graphs, before
            )
        elif keep_eval and rec.keep_eval:  # after the save, it compiled nothing new
            rec.keep_eval = False

    return done


def _watch_frame(
    state: RegionState, rec: CacheRecord, call: CompiledCall
) -> Callable[[], None] | None:
    """Frames mode: a region frame's first training call, and its first eval call."""
    name, instance = call.frame, call.module
    if rec.frame_precompiled.get(name) is not None:  # a saved graph of it was loaded
        return None
    if is_training(instance):  # the first training call
        if rec.keep_example and name not in rec.frame_examples:
            rec.frame_examples[name] = frame_example(
                instance, call.args, call.kwargs, compiled_before=compiled_graphs(state, name)
            )
        return None
    if name in rec.frame_eval_examples:
        return None
    before = compiled_graphs(state, name)  # the first eval call
    kept = frame_example(
        instance, call.args, call.kwargs, compiled_before=before, modes=CallModes.of(instance)
    )

    def done() -> None:
        kept.graphs = compiled_graphs(state, name) - before
        # 0: it ran a graph compiled before (after the save: kept, so that this region's
        # later eval calls are not watched)
        if kept.graphs or rec.keep_eval:
            rec.frame_eval_examples[name] = kept

    return done
