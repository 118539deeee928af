"""``aotdist.capture``: what AOTAutograd saw, region by region, in one report.

:func:`capture` runs one forward (and backward) step of the model through
``torch.compile`` with a backend built on AOTAutograd
(:func:`aotdist.backends.aot.aot_backend`), recording Dynamo's graph and then every
forward, backward and region subgraph AOTAutograd produces, before the chosen backend
compiles it. Regions are found as ``invoke_subgraph`` calls in one graph without FSDP2,
and as per-region frames with it (see :mod:`aotdist.compile`).

Compile state is left as it was: fresh code objects (no ``torch._dynamo.reset()``),
aotdist's own compiled forwards put back, gradients and buffers restored. The report's
dataclasses are in :mod:`aotdist.capture.report`, the recorder in
:mod:`aotdist.capture.recorder`. Details: docs/internals.md.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from aotdist import _compat
from aotdist.backends.aot import aot_backend, backend_name
from aotdist.backends.recording import RecordingBackend
from aotdist.capture.graphs import name_code
from aotdist.capture.recorder import Recorder
from aotdist.capture.report import Capture, RegionCapture
from aotdist.compile.guard import RegionGuardedCall
from aotdist.compile.marking import copy_function, mark_regions, unmark_regions
from aotdist.compile.state import STATE_ATTR, CompileMode
from aotdist.compile.subgraph_reuse import report_reuse
from aotdist.errors import ConfigError, OrderingError
from aotdist.fixes import CAPTURE, dynamo_patches
from aotdist.fsdp import fsdp_params, sharding_of
from aotdist.metrics import track

__all__ = ["Capture", "RegionCapture", "capture"]


def _runner():
    def run(model, args, kwargs):
        return model(*args, **kwargs)

    return copy_function(run, new_code=True)  # a fresh code object: a Dynamo cache of its own


def _install_frames(model: nn.Module, state, backend, calls: dict) -> dict[type, Any]:
    """Frames mode: each region class's forward compiled on its own; returns the old ones."""
    fqn_of = {id(m): f for f, m in model.named_modules()}
    old = {}
    for region in state.plan:
        cls = state.applied.classes[region.name]
        old[cls] = cls.__dict__.get("_aotdist_impl")
        fn = torch.compile(
            copy_function(cls._aotdist_plain_forward, new_code=True), backend=backend
        )

        def forward(self, *args, _fn=fn, _name=region.name, **kwargs):
            calls.setdefault(_name, []).append(fqn_of.get(id(self), "?"))
            return _fn(self, *args, **kwargs)

        cls._aotdist_impl = forward  # the region class's forward dispatches to it
    return old


def capture(
    model: nn.Module, *args, loss_fn=None, plan=None, backend: str = "aot_eager", **kwargs
) -> Capture:
    """Runs one step of ``model`` through AOTAutograd and reports what was captured.

    Args:
        model: The model; regions are marked for the step if aotdist has not marked them.
            It may be sharded with FSDP2 (by ``aotdist.parallelize``) and use Float8.
        *args: Positional inputs of ``model``.
        loss_fn: ``loss_fn(output) -> scalar``; backward runs on it. Without it, backward
            runs when the output is a scalar that requires grad.
        plan: Regions to use; ``aotdist.find_regions(model)`` when ``None`` (a model aotdist
            marked already keeps its plan).
        backend: ``"aot_eager"`` or ``"inductor"``: the recorded graphs are then compiled
            by it, so the step runs as in training.
        **kwargs: Keyword inputs of ``model``.

    Returns:
        A :class:`Capture`.

    Raises:
        ConfigError: ``backend`` is not one aotdist can rebuild on AOTAutograd, or ``plan``
            differs from the plan the model was marked with.
        OrderingError: The model holds FSDP2 units but aotdist did not mark its regions
            before sharding.
    """
    report = Capture(backend=str(backend_name(backend) or backend))
    state = vars(model).get(STATE_ATTR)
    frames = sharding_of(model).compile_mode is CompileMode.FRAMES
    if state is None and frames:
        raise OrderingError(
            "this model holds FSDP2 units but aotdist has not marked its regions; marking "
            "after fully_shard would drop FSDP's class. Fix: build it with "
            "aotdist.parallelize(model, config=config), which marks before sharding."
        )
    if state is not None and plan is not None and plan is not state.plan:
        raise ConfigError(
            "capture(plan=...) differs from the plan this model was marked with. Fix: pass "
            "plan=None to use the model's plan, or aotdist.restore(model) first."
        )
    marked_here = state is None
    state = mark_regions(model, plan) if marked_here else state
    recorder = Recorder(model, state.plan, report)
    aot = aot_backend(backend, on_graph=recorder.on_graph)
    if aot is None:
        if marked_here:
            _unmark(model)
        raise ConfigError(
            f"capture(backend={backend!r}): the capture pipeline rebuilds the backend on "
            "AOTAutograd and knows 'aot_eager' and 'inductor'. Fix: pass one of those."
        )
    report.mode = CompileMode.FRAMES if frames else CompileMode.GRAPH
    for region in state.plan:
        report.regions[region.name] = RegionCapture(
            name=region.name,
            instances=list(region.fqns),
            module_type=f"{region.module_type.__module__}.{region.module_type.__qualname__}",
        )
    recording = RecordingBackend(recorder.dynamo_backend(aot), model=model, plan=state.plan)
    recorder.recording = recording
    grads = {p: p.grad for p in model.parameters()}
    buffers = _snapshot_buffers(model)
    calls: dict[str, list[str]] = {}
    compiled_call, old_forwards = _compat.compiled_call(model), {}
    try:
        _compat.set_compiled_call(model, None)
        for p in grads:
            p.grad = None
        with track(model) as metrics:
            if frames:
                old_forwards = _install_frames(model, state, recording, calls)
                out = model(*args, **kwargs)
            else:
                with sharding_of(model).local_view(model):  # as its compiled call reads
                    out = _run_demoting(
                        model,
                        state,
                        recorder,
                        recording,
                        torch.compile(_runner(), backend=recording),
                        args,
                        kwargs,
                    )
            loss = loss_fn(out) if loss_fn is not None else out
            if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad:
                loss.backward()
    finally:
        for cls, fwd in old_forwards.items():
            cls._aotdist_impl = fwd
        _compat.set_compiled_call(model, compiled_call)
        for p, g in grads.items():
            p.grad = g
        _restore_buffers(model, buffers)
        if marked_here:
            _unmark(model)
    report.metrics = metrics
    report.demoted = dict(state.applied.demoted)
    # a region inlined or traced more than once: warned as compile_regions warns
    metrics.reuse.update(report_reuse(model, state, records=recording.records, found={}))
    for name, reason in state.applied.demoted.items():
        report.regions[name].demoted = reason
    _finish(report, recorder, calls, model)
    return report


