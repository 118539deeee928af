"""Every config the project ships builds without an aotdist warning: a user who starts from
one is never told to change it (the recipes' runs are tests/integration's)."""

from __future__ import annotations

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
