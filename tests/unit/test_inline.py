"""Region calls flattened before the compiler (aotdist.backends.inline, a measured lever)."""

from __future__ import annotations

import copy

import pytest
import torch

import aotdist
from aotdist.backends import inline
from aotdist.backends.aot import aot_backend
from aotdist.testing.models import TinyGPT


def _train(model, x, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _model_and_batch():
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, depth=3, heads=2, seq_len=8)
    with torch.no_grad():  # blocks whose weights differ (they do already; make it certain)
        for i, block in enumerate(model.blocks):
            for p in block.parameters():
                p.add_(0.01 * (i + 1))
    return model, torch.randint(0, 64, (2, 8))


def test_inlined_regions_match_eager_and_leave_no_region_call():
    model, x = _model_and_batch()
    ref_losses, ref_params = _train(copy.deepcopy(model), x)
    seen = []

    def flatten(gm, kind):
        seen.append(
            (
                kind,
                inline.inline_regions(gm),
                sum(n.target is torch.ops.higher_order.invoke_subgraph for n in gm.graph.nodes),
            )
        )

    aotdist.compile_regions(model, backend=aot_backend("aot_eager", on_graph=flatten))
    losses, params = _train(model, x)
    assert losses == ref_losses
    for got, want in zip(params, ref_params, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert seen == [("forward", 3, 0), ("backward", 3, 0)]  # 3 blocks, one call each


def test_inline_regions_without_calls_changes_nothing():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    code = gm.code
    assert inline.inline_regions(gm) == 0 and gm.code == code


@pytest.mark.inductor
def test_inline_backend_compiles_flat_graphs_with_inductor(monkeypatch):
    model, x = _model_and_batch()
    ref_losses, _ = _train(copy.deepcopy(model), x, steps=2)
    counts = []
    real = inline.inline_regions
    monkeypatch.setattr(inline, "inline_regions", lambda gm: counts.append(real(gm)))
    aotdist.compile_regions(model, backend=inline.inline_backend())
    losses, _ = _train(model, x, steps=2)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
    assert counts == [3, 3]
