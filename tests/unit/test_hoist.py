"""The buffer-write pass (aotdist.fixes.hoist) on its own, on graphs Dynamo makes from
``nested_compile_region`` functions: a BatchNorm subclass with its own forward inside a
region nested in another region, whose subgraph is also called at the top level, trains
as eager does (losses, gradients, running statistics) with every region one subgraph."""

from __future__ import annotations

import copy

import torch
from torch import nn

from aotdist import _compat
from aotdist.fixes.hoist import hoist_buffer_updates
from aotdist.testing.models import BatchNormRelu


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.norm = BatchNormRelu(4)

    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()
        self.conv = nn.Conv2d(4, 4, 1)

    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.inner(x)) + x


def _backend(seen: list):
    aot_eager, _ = _compat.aot_eager_parts()

    def backend(gm, example_inputs):
        seen.append(hoist_buffer_updates(gm))
        return aot_eager(gm, example_inputs)

    return backend


def test_a_nested_region_s_batchnorm_writes_leave_both_regions_and_train_as_eager():
    torch.manual_seed(0)
    # the inner subgraph is called at the top level and inside the outer one
    model = nn.Sequential(nn.Conv2d(3, 4, 1), _Inner(), _Outer(), _Outer(), _Inner()).train()
    reference = copy.deepcopy(model)
    seen: list = []
    compiled = torch.compile(model, backend=_backend(seen), fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(2, 3, 6, 6, generator=g, requires_grad=True)
        loss = compiled(x).square().mean()
        ref_loss = reference(x).square().mean()
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, msg=f"step {step}: loss")
        for (n, p), (_, r) in zip(
            model.named_parameters(), reference.named_parameters(), strict=True
        ):
            torch.testing.assert_close(p.grad, r.grad, msg=f"step {step}: grad {n}")
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        for (n, b), (_, r) in zip(model.named_buffers(), reference.named_buffers(), strict=True):
            torch.testing.assert_close(b, r, msg=f"step {step}: buffer {n}")
    assert len(seen) == 1 and len(seen[0]) == 2, seen  # one graph; both subgraphs rewritten
    assert model[1].norm.num_batches_tracked.item() == 3
