"""SGD steps of one model on one batch, recorded (eager) or compared after each step with
eager's record (losses, gradients, buffers), for :mod:`aotdist.check.runner`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from aotdist.check.families import Family
from aotdist.compile.verify import compare_grads

LR = 0.05


def _call(model: nn.Module, inputs: dict[str, Any]):
    if set(inputs) == {"*"}:
        return model(*inputs["*"])
    return model(**inputs)


def run_step(family: Family, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    loss = family.loss_of(_call(model, inputs))
    loss.backward()
    return loss.detach()


def grad_diff(
    model: nn.Module, reference: nn.Module, *, rtol: float
) -> tuple[float, bool, list[str]]:
    """:func:`aotdist.compile.verify.compare_grads` of the two models' gradients: the
    largest scaled difference, whether all are within ``rtol``, the zero-for-``None``
    gradients."""
    worst, bad, zeros = compare_grads(
        {n: p.grad for n, p in model.named_parameters()},
        {n: p.grad for n, p in reference.named_parameters()},
        rtol=rtol,
    )
    return worst, bad is None, zeros


@dataclass
class Diff:
    """How far one way of training is from eager, worst over the steps compared."""

    loss: float = 0.0  # absolute
    loss_ok: bool = True
    grad: float = 0.0  # scaled, as compare_grads scales
    grad_bad: str | None = None  # the first parameter beyond tolerance
    buffer: float | None = None  # ``None``: buffers not compared
    buffer_bad: str | None = None
    step: int | None = None  # the first step (1-based) that differs
    zeros: list[str] = field(default_factory=list)
    first_loss: float | None = None

    @property
    def ok(self) -> bool:
        return self.loss_ok and self.grad_bad is None and self.buffer_bad is None

    def add(
        self,
        step: int,
        loss: float,
        ref_loss: float,
        grads: dict,
        ref_grads: dict,
        buffers: dict | None,
        ref_buffers: dict | None,
        rtol: float,
    ) -> None:
        """Adds step ``step``'s comparison (losses, gradients, buffers after the update)."""
        self.loss = max(self.loss, abs(loss - ref_loss))
        loss_ok = abs(loss - ref_loss) <= rtol * max(1.0, abs(ref_loss))
        worst, bad, zeros = compare_grads(grads, ref_grads, rtol=rtol)
        self.grad = max(self.grad, worst)
        if step == 1:
            self.zeros, self.first_loss = zeros, loss
        ok = loss_ok and bad is None
        if ref_buffers is not None:
            # every buffer eager has (aotdist's own non-persistent ones aside)
            worst_b, bad_b, _ = compare_grads(
                {n: buffers.get(n) for n in ref_buffers}, ref_buffers, rtol=rtol
            )
            self.buffer = max(self.buffer or 0.0, worst_b)
            self.buffer_bad = self.buffer_bad or bad_b
            ok &= bad_b is None
        self.loss_ok &= loss_ok
        self.grad_bad = self.grad_bad or bad
        if not ok and self.step is None:
            self.step = step

    def verdict(self) -> str:
        """A compiled run's column: ``trains`` (as eager does), ``wrong gradients (...)``
        (or a wrong loss) or ``wrong buffers (...)``."""
        if self.ok:
            return "trains"
        if self.grad_bad or not self.loss_ok:
            return f"wrong gradients (grad diff {self.grad:.1e})"
        return f"wrong buffers (buffer diff {self.buffer:.1e})"

    def describe(self) -> str:
        """Where it first differs: the step and what."""
        what = [
            w
            for w, bad in (
                ("the loss", not self.loss_ok),
                (f"gradient of {self.grad_bad}", self.grad_bad),
                (f"buffer {self.buffer_bad}", self.buffer_bad),
            )
            if bad
        ]
        return f"differs from eager from step {self.step}: {', '.join(what)}"


def _snapshot(tensors) -> dict[str, torch.Tensor | None]:
    """Detached copies (complex ones as real pairs: compare_grads compares reals)."""
    out = {}
    for name, t in tensors:
        if t is not None:
            t = t.detach().clone()
            t = torch.view_as_real(t) if t.is_complex() else t
        out[name] = t
    return out


@dataclass
class Run:
    """Eager's record of each step: loss, gradients, buffers after the update."""

    losses: list[float] = field(default_factory=list)
    grads: list[dict] = field(default_factory=list)
    buffers: list[dict] = field(default_factory=list)


def train(
    family: Family,
    model: nn.Module,
    inputs: dict[str, Any],
    *,
    steps: int,
    seed: int,
    record: Run | None = None,
    against: Run | None = None,
    rtol: float = 0.0,
    call: nn.Module | None = None,
    after_first: Callable[[], None] | None = None,
) -> Diff | None:
    """``steps`` SGD steps of ``model`` (run as ``call``, default itself: a
    ``torch.compile`` wrapper of it) on ``inputs``, each from the same random seed whichever
    way the model runs; ``record`` keeps each step (eager), or each step is compared
    ``against`` eager's record. ``after_first`` is called once the first step is done."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    diff = Diff() if against is not None else None
    for i in range(steps):
        if i == 1 and after_first is not None:
            after_first()
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(seed + 1000 + i)  # the same random stream for every way, per step
        loss = run_step(family, model if call is None else call, inputs).item()
        grads = _snapshot((n, p.grad) for n, p in model.named_parameters())
        opt.step()
        buffers = _snapshot(model.named_buffers())
        if record is not None:
            record.losses.append(loss)
            record.grads.append(grads)
            record.buffers.append(buffers)
        if diff is not None:
            diff.add(
                i + 1,
                loss,
                against.losses[i],
                grads,
                against.grads[i],
                buffers,
                against.buffers[i],
                rtol,
            )
    return diff
