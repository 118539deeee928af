"""Whether gradients off eager's are fp32 rounding only, judged against eager in float64.

A gradient that is zero in exact arithmetic (a convolution's bias before a BatchNorm) is
rounding noise in float32, different for every order of the same sums, so two correct
ways of computing it can differ by more than the check's tolerance. Eager run in float64
from the same weights gives the exact result to float32's precision: a run whose
gradients are no further from it than twice eager's own float32 gradients (or than the
tolerance) computes what eager computes, rounded otherwise. This is the rule of torch's
accuracy checker with its float64 reference (``torch._dynamo.utils.same(fp64_ref=...)``).
The check runs it only where gradients, and nothing else, are off eager's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from aotdist.compile.verify import compare_grads


def as_float64(model: nn.Module, inputs: Any) -> tuple[nn.Module, Any]:
    """A float64 copy of ``model``, and ``inputs`` with their floating tensors in float64."""

    def cast(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.double()
        if isinstance(value, dict):
            return {k: cast(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(cast(v) for v in value)
        return value

    return copy.deepcopy(model).double(), cast(inputs)


def rounding_errors(
    exact: Callable[[], list[dict]], runs: dict[str, list[dict]]
) -> dict[str, float] | None:
    """Each run's largest gradient difference from the float64 run ``exact()`` returns
    (its gradients per step), scaled as the check scales them, over the steps; ``None``
    where the model cannot run in float64 (an op without a float64 kernel)."""
    try:
        reference = exact()
    except Exception:  # noqa: BLE001 - the judgement is skipped, the verdict stands
        return None
    return {
        name: max(
            (
                compare_grads(step, ref, rtol=0.0)[0]
                for step, ref in zip(grads, reference, strict=False)
            ),
            default=0.0,
        )
        for name, grads in runs.items()
    }


def only_rounding(errors: dict[str, float] | None, name: str, rtol: float) -> bool:
    """Whether run ``name`` is as close to float64 eager as float32 eager is."""
    return errors is not None and errors[name] <= max(2 * errors["eager"], rtol)


def describe(errors: dict[str, float], name: str, diff: float) -> str:
    """The note: how far ``name`` is from eager, and each from float64 eager."""
    return (
        f"gradients off eager's by {diff:.1e} (scaled), fp32 rounding: against eager "
        f"in float64, {name}'s are off by {errors[name]:.1e} and eager's own by "
        f"{errors['eager']:.1e} (a gradient zero in exact arithmetic, as a bias before "
        "a BatchNorm, is rounding noise in float32)"
    )
