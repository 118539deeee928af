"""AOTDistConfig: strict loading, every problem listed, no-effect options warn."""

from __future__ import annotations

import dataclasses
import pathlib
import warnings

import pytest

from aotdist import AOTDistConfig, ConfigError, ConfigWarning

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


def test_defaults():
    cfg = AOTDistConfig()
    assert cfg.compile.enabled and cfg.compile.backend == "inductor"
    assert not cfg.fsdp.enabled and cfg.fsdp.reshard_after_forward
    assert not cfg.float8.enabled and not cfg.float8.fsdp_all_gather
    assert not cfg.ac.enabled
    assert AOTDistConfig.from_dict(None) == cfg == AOTDistConfig.from_dict({})


def test_from_dict_sets_values_and_round_trips():
    cfg = AOTDistConfig.from_dict(
        {
            "regions": {"include": ["GPTBlock"], "min_repeats": 3},
            "fsdp": {"enabled": True, "reshard_after_forward": False, "param_dtype": "bfloat16"},
            "float8": {"enabled": True, "fsdp_all_gather": True, "exclude": ["head"]},
            "compile": {"backend": "aot_eager"},
            "ac": {"enabled": True},
        }
    )
    assert cfg.regions.include == ("GPTBlock",) and cfg.regions.min_repeats == 3
    assert cfg.fsdp.param_dtype == "bfloat16" and not cfg.fsdp.reshard_after_forward
    assert cfg.float8.exclude == ("head",)
    assert AOTDistConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.replace(ac={"enabled": False}).ac.enabled is False
    assert cfg.ac.enabled is True  # replace made a copy


def test_frozen():
    cfg = AOTDistConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.fsdp.enabled = True


def test_every_problem_is_listed_with_its_key():
    with pytest.raises(ConfigError) as info:
        AOTDistConfig.from_dict(
            {
                "compil": {},
                "fsdp": {"enabld": True, "reshard_after_forward": "yes"},
                "compile": {"backend": 3, "mode": "fast"},
                "float8": {"recipe": "rowwise", "fsdp_all_gather": True},
                "regions": {"min_repeats": 0},
            }
        )
    problems = info.value.problems
    keys = sorted(p.split(":")[0] for p in problems)
    assert keys == [
        "compil",
        "compile.backend",
        "compile.mode",
        "float8.fsdp_all_gather",
        "fsdp.enabld",
        "fsdp.reshard_after_forward",
        "regions.min_repeats",
    ]
    text = str(info.value)
    assert "7 problems" in text
    assert "known keys of fsdp" in text and "'yes'" in text and "recipe: tensorwise" in text


