"""Every config the project ships builds without an aotdist warning: a user who starts from
one is never told to change it (the recipes' runs are tests/integration's)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import yaml

import aotdist
from aotdist.float8 import warn_unverified_combination

ROOT = Path(__file__).resolve().parents[2]


def _lightning_configs():
    for path in sorted((ROOT / "configs" / "lightning").glob("*.yaml")):
        for cb in yaml.safe_load(path.read_text()).get("trainer", {}).get("callbacks", []) or []:
            if cb.get("class_path", "").endswith("RegionalCompile"):
                yield path.name, cb.get("init_args", {}).get("config") or {}


@pytest.mark.parametrize(
    "name,config",
    [
        *((p.name, p) for p in sorted((ROOT / "configs" / "aotdist").glob("*.yaml"))),
        *_lightning_configs(),
    ],
)
def test_a_shipped_config_builds_without_an_aotdist_warning(name, config):
    with warnings.catch_warnings():
        warnings.simplefilter("error", aotdist.RegionCompileWarning)
        warnings.simplefilter("error", aotdist.ConfigWarning)
        built = (
            aotdist.AOTDistConfig.from_yaml(config)
            if isinstance(config, Path)
            else aotdist.AOTDistConfig.from_dict(config)
        )
        warn_unverified_combination(built)


@pytest.mark.timeout(300)
def test_an_installed_aotdist_holds_the_recipes_and_the_configs_they_default_to(tmp_path):
    """Outside a clone the recipes' default config paths once failed: neither folder was
    installed. Built as a wheel and run from it, in a folder with no ``configs/``."""
    import importlib.metadata
    import subprocess
    import sys
    import zipfile

    setuptools = importlib.metadata.version("setuptools")
    if int(setuptools.split(".")[0]) < 77:  # pyproject's build-system asks for 77+
        pytest.skip(f"builds the wheel offline with setuptools 77+; this venv has {setuptools}")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path / "wheel"), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    for shipped in [*ROOT.glob("configs/*/*.yaml"), *ROOT.glob("recipes/*.py")]:
        inside = site / "aotdist" / shipped.relative_to(ROOT)
        assert inside.is_file(), f"{shipped.relative_to(ROOT)} is not installed"
    script = (
        "from pathlib import Path\n"
        "import aotdist, aotdist.config as c, aotdist.recipes.train_accelerate as r\n"
        "assert Path(r.parse_args([]).aotdist_config).is_file()\n"
        "try:\n"
        "    c.as_config('configs/aotdist/fsdp2.yaml')\n"
        "except aotdist.ConfigError as e:\n"
        "    print(e)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    fix = str(site / "aotdist" / "configs" / "aotdist" / "fsdp2.yaml")
    assert "not found: 'configs/aotdist/fsdp2.yaml'" in run.stdout and fix in run.stdout, run.stdout
