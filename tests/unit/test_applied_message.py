"""The line the Lightning callback logs says what aotdist did to which module, in a user's
words: not the name of a function the user never called."""

from __future__ import annotations

import pytest
from torch import nn

from aotdist.config import AOTDistConfig

common = pytest.importorskip("aotdist.callbacks._common")


def _applied(how, config=None, fqn="model"):
    return common.Applied(nn.Linear(2, 2), fqn, how, config or AOTDistConfig())


def test_regional_compile_says_it_compiled_the_regions_of_the_child():
    line = _applied(common.ApplyHow.PARALLELIZE).describe("LitGPT")
    assert line == "aotdist: compiled its regions ('model')"
    assert "parallelize" not in line


def test_each_step_applied_is_named_and_the_root_by_its_class():
    config = AOTDistConfig.from_dict({"fsdp": {"enabled": True}, "ac": {"enabled": True}})
    line = _applied(common.ApplyHow.PARALLELIZE, config, fqn="").describe("LitGPT")
    assert line == (
        "aotdist: checkpointed activations, sharded it with FSDP2 (hooks mode), "
        "compiled its regions (LitGPT)"
    )


def test_what_the_user_set_up_is_said_to_be_left_as_it_is():
    assert "left as it is" in _applied(common.ApplyHow.USER).describe("LitGPT")
    inside = _applied(common.ApplyHow.COMPILE_IN_USER_FSDP).describe("LitGPT")
    assert inside == "aotdist: compiled the regions of 'model' inside your FSDP2 units"