@pytest.mark.parametrize(
    "data, key",
    [
        ({"fsdp": {"param_dtype": "fp8"}}, "fsdp.param_dtype"),
        ({"compile": {"mode": "max-autotune", "backend": "aot_eager"}}, "compile.mode"),
        ({"compile": {"enabled": 1}}, "compile.enabled"),
        ({"regions": {"include": "GPTBlock"}}, "regions.include"),
        ({"fsdp": True}, "fsdp"),
        ({"float8": {"recipe": "columnwise"}}, "float8.recipe"),
        ({"fsdp": {"enabled": True, "mode": "graph", "bucket_mb": -1}}, "fsdp.bucket_mb"),
        ({"fsdp": {"enabled": True, "mode": "graph", "bucket_mb": "25"}}, "fsdp.bucket_mb"),
        ({"fsdp": {"enabled": True, "mode": "graph", "bucket_mb": True}}, "fsdp.bucket_mb"),
        ({"fsdp": {"enabled": True, "overlap": True}}, "fsdp.overlap"),
        ({"fsdp": {"enabled": True, "mode": "graph", "overlap": "yes"}}, "fsdp.overlap"),
    ],
)
def test_single_bad_values(data, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        AOTDistConfig.from_dict(data)


def test_fsdp_bucketing_and_overlap_keys():
    cfg = AOTDistConfig.from_dict({"fsdp": {"enabled": True, "mode": "graph"}})
    assert cfg.fsdp.bucket_mb == 2000.0 and cfg.fsdp.overlap is False  # on by default
    for off in (None, 0):
        assert (
            AOTDistConfig.from_dict(
                {"fsdp": {"enabled": True, "mode": "graph", "bucket_mb": off}}
            ).fsdp.bucket_mb
            == off
        )
    cfg = AOTDistConfig.from_dict(
        {"fsdp": {"enabled": True, "mode": "graph", "bucket_mb": 25, "overlap": True}}
    )
    assert cfg.fsdp.bucket_mb == 25 and cfg.fsdp.overlap
    with pytest.raises(ConfigError, match="null / 0 for one collective per parameter"):
        AOTDistConfig.from_dict(
            {"fsdp": {"enabled": True, "mode": "graph", "bucket_mb": float("nan")}}
        )
    with pytest.raises(ConfigError, match="Fix: set fsdp.mode: graph"):
        AOTDistConfig.from_dict({"fsdp": {"enabled": True, "overlap": True}})


def test_fsdp_modes_are_one_set_the_config_and_the_cli_share():
    from aotdist.cli.parser import fsdp_modes
    from aotdist.config import FSDP_MODES

    assert fsdp_modes()[0] == AOTDistConfig().fsdp.mode and set(fsdp_modes()) == set(FSDP_MODES)
    for mode in FSDP_MODES:
        assert AOTDistConfig.from_dict({"fsdp": {"enabled": True, "mode": mode}}).fsdp.mode == mode
    with pytest.raises(ConfigError, match=r"use one of \['hooks', 'graph'\]"):
        AOTDistConfig.from_dict({"fsdp": {"enabled": True, "mode": "graphs"}})


def test_section_objects_validate_themselves():
    from aotdist.config import FSDPConfig

    with pytest.raises(ConfigError, match="fsdp.enabled"):
        FSDPConfig(enabled="true")
    with pytest.raises(ConfigError, match="expected a FSDPConfig"):
        AOTDistConfig(fsdp={"enabled": True})


def test_no_effect_option_warns():
    with pytest.warns(ConfigWarning, match="float8.fsdp_all_gather has no effect"):
        AOTDistConfig.from_dict({"float8": {"enabled": True, "fsdp_all_gather": True}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AOTDistConfig.from_dict(
            {"float8": {"enabled": True, "fsdp_all_gather": True}, "fsdp": {"enabled": True}}
        )


def test_yaml(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("aotdist:\n  fsdp:\n    enabled: true\n  ac: {enabled: true}\n")
    cfg = AOTDistConfig.from_yaml(path)
    assert cfg.fsdp.enabled and cfg.ac.enabled
    path.write_text("fsdp: {enabled: true, shard: 2}\n")
    with pytest.raises(ConfigError, match=r"cfg.yaml.*fsdp\.shard: unknown key"):
        AOTDistConfig.from_yaml(path)
    path.write_text("fsdp: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        AOTDistConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="not found"):
        AOTDistConfig.from_yaml(tmp_path / "missing.yaml")


@pytest.mark.parametrize("path", sorted((CONFIGS / "aotdist").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = AOTDistConfig.from_yaml(path)
    assert cfg.compile.enabled


def test_aotdist_section_inside_a_larger_config(tmp_path):
    # A Lightning/Accelerate-style file: the aotdist: section is read, the rest left alone.
    path = tmp_path / "all.yaml"
    path.write_text(
        "trainer:\n  max_steps: 3\nmixed_precision: bf16\n"
        "aotdist:\n  compile: {backend: aot_eager}\n  ac: {enabled: true}\n"
    )
    cfg = AOTDistConfig.from_yaml(path)
    assert cfg.compile.backend == "aot_eager" and cfg.ac.enabled
    with pytest.raises(ConfigError, match="put them all under aotdist"):
        AOTDistConfig.from_dict({"aotdist": {}, "compile": {"backend": "aot_eager"}})


def test_hsdp_replicate_degree_is_validated():
    from aotdist.config import AOTDistConfig

    assert AOTDistConfig.from_dict({"fsdp": {"enabled": True}}).fsdp.replicate_degree == 1
    with pytest.raises(ConfigError, match=r"fsdp.replicate_degree: must be >= 1, got 0"):
        AOTDistConfig.from_dict({"fsdp": {"enabled": True, "replicate_degree": 0}})
    # HSDP in both modes
    graph = AOTDistConfig.from_dict(
        {"fsdp": {"enabled": True, "mode": "graph", "replicate_degree": 2}}
    )
    assert (graph.fsdp.mode, graph.fsdp.replicate_degree) == ("graph", 2)
