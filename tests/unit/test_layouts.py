"""Region call sites that differ only in an input's layout (aotdist.fixes.layouts): a
CaiT-style class-token block, handed the token expanded over the batch first and a block's
output after, is one subgraph and trains as eager does; an input that needs no gradient is
never copied, so such a region keeps its second subgraph, and trains as eager does too.
A Flux-style joint block, handed slices of the block before's output and with its last
call's unused output dropped by Dynamo, is one subgraph too."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import aotdist
from aotdist.testing.parity import assert_training_parity


class _ClassBlock(nn.Module):
    """Attends from the class token ``cls`` to ``x``, as CaiT's class-attention blocks."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cls: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        u = self.proj(self.norm(torch.cat([cls, x], dim=1))) + bias
        return cls + u[:, :1] * u[:, 1:].mean(dim=1, keepdim=True)


class _ClassTokenNet(nn.Module):
    """The token expanded over the batch (stride 0) to the first block, then each block's
    output to the next; a bias that needs no gradient, expanded to the first block too
    where ``expanded_bias``, else contiguous; a count of steps kept outside the regions."""

    def __init__(self, dim: int = 8, depth: int = 3, expanded_bias: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.cls = nn.Parameter(torch.randn(1, 1, dim))
        self.blocks = nn.ModuleList(_ClassBlock(dim) for _ in range(depth))
        self.register_buffer("bias", torch.randn(1, 1, dim))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.expanded_bias = expanded_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.steps.add_(1)  # an update nothing reads: kept, not dead code
        x = self.embed(x)
        cls = self.cls.expand(x.shape[0], -1, -1)
        bias = self.bias.expand(x.shape[0], 6, -1)
        if not self.expanded_bias:
            bias = bias.contiguous()
        for block in self.blocks:
            cls = block(x, cls, bias)
            bias = bias.contiguous()  # the later blocks: contiguous
        return cls.squeeze(1)


def _train_against_eager(model: nn.Module, steps: int = 3):
    """3 SGD steps compiled and eager from the same weights: outputs, gradients and
    buffers compared after each; returns the compiled run's metrics."""
    reference = copy.deepcopy(model)
    aotdist.compile_regions(model, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 5, 8, generator=g),) for _ in range(steps)]
    with aotdist.metrics.track(model) as metrics:
        assert_training_parity(model, reference, batches, rtol=0.0, atol=0.0)
    return metrics


def test_an_expanded_first_input_shares_the_subgraph_of_the_later_calls():
    torch.manual_seed(0)
    model = _ClassTokenNet()
    metrics = _train_against_eager(model)
    block = metrics.regions["_ClassBlock"]
    assert (block.call_sites, block.subgraphs) == (3, 1), block
    assert model.steps.item() == 3


def test_an_input_that_needs_no_gradient_is_not_copied():
    torch.manual_seed(0)
    model = _ClassTokenNet(expanded_bias=True)
    with pytest.warns(aotdist.RegionCompileWarning, match="compiled 2 times"):
        metrics = _train_against_eager(model)
    block = metrics.regions["_ClassBlock"]
    # the first call is its own subgraph (torch 2.11) or inlined (2.14: called once)
    assert block.subgraphs + block.inlined == 2, block


class _JointBlock(nn.Module):
    """Flux's single blocks: attends over the context and the image tokens joined, and
    returns both parts as slices of one output."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor):
        n = ctx.shape[1]
        h = self.proj(self.norm(torch.cat([ctx, x], dim=1)))
        return h[:, :n], x + h[:, n:]


class _JointNet(nn.Module):
    """The first block gets contiguous inputs, the later ones the slices (other strides);
    nothing reads the last block's context output, which Dynamo drops from its subgraph."""

    def __init__(self, dim: int = 8, depth: int = 3, transposed: bool = False) -> None:
        super().__init__()
        self.embed, self.ctx_embed = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(_JointBlock(dim) for _ in range(depth))
        self.transposed = transposed  # the first block's input in no standard layout either

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, ctx = self.embed(x), self.ctx_embed(x[:, :2])
        if self.transposed:
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        for block in self.blocks:
            ctx, x = block(x, ctx)
        return x.mean(dim=1)


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_slices_in_and_an_output_dropped_at_the_last_call_share_one_subgraph(transposed):
    # transposed: no call's input is in a standard layout (HunyuanVideo's single blocks):
    # every call's is made contiguous
    torch.manual_seed(0)
    metrics = _train_against_eager(_JointNet(transposed=transposed))
    block = metrics.regions["_JointBlock"]
    assert (block.call_sites, block.subgraphs, block.inlined) == (3, 1, 0), metrics.summary()
