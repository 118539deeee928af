"""Typos in a config fail where the config is written, with the closest valid name."""

from __future__ import annotations

import pytest

from aotdist.config import AOTDistConfig, CompileConfig, compile_backends
from aotdist.errors import ConfigError


def test_a_backend_typo_fails_at_construction_naming_the_choices_and_the_closest():
    pytest.importorskip("lightning")
    from aotdist.callbacks import RegionalCompile

    for make in (
        lambda: RegionalCompile({"compile": {"backend": "indcutor"}}),
        lambda: RegionalCompile(backend="indcutor"),
    ):
        with pytest.raises(ConfigError) as err:
            make()
        message = str(err.value)
        assert (
            "compile.backend: unknown backend 'indcutor' (did you mean 'inductor'?). "
            "Fix: one of aot_eager, " in message
        )
        assert "TESTING_ONLY" not in message and "inductor, " in message


def test_the_backend_choices_are_torch_s_less_its_testing_ones():
    import torch

    names = compile_backends()
    assert {"inductor", "aot_eager", "eager"} <= set(names)
    assert not [n for n in names if n.endswith("_TESTING_ONLY")]
    assert set(names) < set(torch.compiler.list_backends(exclude_tags=()))


def test_a_backend_the_user_registered_is_accepted():
    from torch._dynamo import register_backend

    @register_backend(name="aotdist_test_user_backend")
    def user_backend(gm, example_inputs):
        return gm.forward

    assert CompileConfig(backend="aotdist_test_user_backend").backend == "aotdist_test_user_backend"


@pytest.mark.parametrize(
    "data, expected",
    [
        (
            {"ac": {"enabeld": True}},
            "ac.enabeld: unknown key (did you mean 'enabled'?); known keys",
        ),
        (
            {"regions": {"min_repeat": 2}},
            "regions.min_repeat: unknown key (did you mean 'min_repeats'?)",
        ),
        ({"compil": {}}, "compil: unknown section (did you mean 'compile'?); known sections"),
        (
            {"compile": {"mode": "max-autotun"}},
            "unknown mode 'max-autotun' (did you mean 'max-autotune'?)",
        ),
        ({"float8": {"recipe": "rowwize"}}, "unknown recipe 'rowwize' (did you mean 'rowwise'?)"),
        (
            {"fsdp": {"param_dtype": "bfloat61"}},
            "unknown dtype 'bfloat61' (did you mean 'bfloat16'?)",
        ),
        ({"cache": {"mode": "locl", "dir": "x"}}, "unknown mode 'locl' (did you mean 'local'?)"),
    ],
)
def test_unknown_keys_and_values_get_did_you_mean(data, expected):
    with pytest.raises(ConfigError, match="did you mean") as err:
        AOTDistConfig.from_dict(data)
    assert expected in str(err.value)


def test_no_suggestion_when_nothing_is_close():
    with pytest.raises(ConfigError) as err:
        AOTDistConfig.from_dict({"ac": {"zzz": 1}})
    assert "did you mean" not in str(err.value)
    with pytest.raises(ConfigError, match="did you mean 'fsdp'"):
        AOTDistConfig().replace(fsdpp={"enabled": True})
