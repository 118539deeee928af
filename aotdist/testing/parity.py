"""Parity helpers: run a model and a reference on the same inputs, compare everything."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


def forward_backward(model: nn.Module, args: Sequence, loss_fn: Callable | None = None):
    """Runs forward and backward; returns (output, {param name: grad})."""
    model.zero_grad(set_to_none=True)
    out = model(*args)
    tensor = out if isinstance(out, torch.Tensor) else out[0]
    loss = loss_fn(tensor) if loss_fn is not None else tensor.float().pow(2).mean()
    loss.backward()
    grads = {
        n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()
    }
    return tensor.detach(), grads


def assert_parity(
    model: nn.Module,
    reference: nn.Module,
    args: Sequence,
    *,
    loss_fn: Callable | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> None:
    """Asserts that forward outputs and every parameter's gradient match the reference.

    Raises:
        AssertionError: Names the first parameter whose gradient differs, or the output.
    """
    out, grads = forward_backward(model, args, loss_fn)
    ref_out, ref_grads = forward_backward(reference, args, loss_fn)
    torch.testing.assert_close(out, ref_out, rtol=rtol, atol=atol, msg="forward output differs")
    if list(grads) != list(ref_grads):
        raise AssertionError(f"parameter names differ: {list(grads)[:5]} vs {list(ref_grads)[:5]}")
    for name, g in grads.items():
        r = ref_grads[name]
        if (g is None) != (r is None):
            raise AssertionError(f"gradient of {name}: {g is None=} but reference {r is None=}")
        if g is not None:
            torch.testing.assert_close(
                g, r, rtol=rtol, atol=atol, msg=lambda m, n=name: f"gradient of {n} differs: {m}"
            )


def assert_training_parity(
    model: nn.Module,
    reference: nn.Module,
    batches: Sequence[Sequence],
    *,
    loss_fn: Callable | None = None,
    lr: float = 0.1,
    seed: int = 0,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> None:
    """Trains ``model`` and ``reference`` with SGD, one step per batch, from the same RNG
    state each step; asserts equal outputs, gradients and buffers after every step.

    Raises:
        AssertionError: Names the step and the output, parameter or buffer that differs.
    """
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in (model, reference)]
    for step, args in enumerate(batches):
        torch.manual_seed(seed + step)
        got = forward_backward(model, args, loss_fn)
        torch.manual_seed(seed + step)
        want = forward_backward(reference, args, loss_fn)
        torch.testing.assert_close(
            got[0],
            want[0],
            rtol=rtol,
            atol=atol,
            msg=lambda m, s=step: f"step {s}: output differs: {m}",
        )
        for name, g in got[1].items():
            torch.testing.assert_close(
                g,
                want[1][name],
                rtol=rtol,
                atol=atol,
                msg=lambda m, n=name, s=step: f"step {s}: {n}: {m}",
            )
        for opt in opts:
            opt.step()
        for (name, b), (_, r) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
            torch.testing.assert_close(
                b,
                r,
                rtol=rtol,
                atol=atol,
                msg=lambda m, n=name, s=step: f"step {s}: buffer {n}: {m}",
            )
