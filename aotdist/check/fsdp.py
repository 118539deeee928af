"""The check under FSDP: :func:`check_fsdp` trains a family on several gloo ranks with
``aotdist.parallelize`` (``fsdp.mode`` hooks or graph) against single-process eager, and
judges it as :func:`aotdist.check.runner.check_family` does, every rank's result kept.
"""

from __future__ import annotations

import contextlib
import copy
import time
import traceback
import warnings

from torch import nn

from aotdist.check.families import Family, without_randomness
from aotdist.check.runner import (
    STEPS,
    CheckResult,
    _region_warnings,
    _train_tracked,
    _verdict,
)
from aotdist.check.specs import resolve
from aotdist.check.steps import Run, train
from aotdist.compile.verify import tolerance
from aotdist.config import FSDP_MODES


def _fsdp_rank(
    rank: int,
    world_size: int,
    spec: str,
    backend: str,
    seed: int,
    mode: str = "hooks",
    steps: int = STEPS,
) -> dict:
    """One rank of :func:`check_fsdp`: every rank trains ``steps`` SGD steps on the whole
    batch, so the averaged sharded gradients (and the updates) equal the single-process
    eager ones."""
    import aotdist

    family = resolve(spec)
    start = time.perf_counter()
    result = CheckResult(
        family.name, family.kind, family.source, fsdp=world_size, fsdp_mode=mode, steps=steps
    )
    model, inputs = family.build(seed)
    without_randomness(model)
    reference = copy.deepcopy(model)
    train(family, reference, inputs, steps=steps, seed=seed, record=(eager := Run()))
    result.loss_eager = eager.losses[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            aotdist.parallelize(
                model,
                config={"fsdp": {"enabled": True, "mode": mode}, "compile": {"backend": backend}},
            )
            # hooks mode: each region's frame is compiled, its hooks run eagerly; in graph
            # mode Dynamo would trace a counting hook, and guard on what it counted
            counting = _instances_run(model) if mode == "hooks" else contextlib.nullcontext({})
            with counting as ran:
                m, diff, later = _train_tracked(
                    family,
                    model,
                    inputs,
                    steps=steps,
                    seed=seed,
                    against=eager,
                    rtol=tolerance(backend),
                )
            if later:
                result.notes.setdefault("later steps", later)
        except Exception as exc:  # noqa: BLE001 - reported
            result.status = "crash"
            result.error = "".join(traceback.format_exception(exc))[-3000:]
    result.warnings = _region_warnings(caught)
    if result.status != "crash":
        # Hooks mode compiles per-region frames: every instance of a kept region is a
        # compiled frame call. Graph-mode FSDP compiles the model as one graph of region
        # calls.
        result.loss_aotdist = diff.first_loss
        _verdict(result, m, diff, frames=mode == "hooks", ran=ran)
    result.seconds = time.perf_counter() - start
    return result.to_dict()


@contextlib.contextmanager
def _instances_run(model: nn.Module):
    """Within: counts, per region, the instances of ``model`` whose forward ran."""
    from aotdist.compile.state import STATE_ATTR

    plan = vars(model)[STATE_ATTR].plan
    ran: dict[str, set[str]] = {r.name: set() for r in plan}
    counts: dict[str, int] = {}
    handles = [
        model.get_submodule(fqn).register_forward_pre_hook(
            lambda mod, args, r=region.name, f=fqn: ran[r].add(f)
        )
        for region in plan
        for fqn in region.fqns
    ]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()
        counts.update({name: len(fqns) for name, fqns in ran.items()})


def check_fsdp(
    family: Family | str,
    world_size: int,
    *,
    backend: str = "aot_eager",
    seed: int = 0,
    timeout: float = 600.0,
    mode: str = "hooks",
    steps: int = STEPS,
) -> CheckResult:
    """``steps`` SGD steps under FSDP2 (``aotdist.parallelize``, ``fsdp.mode`` ``mode``:
    ``"hooks"`` or ``"graph"``) on ``world_size`` gloo ranks against single-process
    eager (losses, gradients and buffers after each); the worst rank's result.

    Raises:
        ValueError: ``mode`` is not one of ``aotdist.config.FSDP_MODES``.
    """
    from aotdist.launch import run_distributed

    if mode not in FSDP_MODES:
        raise ValueError(
            f"check_fsdp(mode={mode!r}): FSDP modes are 'hooks' (FSDP2's "
            "units) and 'graph' (graph-mode FSDP: collectives in the compiled "
            "graph)"
        )
    spec = family if isinstance(family, str) else family.name
    outs = run_distributed(
        _fsdp_rank, world_size, spec, backend, seed, mode, steps, timeout=timeout
    )
    fields = set(CheckResult.__dataclass_fields__)
    results = [CheckResult(**{k: v for k, v in o.items() if k in fields}) for o in outs]
    return next((r for r in results if not r.ok), results[0])
