"""RegionalCompile's ``config:`` under LightningCLI is parsed and validated by jsonargparse:
a typo is a parser error (exit 2, no traceback) whose first error is aotdist's message."""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("jsonargparse")
pytest.importorskip("lightning")

from aotdist.callbacks import RegionalCompile  # noqa: E402
from lightning.pytorch import LightningModule  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402


class Tiny(LightningModule):
    def __init__(self, width: int = 4):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)


def _cli(tmp_path, config: str) -> LightningCLI:
    path = tmp_path / "my.yaml"
    path.write_text(
        textwrap.dedent(f"""
        trainer:
          accelerator: cpu
          logger: false
          callbacks:
            - class_path: aotdist.callbacks.RegionalCompile
              init_args:
                config: {config}
                backend: aot_eager
    """)
    )
    return LightningCLI(Tiny, run=False, args=["--config", str(path)], save_config_callback=None)


@pytest.mark.parametrize(
    "config, message",
    [
        (
            "{ac: {enabeld: true}}",
            "invalid aotdist config: ac.enabeld: unknown key (did you "
            "mean 'enabled'?); known keys of ac: ['enabled']",
        ),
        (
            "{regions: {min_repeats: two}}",
            "invalid aotdist config: regions.min_repeats: expected an integer, got 'two'",
        ),
        ("{compile: {backend: indcutor}}", "unknown backend 'indcutor' (did you mean 'inductor'?)"),
    ],
)
def test_a_typo_in_the_callback_config_is_a_parser_error_led_by_aotdist_s_message(
    tmp_path, capsys, config, message
):
    with pytest.raises(SystemExit) as exit_:
        _cli(tmp_path, config)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = err[err.index("error: ") :]
    assert message in errors
    assert errors.index(message) < errors.index("Not a valid subclass of Callback")


def test_a_good_config_is_parsed_into_the_callback(tmp_path):
    cli = _cli(tmp_path, "{ac: {enabled: true}, regions: {min_repeats: 3}}")
    (callback,) = [c for c in cli.trainer.callbacks if isinstance(c, RegionalCompile)]
    assert callback.config.ac.enabled and callback.config.regions.min_repeats == 3
    assert callback.config.compile.backend == "aot_eager"
    dumped = cli.parser.dump(cli.config)  # what save_config writes
    assert "min_repeats: 3" in dumped


def test_a_mapping_and_a_path_still_work_in_python(tmp_path):
    path = tmp_path / "aotdist.yaml"
    path.write_text("ac: {enabled: true}\n")
    assert RegionalCompile({"ac": {"enabled": True}}).config.ac.enabled
    assert RegionalCompile(str(path)).config.ac.enabled
