"""The one list of region fixes (aotdist.fixes.FIXES): the docs' table is the list, each
entry names a test that exists, and the code that owns a stage runs what the list holds
(an entry added is run; nothing else is needed)."""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import aotdist
from aotdist import fixes, metrics
from aotdist.testing import TinyGPT, assert_training_parity, example_inputs

ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(
    r"<!-- generated from aotdist.fixes.FIXES: begin -->\n(.*?)<!-- generated from "
    r"aotdist.fixes.FIXES: end -->",
    re.S,
)


def _design_table(text: str) -> str:
    found = _BLOCK.search(text)
    assert found, "docs/design.md has no generated fixes table"
    return found.group(1)


def test_the_design_table_is_the_list():
    text = (ROOT / "docs" / "design.md").read_text()
    assert _design_table(text) == fixes.table(), (
        "docs/design.md's fixes table differs from aotdist.fixes.FIXES. Fix: paste the "
        'output of python -c "import aotdist.fixes as f; print(f.table())" between its markers'
    )


def test_the_table_check_sees_an_entry_the_docs_lack(monkeypatch):
    text = (ROOT / "docs" / "design.md").read_text()
    extra = dataclasses.replace(fixes.FIXES[0], name="extra", change="an extra change")
    monkeypatch.setattr(fixes, "FIXES", (*fixes.FIXES, extra))
    assert _design_table(text) != fixes.table()


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_every_fix_names_a_test_that_exists_and_a_unique_name():
    for fix in fixes.FIXES:
        path, _, name = fix.test.partition("::")
        assert (ROOT / path).is_file(), f"{fix.name}: no test file {path}"
        assert name in _test_functions(ROOT / path), f"{fix.name}: {path} has no {name}"
        assert fix.change and fix.applies and fix.guarantee and fix.undo, fix.name
    names = [fix.name for fix in fixes.FIXES]
    assert len(names) == len(set(names)), names


def test_the_list_holds_each_stage_in_one_run_in_the_stages_order():
    stages = [fix.stage for fix in fixes.FIXES]
    runs = [s for i, s in enumerate(stages) if i == 0 or s is not stages[i - 1]]
    assert runs == list(fixes.Stage), runs  # every stage, once, in Stage's order


def test_a_graph_pass_added_to_the_list_runs_on_every_dynamo_graph(monkeypatch):
    seen = []
    added = fixes.Fix(
        "counting pass",
        fixes.Stage.GRAPH_PASS,
        lambda gm: seen.append(sum(1 for n in gm.graph.nodes if n.op == "call_function")),
        change="c",
        applies="a",
        guarantee="g",
        undo="u",
        test="t",
    )
    monkeypatch.setattr(fixes, "FIXES", (*fixes.FIXES, added))
    model = aotdist.compile_regions(TinyGPT(depth=3), backend="aot_eager")
    (x,), _ = example_inputs(model)
    model(x).sum().backward()
    assert seen and all(n > 0 for n in seen), seen


def test_a_module_swap_added_to_the_list_is_applied_at_marking_and_undone_by_restore(
    monkeypatch,
):
    calls = []
    swap = SimpleNamespace(
        swap=lambda module: calls.append(("swap", type(module).__name__)) or [],
        restore=lambda module: calls.append(("restore", type(module).__name__)),
    )
    added = dataclasses.replace(fixes.FIXES[0], name="recording swap", run=swap)
    monkeypatch.setattr(fixes, "FIXES", (added, *fixes.FIXES))
    model = aotdist.compile_regions(TinyGPT(depth=2), backend="aot_eager")
    assert [c[0] for c in calls] == ["swap", "swap"], calls
    aotdist.restore(model)
    assert [c[0] for c in calls].count("restore") == 2, calls


def test_a_dynamo_patch_is_entered_in_its_scopes_only(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def patch():
        entered.append(True)
        yield

    added = dataclasses.replace(
        fixes.FIXES[-1], name="recording patch", run=patch, scopes=frozenset({fixes.SAVE})
    )
    monkeypatch.setattr(fixes, "FIXES", (*fixes.FIXES, added))
    with fixes.dynamo_patches(fixes.COMPILE), fixes.dynamo_patches(fixes.CAPTURE):
        pass
    assert not entered
    with fixes.dynamo_patches(fixes.SAVE):
        assert entered == [True]


class _MaskBlock(nn.Module):
    """Hands its keep mask, which needs no gradient, on to the next block unchanged (as
    attention blocks pass their mask): an output aliasing an input, cloned by the
    aliasing-output fix; on torch 2.11 the clone would need a gradient at the next call
    site, which the no-gradient-outputs fix prevents by detaching it in the subgraph."""

    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x, mask):
        return torch.tanh(self.fc(x)) * mask + x, mask


class _MaskNet(nn.Module):
    def __init__(self, dim: int = 8, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(dim, dim)  # every block's input needs a gradient
        self.blocks = nn.ModuleList(_MaskBlock(dim) for _ in range(depth))

    def forward(self, x):
        x = self.inp(x)
        mask = (x.detach().abs() > 0.1).to(x.dtype)  # needs no gradient
        for block in self.blocks:
            x, mask = block(x, mask)
        return x


def test_a_region_returning_a_mask_that_needs_no_gradient_trains_as_eager():
    torch.manual_seed(0)
    model = _MaskNet()  # each block's weights its own
    reference = copy.deepcopy(model)
    aotdist.compile_regions(model, backend="aot_eager")
    batches = [(torch.randn(4, 8),) for _ in range(3)]
    with metrics.track(model) as m, pytest.warns(aotdist.RegionCompileWarning, match="aliases"):
        assert_training_parity(model, reference, batches, loss_fn=lambda out: out.square().mean())
    region = m.regions["_MaskBlock"]  # without the fixes (torch 2.11): 3 inlined, no reuse
    assert region.subgraphs == 1 and region.call_sites == 3, m.summary()
    assert not m.demoted and not m.reuse, m.summary()
