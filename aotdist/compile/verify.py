"""The first-step check (``compile.verify``): the first training call, compiled and eager
from the same state, compared before training goes on.

The compiled model runs forward and backward (compile, fixes and demotions happen there),
then the same call runs eagerly (``set_stance("force_eager")``) from the same parameters,
buffers and RNG state; the outputs and every parameter's gradient of a fixed random
projection of the outputs (the user's loss is unknown here) are compared with ``aotdist
check``'s tolerances, and the state is put back for the real step. ``nn.Dropout`` modules
are in eval mode for both runs (compiled masks differ from eager's), a variant compiled
once more. On a mismatch the regions are found by running regions inline (bisection, as
failure isolation does; per-region frames: the first instance whose output differs) and
:class:`~aotdist.errors.RegionMismatchError` names them. Details: docs/internals.md.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from aotdist import _compat
from aotdist._compat.modules import dropout_base
from aotdist.compile.isolate import Trials
from aotdist.compile.state import RegionState
from aotdist.errors import RegionMismatchError
from aotdist.log import get_logger

_log = get_logger(__name__)


def tolerance(backend: object) -> float:
    """The relative tolerance a backend's results are held to against eager's."""
    return 1e-4 if backend in ("eager", "aot_eager") else 2e-2


def compare_grads(
    grads: dict[str, torch.Tensor | None], reference: dict[str, torch.Tensor | None], *, rtol: float
) -> tuple[float, str | None, list[str]]:
    """Largest gradient difference scaled by the reference gradient's size (at least a
    thousandth of the largest reference gradient: one that is zero in exact arithmetic is
    rounding noise in both), the first parameter beyond ``rtol`` (``None``: all within),
    and the parameters whose gradient is all zeros where the reference's is ``None``
    (counted as equal: a compiled backward gives zeros to the parameters of an output the
    loss does not use, where eager leaves them ``None``).

    Sharded gradients (FSDP2's DTensors) are compared shard by shard: each rank reduces its
    own shards to a few maxima, and one all-reduce of those gives every rank the figures
    of the whole tensors (no parameter is gathered). Then every rank must call it, with
    the same parameters, as for any collective."""
    missing = sorted(set(grads) ^ set(reference))
    if missing:  # not the same parameters
        return float("inf"), missing[0], []
    names, rows = [], []
    for name, g in grads.items():
        r = reference[name]
        if g is None and r is None:
            continue
        if g is None:  # eager has a gradient, the compiled run none
            return float("inf"), name, []
        if r is None:  # row: [diff, reference size, any nonzero, no reference]
            rows.append([0.0, 0.0, float(bool(_local(g).any())), 1.0])
        else:
            g, r = _local_pair(g, r)
            rows.append([_amax((g - r).abs()), _amax(r.abs()), 0.0, 0.0])
        names.append(name)
    stats = _max_over_shards(
        rows,
        sharded=any(
            _is_sharded(t) for t in (*grads.values(), *reference.values()) if t is not None
        ),
    )
    floor = 1e-3 * max((row[1] for row in stats if not row[3]), default=0.0)
    worst, bad, zeros = 0.0, None, []
    for name, (diff, size, nonzero, no_reference) in zip(names, stats, strict=True):
        if no_reference:
            if nonzero:
                return float("inf"), bad or name, zeros
            zeros.append(name)
            continue
        diff = diff / (max(size, floor) + 1e-6)
        worst = max(worst, diff)
        if diff > rtol and bad is None:
            bad = name
    return worst, bad, zeros


def _is_sharded(t: torch.Tensor) -> bool:
    return callable(getattr(t, "to_local", None))  # a DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2's), or ``t``, as float32."""
    return (t.to_local() if _is_sharded(t) else t).detach().float()


def _local_pair(g: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of both: where one side is sharded and the other whole (``aotdist
    check`` under FSDP: a sharded model against an unsharded reference), the whole one is
    cut as the sharded one is, locally (every rank holds it whole)."""
    if _is_sharded(g) != _is_sharded(r):
        from torch.distributed.tensor import distribute_tensor

        like, whole = (g, r) if _is_sharded(g) else (r, g)
        cut = distribute_tensor(
            whole.detach().to(like.device), like.device_mesh, like.placements, src_data_rank=None
        )
        g, r = (g, cut) if like is g else (cut, r)
    return _local(g), _local(r)


def _amax(t: torch.Tensor) -> float:
    return t.max().item() if t.numel() else 0.0  # an uneven shard can be empty


def _max_over_shards(rows: list[list[float]], *, sharded: bool) -> list[list[float]]:
    """``rows`` with each figure's largest over the ranks (sharded gradients only)."""
    dist = torch.distributed
    if not rows or not sharded or not (dist.is_available() and dist.is_initialized()):
        return rows
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    table = torch.tensor(rows, dtype=torch.float64, device=device)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return table.cpu().tolist()


@dataclass
class Comparison:
    """One compiled call against eager: the largest output and gradient differences."""

    output_diff: float
    grad_diff: float
    worst_param: str | None
    rtol: float

    @property
    def ok(self) -> bool:
        return self.output_diff <= self.rtol and self.worst_param is None

    def describe(self) -> str:
        where = f" (first beyond it: {self.worst_param})" if self.worst_param else ""
        return (
            f"outputs differ by {self.output_diff:.2e}, gradients by "
            f"{self.grad_diff:.2e}{where}, tolerance {self.rtol:.0e}"
        )


def _outputs(out: object) -> list[torch.Tensor]:
    return [
        t
        for t in _compat.tree_leaves(out)
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    ]


def _step(model: nn.Module, call: Callable[[], object]) -> tuple[list[torch.Tensor], dict]:
    """Runs ``call`` and the backward of a fixed projection of its outputs; returns the
    outputs and every parameter's gradient, leaving ``.grad`` as it was."""
    params = dict(model.named_parameters())
    stash = {n: p.grad for n, p in params.items()}
    for p in params.values():
        p.grad = None
    try:
        outs = _outputs(call())
        g = torch.Generator().manual_seed(0)
        terms = [
            (o.float() * torch.randn(o.shape, generator=g).to(o.device)).sum() / o.numel()
            for o in outs
            if o.requires_grad and o.numel()
        ]
        if terms:
            torch.stack(terms).sum().backward()
        grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in params.items()}
        return [o.detach().clone() for o in outs], grads
    finally:
        for n, p in params.items():
            p.grad = stash[n]


def _output_diff(outs: list[torch.Tensor], ref_outs: list[torch.Tensor]) -> float:
    """Largest output difference relative to the reference's size (at least 1)."""
    if len(outs) != len(ref_outs) or any(
        a.shape != b.shape for a, b in zip(outs, ref_outs, strict=True)
    ):
        return float("inf")
    return max(
        (
            (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1.0)
            for a, b in zip(outs, ref_outs, strict=True)
            if a.numel()
        ),
        default=0.0,
    )


def _compare(got, want, rtol: float) -> Comparison:
    (outs, grads), (ref_outs, ref_grads) = got, want
    grad_diff, bad, _ = compare_grads(grads, ref_grads, rtol=rtol)
    return Comparison(_agreed([_output_diff(outs, ref_outs)])[0], grad_diff, bad, rtol)


def _agreed(values: list[float]) -> list[float]:
    """Each value's largest over the ranks (every rank then decides alike, none hangs)."""
    if not values or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return values
    backend = torch.distributed.get_backend()
    t = torch.tensor(values, device="cuda" if backend == "nccl" else "cpu")
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.tolist()


@contextlib.contextmanager
def _same_state(model: nn.Module) -> Iterator[Callable[[], None]]:
    """Yields a function that puts ``model``'s buffers and the RNG back as they were on
    entry (parameters are not changed by a forward and backward); applied on exit too."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def put_back():
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)

    try:
        yield put_back
    finally:
        put_back()


@contextlib.contextmanager
def _dropout_off(model: nn.Module) -> Iterator[int]:
    """Dropout modules in eval mode and the stochastic depth aotdist made a tensor at rate
    0 (no recompile: the rate is data), for both runs: their masks differ compiled and
    eager (Inductor's random stream, the swapped draw)."""
    drops = [m for m in model.modules() if isinstance(m, dropout_base()) and m.training and m.p > 0]
    depths = [
        (m, type(m)._aotdist_dp_name)
        for m in model.modules()
        if "_aotdist_dp_base" in vars(type(m))
    ]
    rates = [getattr(m, name) for m, name in depths]
    for m in drops:
        m.training = False
    for m, name in depths:
        setattr(m, name, 0.0)
    try:
        yield len(drops)
    finally:
        for m in drops:
            m.training = True
        for (m, name), rate in zip(depths, rates, strict=True):
            setattr(m, name, rate)


def first_step_check(
    model: nn.Module,
    state: RegionState,
    compiled: Callable[[], object],
    eager: Callable[[], object],
    *,
    frames: bool = False,
    fresh: Callable[[int], object] | None = None,
) -> Comparison:
    """Runs the check; raises :class:`RegionMismatchError` naming the regions on a
    mismatch. ``compiled`` and ``eager`` make the same call, compiled and eagerly;
    ``fresh(n)`` makes it through a new compile (``n``: the trial), for isolation.
    ``frames``: per-region frames (FSDP2 hooks mode), whose region instances run their
    hooks eagerly: the culprit is the first instance whose output differs."""
    rtol = tolerance(state.settings.backend_name)
    start = time.perf_counter()
    with _dropout_off(model), _same_state(model) as put_back:
        with _instance_outputs(model, state, frames) as calls:
            got = _step(model, compiled)
            put_back()
            compiled_s = time.perf_counter() - start
            with torch.compiler.set_stance("force_eager"):
                want = _step(model, eager)
        put_back()
        result = _compare(got, want, rtol)
        _log.info(
            "first-step check: %s: %s (compiled step with its compile %.2f s; eager "
            "step and comparison %.2f s)",
            "passed" if result.ok else "FAILED",
            result.describe(),
            compiled_s,
            time.perf_counter() - start - compiled_s,
        )
        if result.ok:
            return result
        if frames:
            culprits = _first_differing_instance(state, calls, rtol)
        else:
            culprits = _isolate(model, state, fresh, want, rtol, put_back)
    raise RegionMismatchError(result, culprits, whole_model=culprits == [])


@contextlib.contextmanager
def _instance_outputs(
    model: nn.Module, state: RegionState, on: bool
) -> Iterator[list[tuple[str, list[torch.Tensor]]]]:
    """Records each region instance's outputs, in call order (both runs, one list)."""
    calls: list[tuple[str, list[torch.Tensor]]] = []
    handles = [
        model.get_submodule(fqn).register_forward_hook(
            lambda m, a, out, fqn=fqn: calls.append(
                (fqn, [o.detach().clone() for o in _outputs(out)])
            )
        )
        for fqn in (state.applied.marked if on else ())
    ]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def _first_differing_instance(state: RegionState, calls, rtol: float) -> list[str]:
    """The region of the first instance whose compiled output differs from its eager one
    (the first half of ``calls`` is the compiled run, the second the eager run)."""
    half = len(calls) // 2
    diffs = _agreed(
        [
            _output_diff(got, want)
            for (_, got), (_, want) in zip(calls[:half], calls[half:], strict=True)
        ]
    )
    return next(
        (
            [state.applied.marked[fqn]]
            for (fqn, _), d in zip(calls, diffs, strict=False)
            if d > rtol
        ),
        [],
    )


def install_frames_check(model: nn.Module, state: RegionState) -> None:
    """Per-region frames: the check runs from a forward pre-hook on the root (the root is
    not compiled there), before FSDP2's own, on the first training call; then it goes."""

    def hook(module, args, kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return None
        handle.remove()
        first_step_check(
            model,
            state,
            lambda: module(*args, **kwargs),
            lambda: module(*args, **kwargs),
            frames=True,
        )
        return None

    handle = model.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)


def _isolate(
    model: nn.Module,
    state: RegionState,
    fresh: Callable[[int], object],
    want,
    rtol: float,
    put_back: Callable[[], None],
) -> list[str]:
    """The live regions the mismatch comes with (all else nested), by runs with regions
    inline; ``[]`` when it remains with every region inline (whole-model compile's).
    ``fresh(n)`` makes the call through a compile of its own (a code object of its own:
    no trial runs a graph cached for another, whatever the torch version guards on)."""

    class _Runs(Trials):
        def _passes(self) -> bool:
            self.count += 1
            put_back()
            return _compare(_step(model, lambda: fresh(self.count)), want, rtol).ok

    live = [r.name for r in state.plan if r.name not in state.applied.demoted]
    return _Runs(model, state, lambda: None, None).isolate(live)
