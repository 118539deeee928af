"""aotdist's warnings name the user's line, not aotdist's keyword-only wrapper or its
internals: through ``compile_regions``, ``parallelize``, a config and a compiled call."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from torch import nn

import aotdist


class GraphBreakBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        torch._dynamo.graph_break()  # the region cannot be one subgraph: demoted, warned
        return self.linear(x).relu()


def _one(caught, category, match: str) -> warnings.WarningMessage:
    mine = [w for w in caught if issubclass(w.category, category) and match in str(w.message)]
    assert len(mine) == 1, [(w.filename, str(w.message)[:80]) for w in caught]
    return mine[0]


def _line_of(fn, text: str) -> int:
    """The line number of the first line of ``fn`` holding ``text``."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize("apply", ["compile_regions", "parallelize"])
def test_a_warning_through_the_entry_points_names_the_caller_s_line(apply):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if apply == "compile_regions":
            aotdist.compile_regions(nn.Sequential(nn.Linear(4, 4)), backend="eager")  # here
        else:
            aotdist.parallelize(
                nn.Sequential(nn.Linear(4, 4)),  # here
                config={"compile": {"backend": "eager"}},
            )
    w = _one(caught, aotdist.RegionCompileWarning, "no repeated regions")
    assert w.filename == __file__, w.filename
    assert w.lineno == _line_of(
        test_a_warning_through_the_entry_points_names_the_caller_s_line,
        f"aotdist.{apply}(",
    )


def test_a_config_warning_names_the_caller_s_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aotdist.AOTDistConfig.from_dict({"float8": {"enabled": True, "fsdp_all_gather": True}})
    w = _one(caught, aotdist.ConfigWarning, "float8.fsdp_all_gather has no effect")
    assert w.filename == __file__, w.filename


def test_a_region_demoted_in_the_first_call_names_the_caller_s_line():
    torch.manual_seed(0)
    model = nn.Sequential(GraphBreakBlock(), GraphBreakBlock())
    aotdist.compile_regions(model, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(2, 8)).sum().backward()  # the call that compiles
    w = _one(caught, aotdist.RegionCompileWarning, "cannot be a reusable subgraph")
    assert w.filename == __file__, w.filename
    assert w.lineno == _line_of(
        test_a_region_demoted_in_the_first_call_names_the_caller_s_line,
        "model(torch.randn(2, 8)).sum().backward()",
    )


def test_packages_from_another_environment_are_not_the_users_line(tmp_path, monkeypatch):
    """torch found through a venv's --system-site-packages or a .pth naming another
    environment (outside this one's purelib) is a library, not the user's code."""
    from aotdist.log import _internal_prefixes, is_user_file

    elsewhere = tmp_path / "other-env" / "lib" / "python3" / "site-packages"
    library = elsewhere / "torch" / "nn" / "modules" / "module.py"
    assert is_user_file(str(library))  # not on sys.path: could be anyone's file
    monkeypatch.syspath_prepend(str(elsewhere))
    _internal_prefixes.cache_clear()  # read once per process, from sys.path at that time
    try:
        assert not is_user_file(str(library))
        assert is_user_file(str(tmp_path / "train.py"))  # the user's script stays theirs
    finally:
        monkeypatch.undo()
        _internal_prefixes.cache_clear()
