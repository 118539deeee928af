"""Shared fixtures: every test starts from a clean Dynamo state and a fixed seed; the
session fails if tests left files in the repository; ``gpu`` tests skip without CUDA."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

# Two cores: keep intra-op threads from oversubscribing when tests spawn processes.
torch.set_num_threads(min(2, os.cpu_count() or 1))
# Ranks forked from one process that imported torch once, not spawned (seconds each):
# aotdist.launch.runner.START_ENV. A test that changes the environment gets spawned ranks.
os.environ.setdefault("AOTDIST_RANK_START", "forkserver")


@pytest.fixture(autouse=True)
def _environment_restored():
    """Gives every test the environment the session started with: a library that sets
    variables in this process (Lightning's ``ddp_spawn`` leaves ``MASTER_PORT``) never
    reaches the next test or the processes it starts."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(autouse=True)
def _fresh_compiler_state():
    """Resets Dynamo caches so one test's compiled frames never serve another's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()


ROOT = Path(__file__).resolve().parents[1]
pytest_plugins = ["pytester"]


def _untracked() -> set[str] | None:
    """Untracked, non-ignored files of the repository; ``None`` outside a git checkout."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    proc = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return None
    return {line[3:] for line in proc.stdout.splitlines() if line.startswith("??")}


@pytest.fixture(scope="session", autouse=True)
def _repository_stays_clean():
    """Tests write into temporary directories only: fails the session otherwise."""
    before = _untracked()
    yield
    if before is None:
        return
    created = sorted(_untracked() - before)
    if created:
        pytest.fail(
            f"the tests created files in the repository (write into tmp_path): {created[:20]}",
            pytrace=False,
        )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
