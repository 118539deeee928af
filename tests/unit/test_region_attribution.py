"""Every region call site is attributed to its region and instance, however Dynamo spells
the module path: the region is read from the class marking gave the instance, the instance
from the path, on every spelling Dynamo produces (``__dict__['_modules'][...]`` for a class
that defines ``__getattr__``, as diffusers' and peft's models do). ``<unknown>`` is a bug."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import aotdist
from aotdist import metrics
from aotdist.backends.recording import module_path_to_fqn
from aotdist.testing import assert_parity
from aotdist.testing.models import GPTBlock


@pytest.mark.parametrize(
    "path, fqn",
    [
        ("L['self'].blocks.1", "blocks.1"),
        ("L['self']._modules['blocks']._modules['1']", "blocks.1"),
        ("L['self'].__dict__['_modules']['blocks'].1", "blocks.1"),
        (
            "L['self'].__dict__['_modules']['base'].__dict__['_modules']['model'].layers.0",
            "base.model.layers.0",
        ),
        ("getattr(L['self'].blocks, '1')", "blocks.1"),
        ("L['self'].blocks[1]", "blocks.1"),
        ("L['self']._orig_mod.blocks.1", "blocks.1"),
        ("L['fn'].__self__.blocks.1", "blocks.1"),
        ("L['self']", ""),
        ("L['args'][0].blocks.1", ""),  # rooted at an argument: a frame compiled on its own
    ],
)
def test_every_spelling_of_a_module_path_reads_as_its_fqn(path, fqn):
    assert module_path_to_fqn(path) == fqn


class _Stack(nn.Module):
    """Blocks under a container whose class defines ``__getattr__`` (diffusers' ModelMixin
    and peft's PeftModel do): Dynamo then spells ``__dict__['_modules'][...]``."""

    def __init__(self, depth: int = 3, dim: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(GPTBlock(dim, 2) for _ in range(depth))

    def __getattr__(self, name: str):
        return super().__getattr__(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Stack()

    def __getattr__(self, name: str):
        return super().__getattr__(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


@pytest.mark.parametrize("build", [_Stack, _Wrapper], ids=["getattr", "getattr_twice"])
def test_regions_under_a_class_with_getattr_keep_their_name_and_instances(build):
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    aotdist.compile_regions(model, backend="aot_eager")
    x = torch.randn(2, 5, 16, requires_grad=True)
    with metrics.track(model) as tracked:
        assert_parity(model, ref, (x,))
    assert set(tracked.regions) == {"GPTBlock"}, tracked.summary()  # no <unknown>
    region = tracked.regions["GPTBlock"]
    assert (region.instances, region.call_sites, region.subgraphs) == (3, 3, 1), tracked.summary()


def test_capture_names_the_call_sites_under_a_class_with_getattr():
    torch.manual_seed(0)
    model = _Wrapper()
    cap = aotdist.capture(
        model, torch.randn(2, 5, 16, requires_grad=True), loss_fn=lambda out: out.sum()
    )
    sites = cap.regions["GPTBlock"].call_sites
    assert sites == [f"inner.blocks.{i}" for i in range(3)], sites


def test_the_region_is_read_from_the_marked_class_when_no_path_reads(monkeypatch):
    # a spelling no reader knows yet: the call sites still count for their region
    from aotdist.backends import recording

    monkeypatch.setattr(recording, "module_path_to_fqn", lambda path: "<unreadable>")
    torch.manual_seed(0)
    model = _Stack()
    aotdist.compile_regions(model, backend="aot_eager")
    with metrics.track(model) as tracked:
        model(torch.randn(2, 5, 16, requires_grad=True)).sum().backward()
    assert set(tracked.regions) == {"GPTBlock"}, tracked.summary()
    region = tracked.regions["GPTBlock"]
    assert (region.call_sites, region.subgraphs) == (3, 1), tracked.summary()
