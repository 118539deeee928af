"""Another library's regional compile, trained beside aotdist by ``aotdist check``.

A diffusers model class that declares ``_repeated_blocks`` (class names of its repeated
blocks) compiles those with ``model.compile_repeated_blocks(...)``: ``block.compile()`` on
each instance, each a ``torch.compile`` of its own. :func:`train_repeated_blocks` trains a
copy so compiled, with the check's backend, against eager's record, and says whether it
trains as eager does, in the words of the whole-model column; gradients off eager's are
judged against eager in float64 as the check judges aotdist's (fp32 rounding is not a
failure).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from aotdist._compat.models import declared_repeated_blocks
from aotdist.check.families import Family
from aotdist.check.rounding import as_float64, only_rounding, rounding_errors
from aotdist.check.steps import Run, train
from aotdist.errors import first_line


def declares_repeated_blocks(model: nn.Module) -> bool:
    """Whether ``model`` has diffusers' ``compile_repeated_blocks`` and names blocks for it."""
    return callable(getattr(model, "compile_repeated_blocks", None)) and bool(
        declared_repeated_blocks(model)
    )


def train_repeated_blocks(
    family: Family,
    model: nn.Module,
    inputs: dict[str, Any],
    *,
    backend: str,
    steps: int,
    seed: int,
    against: Run,
    rtol: float,
) -> str:
    """``model.compile_repeated_blocks(backend=backend)``, then ``steps`` SGD steps compared
    with eager's record ``against``: ``trains``, ``wrong gradients (grad diff ...)``,
    ``wrong buffers (...)`` or ``fails: <error>``."""
    try:
        exact = as_float64(model, inputs)  # before any step: eager in float64, if needed
    except (RuntimeError, TypeError):
        exact = None
    try:
        model.compile_repeated_blocks(backend=backend)
        diff = train(
            family,
            model,
            inputs,
            steps=steps,
            seed=seed,
            against=against,
            record=(run := Run()),
            rtol=rtol,
        )
    except Exception as exc:  # noqa: BLE001 - reported in the column, not raised
        return f"fails: {first_line(exc, 400)}"
    if diff.ok or not diff.loss_ok or diff.buffer_bad is not None or exact is None:
        return diff.verdict()

    def exact_grads() -> list[dict]:
        train(family, *exact, steps=steps, seed=seed, record=(eager64 := Run()))
        return eager64.grads

    errors = rounding_errors(exact_grads, {"eager": against.grads, "regions": run.grads})
    return "trains" if only_rounding(errors, "regions", rtol) else diff.verdict()
