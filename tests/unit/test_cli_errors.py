"""The CLI's one error path: each user mistake is one screen with the fix, exit 2 for
usage and 1 for a failed check; ``--debug`` or ``AOTDIST_DEBUG=1`` shows the traceback."""

from __future__ import annotations

import re
import sys
import textwrap

import pytest

from aotdist.check import CheckResult
from aotdist.cli import DEBUG_ENV, main

FACTORIES = """
    import torch
    from torch import nn


    def build():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])
        return model, (torch.randn(2, 8),)


    def broken():
        return helper()


    def helper():
        raise ValueError("vocab_size must be positive, got -1")


    def not_a_pair():
        return nn.Linear(2, 2)
"""


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A working directory holding ``clifactories.py``, not on ``sys.path`` (as under the
    console script)."""
    (tmp_path / "clifactories.py").write_text(textwrap.dedent(FACTORIES))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "clifactories", raising=False)
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    yield tmp_path
    sys.modules.pop("clifactories", None)


def _screen(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()


@pytest.mark.parametrize(
    "flag, name, close",
    [
        ("--hf", "not_a_model", None),
        ("--hf", "lama", "llama"),
        ("--torchvision", "not_a_model", None),
        ("--torchvision", "resnet5", "resnet50"),
    ],
)
def test_a_library_model_name_it_lacks_is_a_usage_mistake_with_one_line_and_the_fix(
    capsys, monkeypatch, flag, name, close
):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert main(["check", flag, name]) == 2
    (line,) = _screen(capsys)
    assert line.startswith(f"aotdist check: {flag} {name}: the installed ")
    assert f"{name!r}" in line and "Fix: a name it has, e.g. " in line
    assert (
        (f"{name!r} (did you mean {close!r}?). Fix" in line)
        if close
        else "did you mean" not in line
    )
    assert len(line) < 300


def test_a_not_built_result_fails_the_check(capsys, monkeypatch):
    monkeypatch.setattr(
        "aotdist.check.check_family",
        lambda family, **kw: CheckResult(
            "llama", status="not built", error="ValueError: the tiny config is wrong"
        ),
    )
    assert main(["check", "llama"]) == 1
    err = capsys.readouterr().err
    assert "llama was not built, so nothing was checked: ValueError: the tiny config" in err


def test_the_zoo_fails_on_a_family_the_user_named_that_is_not_built(capsys, monkeypatch):
    results = [CheckResult("llama", status="reused"), CheckResult("nope", status="not built")]
    monkeypatch.setattr("aotdist.check.run_zoo", lambda *a, **kw: results)
    assert main(["zoo", "--families", "llama,hf:nope", "--out", ""]) == 1
    assert "failing: nope" in capsys.readouterr().err
    assert main(["zoo", "--families", "llama", "--out", ""]) == 0


@pytest.mark.timeout(120)
def test_a_factory_in_the_working_directory_is_checked(user_dir, capsys):
    assert main(["check", "clifactories:build"]) == 0, capsys.readouterr()
    assert capsys.readouterr().out.startswith("clifactories:build: ")


@pytest.mark.parametrize("more", [[], ["--nproc", "2"]], ids=["", "fsdp"])
def test_a_factory_that_raises_is_one_screen_naming_the_user_s_line(user_dir, capsys, more):
    assert main(["check", "clifactories:broken", *more]) == 1
    lines = _screen(capsys)
    assert lines[0] == (
        "aotdist check: clifactories:broken raised ValueError: vocab_size must be positive, got -1"
    )
    assert lines[1].startswith("  at clifactories.py:")
    assert lines[1].endswith('in helper: raise ValueError("vocab_size must be positive, got -1")')
    assert lines[2].startswith("Fix: ") and "--debug" in lines[2] and len(lines) == 3


def test_debug_and_the_environment_variable_show_the_user_s_exception(user_dir, monkeypatch):
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        main(["check", "clifactories:broken", "--debug"])
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        main(["--debug", "check", "clifactories:broken"])
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        main(["check", "clifactories:broken"])


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["check", "nomodule:build"],
            "aotdist check: cannot import 'nomodule' for 'nomodule:build'",
        ),
        (["check", "clifactories:buidl"], "has no function 'buidl' (did you mean 'build'?). Fix"),
        (["inspect", "--model", "nomodule:build"], "aotdist inspect: cannot import 'nomodule'"),
        (
            ["inspect", "--model", "nosuch"],
            "aotdist inspect: unknown model 'nosuch'; choose one of gpt, vit, resnet, aliasing",
        ),
        (["check", "nosuch"], "aotdist check: unknown model 'nosuch'"),
        (["check", "lama"], "or module:factory (did you mean 'llama'?)"),
        (["check", "mymodels.build"], "(did you mean mymodels:build, a module:factory?)"),
        (["check"], "aotdist check: give one model"),
    ],
)
def test_a_usage_mistake_is_one_line_and_exit_2(user_dir, capsys, argv, expected):
    assert main(argv) == 2
    (line,) = _screen(capsys)
    assert expected in line
    assert (
        "Fix" in line
        or "choose one of" in line
        or "give a family" in line
        or "give one model" in line
    )


def test_a_bad_flag_is_argparse_s_usage_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["check", "--fsdp-mode", "graphs", "llama"])
    assert exit_.value.code == 2
    assert "invalid choice: 'graphs'" in capsys.readouterr().err


def test_an_inspect_factory_that_raises_is_one_screen(user_dir, capsys):
    assert main(["inspect", "--model", "clifactories:broken"]) == 1
    lines = _screen(capsys)
    assert lines[0].startswith("aotdist inspect: clifactories:broken raised ValueError")
    assert len(lines) == 3


def test_a_factory_that_returns_the_wrong_thing_is_one_line(user_dir, capsys):
    assert main(["check", "clifactories:not_a_pair"]) == 1
    (line,) = _screen(capsys)
    assert line.startswith(
        "aotdist check: TypeError: clifactories:not_a_pair must return (model, inputs)"
    )
    assert "got Linear" in line


def test_version_and_help_show_what_runs_by_default(capsys):
    from aotdist.version import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"aotdist {__version__}"
    for command, shown in (
        ("check", "(default: aot_eager)"),
        ("zoo", "Runs `aotdist check`"),
        ("inspect", "Builds a model, finds its regions"),
        ("bench", "(default: inductor)"),
    ):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert shown in " ".join(capsys.readouterr().out.split()), command
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out  # no raw RST


@pytest.mark.parametrize(
    "argv, ranks, fsdp",
    [
        (["--nproc", "2"], 2, True),
        (["--fsdp", "2"], 2, True),
        (["--nproc", "2", "--fsdp"], 2, True),
        (["--fsdp", "2", "--nproc", "2"], 2, True),
        (["--fsdp"], 1, True),
    ],
)
def test_inspect_spells_ranks_as_every_subcommand_and_keeps_the_old_spelling(
    monkeypatch, capsys, argv, ranks, fsdp
):
    seen = {}

    def run_distributed(fn, nproc, opts, **kwargs):
        seen.update(nproc=nproc, fsdp=opts["fsdp"])
        return ["report"]

    monkeypatch.setattr("aotdist.launch.run_distributed", run_distributed)
    assert main(["inspect", "--model", "gpt", *argv]) == 0
    assert seen == {"nproc": ranks, "fsdp": fsdp}
    assert ("old spelling; use --nproc" in capsys.readouterr().err) == ("--fsdp" in argv)
    assert main(["inspect", "--fsdp", "2", "--nproc", "3"]) == 2
    assert "--fsdp 2 and --nproc 3 disagree" in capsys.readouterr().err


def _options(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    return text[text.index("options:") :]


def test_every_subcommand_spells_the_shared_options_alike_with_the_code_s_defaults(capsys):
    from aotdist.bench import MAIN_SETTINGS
    from aotdist.config import FSDPConfig

    for command in ("check", "zoo", "bench", "inspect"):  # each one trains
        options = _options(command, capsys)
        for flag in ("--nproc N", "--backend", "--memory-limit GB", "--timeout", "--debug"):
            assert flag in options, (command, flag)
        assert "--fsdp " not in options and "--mode " not in options, command  # hidden aliases
    for command in ("check", "inspect"):
        assert f"(default: {FSDPConfig().mode})" in _options(command, capsys)
    assert f"(default {MAIN_SETTINGS.repeats}, 1 with --quick)" in _options("bench", capsys)


def test_old_spellings_still_work(monkeypatch, capsys):
    from aotdist.cli import build_parser

    seen = {}
    monkeypatch.setattr("aotdist.check.run_zoo", lambda *a, **kw: seen.update(kw) or [])
    assert main(["zoo", "--fsdp", "3", "--out", ""]) == 0 and seen["fsdp_ranks"] == 3
    args = build_parser().parse_args(["bench", "--mode", "reduce-overhead"])
    assert args.compile_mode == "reduce-overhead"
    assert "old spelling; use --compile-mode" in capsys.readouterr().err


def test_the_zoo_writes_to_a_fresh_directory_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        "aotdist.check.run_zoo", lambda *a, **kw: [CheckResult("llama", status="reused")]
    )
    monkeypatch.setattr("aotdist.check.render", lambda results, **kw: "the table\n")
    assert main(["zoo", "--families", "llama"]) == 0
    assert (tmp_path / "zoo-out" / "models.md").read_text() == "the table\n"
    assert not (tmp_path / "docs").exists()


def test_bench_help_names_every_strategy_its_error_accepts(capsys):
    from aotdist.bench.strategies import STRATEGIES

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    options = text[text.index("options:") :]
    strategies = options[options.index("--strategies") : options.index("--backend")]
    named = set(re.findall(r"[\w+-]+", strategies))
    assert set(STRATEGIES) <= named, strategies


def test_a_module_that_raises_on_import_is_the_user_s_error(user_dir, capsys, monkeypatch):
    (user_dir / "clibroken.py").write_text("import torch\n\nraise RuntimeError('no GPU here')\n")
    monkeypatch.delitem(sys.modules, "clibroken", raising=False)
    assert main(["check", "clibroken:build"]) == 1
    lines = _screen(capsys)
    assert lines[0] == "aotdist check: clibroken:build raised RuntimeError: no GPU here"
    assert lines[1] == "  at clibroken.py:3 in <module>: raise RuntimeError('no GPU here')"
    sys.modules.pop("clibroken", None)
    with pytest.raises(RuntimeError, match="no GPU here"):
        main(["check", "clibroken:build", "--debug"])
    sys.modules.pop("clibroken", None)
