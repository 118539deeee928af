"""aotdist's package logger and ``rank_zero_warn`` in a single process (no process group).

The 2-rank behaviour (rank 0 warns, rank 1 logs at DEBUG) is tested in
tests/distributed/test_fsdp_mixed_precision.py.
"""

from __future__ import annotations

import logging

import pytest
import torch

import aotdist
from aotdist.log import LOGGER_NAME, get_logger, rank_zero_warn
from aotdist.testing import record_logs


def test_package_logger_and_module_children():
    assert LOGGER_NAME == "aotdist"
    root = get_logger()
    assert root is logging.getLogger("aotdist")
    assert get_logger("aotdist") is root
    child = get_logger("aotdist.cache.store")
    assert child is logging.getLogger("aotdist.cache.store")
    assert get_logger("cache.store") is child  # a relative name is put under the package
    with record_logs("aotdist", logging.INFO) as logs:  # children propagate to "aotdist"
        child.info("from a child")
        logging.getLogger("other").warning("not aotdist's")
    assert [(r.name, r.getMessage()) for r in logs] == [("aotdist.cache.store", "from a child")]
    # the modules log through their own children of "aotdist"
    import importlib

    for name in ("aotdist.cache.store", "aotdist.parallelize"):
        assert importlib.import_module(name)._log.name == name


def test_progress_reaches_the_package_logger():
    model = aotdist.testing.build_model("gpt", depth=2)
    with record_logs("aotdist", logging.INFO) as logs:
        aotdist.parallelize(model, config={"compile": {"backend": "eager"}})
    mine = [r for r in logs if r.name == "aotdist.parallelize"]
    assert len(mine) == 1 and mine[0].levelno == logging.INFO, [r.getMessage() for r in logs]
    assert "1 region(s) ['GPTBlock']" in mine[0].getMessage()
    assert logging.getLogger("aotdist").level == logging.NOTSET  # record_logs put it back


def test_rank_zero_warn_without_process_group_warns_here():
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    with (
        record_logs("aotdist") as logs,
        pytest.warns(aotdist.ConfigWarning, match="no effect") as rec,
    ):
        rank_zero_warn("option x has no effect", aotdist.ConfigWarning, stacklevel=1)
    assert len(rec) == 1 and rec[0].filename == __file__  # stacklevel as warnings.warn's
    assert logs == []  # warned, not logged


def test_core_warnings_still_reach_a_single_process():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.warns(aotdist.RegionCompileWarning, match="no repeated regions"):
        aotdist.compile_regions(net, backend="eager")


def test_the_first_compile_says_what_it_compiles_and_how_long_it_took():
    from aotdist.testing import TinyGPT, example_inputs

    model = aotdist.compile_regions(TinyGPT(depth=3), backend="aot_eager")
    (x,), _ = example_inputs(model)
    with record_logs(level=logging.INFO) as logs:
        model(x).sum().backward()
        model(x).sum().backward()  # reused: says nothing more
    said = [r.getMessage() for r in logs if r.levelno == logging.INFO]
    assert len(said) == 2, said
    assert said[0].startswith("compiling TinyGPT: 1 region(s) (GPTBlock x3), backend aot_eager")
    assert said[1].startswith("compiled TinyGPT in ") and said[1].endswith("(1 graph(s))")


def test_the_log_reports_each_compile_and_the_total_not_only_the_first():
    # an evaluation pass (eval mode) compiles again: the log says so,
    # with the compile time so far, where it once reported the first compile alone
    model = aotdist.testing.build_model("gpt", depth=2)
    aotdist.compile_regions(model, backend="eager")
    x, _ = aotdist.testing.example_inputs(model, batch=2)
    with record_logs("aotdist", logging.INFO) as logs:
        model(*x)
        model(*x)  # reuses: nothing logged
        model.eval()
        with torch.no_grad():
            model(*x)
    said = [r.getMessage() for r in logs if r.name == "aotdist.compile.guard"]
    assert len(said) == 3, said  # compiling, compiled, compiled again
    assert said[1].startswith("compiled TinyGPT in "), said
    again = said[2]
    assert "again in" in again and "more graph(s)" in again and "compiling in all" in again
