"""Shared fixtures: every test starts from a clean Dynamo state and a fixed seed."""

from __future__ import annotations

import os

import pytest
import torch

# Two cores: keep intra-op threads from oversubscribing when tests spawn processes.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _fresh_compiler_state():
    """Resets Dynamo caches so one test's compiled frames never serve another's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
