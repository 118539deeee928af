"""The check's float64 judgement (aotdist.check.rounding): gradients off eager's by no more
than eager's own float32 rounding pass, further off do not, and a model that cannot run
in float64 keeps the verdict."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aotdist.check.rounding import as_float64, describe, only_rounding, rounding_errors


def _grads(noise: float) -> list[dict]:
    """One step's gradients: a large one, and one zero in exact arithmetic (``noise``)."""
    return [{"w": torch.tensor([1.0, 0.5]), "b": torch.tensor([noise])}]


def test_a_run_as_close_to_float64_as_eager_is_rounding_and_a_further_one_is_not():
    exact = [
        {
            "w": torch.tensor([1.0, 0.5], dtype=torch.float64),
            "b": torch.tensor([0.0], dtype=torch.float64),
        }
    ]
    errors = rounding_errors(
        lambda: exact, {"eager": _grads(1e-6), "near": _grads(-1.5e-6), "far": _grads(1e-4)}
    )
    # scaled by a thousandth of the largest gradient: 1e-6 -> 1e-3
    assert errors["eager"] == pytest.approx(1e-3, rel=1e-2)
    assert errors["near"] == pytest.approx(1.5e-3, rel=1e-2)
    assert only_rounding(errors, "near", rtol=1e-4)
    assert not only_rounding(errors, "far", rtol=1e-4)
    assert "eager's own by 1.0e-03" in describe(errors, "near", 2.5e-3)


def test_a_model_that_cannot_run_in_float64_keeps_the_verdict():
    def no_float64_kernel():
        raise RuntimeError("\"addmm\" not implemented for 'Double'")

    errors = rounding_errors(no_float64_kernel, {"eager": _grads(0.0)})
    assert errors is None and not only_rounding(errors, "eager", rtol=1e-4)


def test_float64_copies_leave_the_model_and_inputs_as_they_were():
    model = nn.Linear(2, 2)
    inputs = {"x": torch.randn(2, 2), "ids": torch.arange(2), "pair": (torch.ones(1), 3)}
    model64, inputs64 = as_float64(model, inputs)
    assert model.weight.dtype == torch.float32 and model64.weight.dtype == torch.float64
    assert inputs64["x"].dtype == torch.float64 and inputs["x"].dtype == torch.float32
    assert inputs64["ids"].dtype == torch.int64 and inputs64["pair"][1] == 3
    assert inputs64["pair"][0].dtype == torch.float64