def _run_demoting(model: nn.Module, state, recorder: Recorder, recording, compiled, args, kwargs):
    """``compiled(model, args, kwargs)``; a region that cannot be an ``invoke_subgraph``
    (in-place buffer mutation in training, a graph break...) is fixed or demoted to
    inline compilation as :func:`aotdist.compile_regions` does (same warning), what the
    failed attempt recorded is dropped, and the step is traced again."""
    guard = RegionGuardedCall(model, state, compiled, backend=recording)
    report = recorder.report

    def run():  # the backend sees every region call, as under compile_regions
        with dynamo_patches(CAPTURE):
            return compiled(model, args, kwargs)

    for _ in range(2 * len(state.plan) + 1):
        try:
            return run()
        except Exception as exc:  # noqa: BLE001 - re-raised unless it is a region failure
            if not guard.handle(exc, run):
                raise
        recorder.reset()
        report.graphs.clear()
        report.mutations.clear()
        report.subclass_inputs.clear()
        report.fixes.clear()
    return run()


def _unmark(model: nn.Module) -> None:
    unmark_regions(model)
    del model.__dict__[STATE_ATTR]


def _snapshot_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    saved = {}
    for name, b in model.named_buffers():
        needed = b.numel() * b.element_size()
        if type(b) is torch.Tensor and b.untyped_storage().nbytes() >= needed:
            saved[name] = b.detach().clone()
    return saved


@torch.no_grad()
def _restore_buffers(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    for name, b in model.named_buffers():
        if name in saved and b.untyped_storage().nbytes() >= saved[name].nbytes:
            b.copy_(saved[name])


def _finish(report: Capture, recorder: Recorder, calls: dict, model: nn.Module) -> None:
    fsdp = fsdp_params(model)
    for region in report.regions.values():
        if report.mode == CompileMode.FRAMES:
            region.call_sites = list(calls.get(region.name, []))
        region.num_subgraphs = len(region.forward)
        stats = report.metrics.regions.get(region.name)
        region.inlined = stats.inlined if stats is not None else 0
        if stats is not None and report.mode == CompileMode.FRAMES:
            # the step's own frames, whatever the model was compiled with before (nothing,
            # under `aotdist inspect`: metrics would read no call sites, CompileMode.GRAPH)
            stats.call_sites, stats.subgraphs = len(region.call_sites), region.num_subgraphs
        for g in region.forward if report.mode == CompileMode.FRAMES else ():
            for inp in g.inputs:  # named after the instance compiled first: make relative
                if inp["kind"] not in ("parameter", "buffer"):
                    continue
                site = next((s for s in region.instances if inp["name"].startswith(s + ".")), None)
                rel = inp["name"][len(site) + 1 :] if site else inp["name"]
                inp.update(name=rel, sources=[f"{s}.{rel}" for s in region.call_sites])
    for entry in recorder.dynamo:
        for i, example in enumerate(entry.examples):
            kind, name = entry.names.get(i, ("", ""))
            info = fsdp.get(name) if kind == "parameter" else None
            if info is not None and example is info["unsharded"]:
                report.fsdp_inputs.append(
                    {
                        "graph": f"graph{entry.index}",
                        "input": name,
                        "param": name,
                        **{k: v for k, v in info.items() if k != "unsharded"},
                    }
                )
        entry.examples = []
    report.metrics.mode = report.mode
    graphs = [
        *report.graphs,
        *(g for r in report.regions.values() for g in (*r.forward, *r.backward)),
    ]
    for g in {id(g): g for g in graphs}.values():  # frames: a region's graph is top-level too
        name_code(g)
