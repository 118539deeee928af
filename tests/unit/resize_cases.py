"""The storage-resize pattern on a buffer, in its variants, crossed with aotdist's fixes.

Run as a script (``python resize_cases.py FIX ENTRY BACKEND``) by ``test_resize_crossed``,
one process per combination, so that a crash fails a test instead of killing pytest. Each
variant prints one JSON line before it starts and one with its result, so the last line
names the variant a crash killed.

A block grows its buffer's storage, writes the buffer (from its input, a parameter or a
constant, with or without ``no_grad``), reads it and frees the storage again; ENTRY says
whether the buffer's storage is empty before the first call (``empty``) or not (``full``).
FIX is what else acts on the region: ``plain`` (the buffer-write pass alone), ``batchnorm``
(torch's BatchNorm and a subclass with its own forward in the block), ``layout`` (the first
block fed a transposed input: the layout merge), ``ac`` (activation checkpointing),
``nested`` (the block inside another repeated region), ``fsdp`` (FSDP2 hooks mode, 2 ranks).
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import warnings

import torch
from torch import nn

N = 8
SOURCES = ("input", "parameter", "constant")
STEPS = 3


class OwnNorm(nn.BatchNorm1d):
    """A BatchNorm with a forward of its own: the buffer-write pass keeps its writes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(super().forward(x))


class ResizingBlock(nn.Module):
    def __init__(self, source: str, no_grad: bool, empty: bool, batchnorm: bool) -> None:
        super().__init__()
        self.source, self.no_grad = source, no_grad
        self.lin = nn.Linear(N, N)
        self.w = nn.Parameter(torch.randn(N))
        self.register_buffer("buf", torch.zeros(N))
        if empty:
            self.buf.untyped_storage().resize_(0)
        self.norms = nn.Sequential(nn.BatchNorm1d(N), OwnNorm(N)) if batchnorm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.buf.untyped_storage().resize_(N * self.buf.element_size())
        with torch.no_grad() if self.no_grad else contextlib.nullcontext():
            if self.source == "input":
                self.buf.copy_(x.detach().mean(0) if self.no_grad else x.mean(0).detach())
            elif self.source == "parameter":
                self.buf.copy_(self.w.detach() * 0.5)
            else:
                self.buf.fill_(0.25)
        y = self.lin(x) * self.w + self.buf
        if self.norms is not None:
            y = self.norms(y)
        self.buf.untyped_storage().resize_(0)
        return y


class Outer(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.proj = nn.Linear(N, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.inner(x)) + x


class Net(nn.Module):
    def __init__(self, fix: str, **variant) -> None:
        super().__init__()
        self.transpose = fix == "layout"
        self.embed = nn.Linear(N, N)
        blocks = [ResizingBlock(batchnorm=fix == "batchnorm", **variant) for _ in range(3)]
        if fix == "nested":
            blocks = [Outer(b) for b in blocks]
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        if self.transpose:  # the first block sees another layout than the others
            x = x.t().contiguous().t()
        for block in self.blocks:
            x = block(x)
        return x


def _storages(model: nn.Module) -> list[int]:
    return [b.untyped_storage().nbytes() for n, b in model.named_buffers() if n.endswith("buf")]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # an FSDP2 shard


def _compare(model: nn.Module, ref: nn.Module, loss, ref_loss) -> float:
    worst = (loss - ref_loss).abs().item()
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert (p.grad is None) == (r.grad is None), n
        if p.grad is not None:
            worst = max(worst, (_full(p.grad) - r.grad).abs().max().item())
    for b, r in zip(model.buffers(), ref.buffers(), strict=True):
        if b.untyped_storage().nbytes() and r.untyped_storage().nbytes():
            worst = max(worst, (b.float() - r.float()).abs().max().item())
    assert _storages(model) == _storages(ref), (_storages(model), _storages(ref))
    return worst


def _compile(model: nn.Module, fix: str, backend: str) -> None:
    import aotdist

    if fix == "fsdp":
        aotdist.parallelize(
            model, config={"compile": {"backend": backend}, "fsdp": {"enabled": True}}
        )
    elif fix == "ac":
        aotdist.parallelize(
            model, config={"compile": {"backend": backend}, "ac": {"enabled": True}}
        )
    elif fix == "nested":  # both classes regions, the inner ones inside the outer ones
        from aotdist.regions import Region, RegionPlan

        outer = [f"blocks.{i}" for i in range(len(model.blocks))]
        plan = RegionPlan(
            [
                Region("Outer", Outer, tuple(outer), "outer"),
                Region("ResizingBlock", ResizingBlock, tuple(f"{f}.inner" for f in outer), "inner"),
            ]
        )
        aotdist.compile_regions(model, backend=backend, plan=plan)
    else:
        aotdist.compile_regions(model, backend=backend)


def run_variant(fix: str, backend: str, **variant) -> dict:
    from aotdist import metrics

    torch.manual_seed(0)
    model = Net(fix, **variant).train()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compile(model, fix, backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        worst = 0.0
        with metrics.track(model) as tracked:
            for _ in range(STEPS):
                x = torch.randn(4, N, generator=g)
                loss, ref_loss = model(x).square().mean(), ref(x).square().mean()
                loss.backward(), ref_loss.backward()
                worst = max(worst, _compare(model, ref, loss, ref_loss))
                for o in (opt, ref_opt):
                    o.step(), o.zero_grad()
    regions = {
        name: [st.instances, st.call_sites, st.subgraphs] for name, st in tracked.regions.items()
    }
    return {
        "worst": worst,
        "regions": regions,
        "within": {
            name: [st.within, st.within_instances]
            for name, st in tracked.regions.items()
            if st.within
        },
        "demoted": sorted(tracked.demoted),
        "warnings": sorted({str(w.message)[:300] for w in caught if "aotdist" in str(w.message)}),
    }


def variants():
    for source in SOURCES:
        for no_grad in (True, False):
            yield {"source": source, "no_grad": no_grad}


def _rank(rank: int, world_size: int, backend: str, variant: dict) -> dict:
    # every rank trains on the same batches: FSDP's averaged gradients are eager's
    return run_variant("fsdp", backend, **variant)


def main(fix: str, entry: str, backend: str) -> None:
    for v in variants():
        v = {**v, "empty": entry == "empty"}
        print(json.dumps({"start": v}), flush=True)
        if fix == "fsdp":
            from aotdist.testing import run_distributed

            result = run_distributed(_rank, 2, backend, v, timeout=300)[0]
        else:
            result = run_variant(fix, backend, **v)
        print(json.dumps({"variant": v, **result}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
