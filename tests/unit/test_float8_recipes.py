"""Float8 ``rowwise`` recipes (``float8.recipe``), one process, compiled with aot_eager.

Row-wise scaling needs ``torch._scaled_mm`` with per-row scales. Whether this torch has
it on CPU is found out independently of aotdist (torchao's own layer, run directly):
where it runs, aotdist's compiled model trains like eager Float8 with the same recipe;
where it does not (torch 2.11 on CPU: "only supports per-tensor scaling for CPU
backend"), ``parallelize`` refuses with a ConfigError naming the fix before touching the
model. On torch 2.15 the region cannot be one reusable subgraph (torchao: "aten.reshape
with axiswise scaling is not supported yet"): aotdist demotes it with a warning.
"""

from __future__ import annotations

import copy
import os
import platform
import subprocess
import sys
import warnings

import pytest
import torch

import aotdist
from aotdist import metrics
from aotdist.testing import build_model, train_steps

pytestmark = pytest.mark.filterwarnings("ignore:.*KernelPreference.*")

RECIPES = ["rowwise", "rowwise_with_gw_hp"]
STEPS = 3


def _torchao_failure(recipe: str) -> str | None:
    """Runs torchao's Float8Linear of ``recipe`` directly; the error, or None if it runs."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    layer = torch.nn.Sequential(torch.nn.Linear(32, 32))
    convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(recipe))
    try:
        layer(torch.randn(4, 32)).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return None


def _train(base, config: dict):
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aotdist.parallelize(model, config=config)
        with metrics.track(model) as m:
            losses = train_steps(model, steps=STEPS)
    warned = [
        str(w.message) for w in caught if issubclass(w.category, aotdist.RegionCompileWarning)
    ]
    return model, losses, m, warned


@pytest.mark.parametrize("recipe", RECIPES)
def test_rowwise_recipe_trains_compiled_like_eager_or_is_refused(recipe):
    pytest.importorskip("torchao.float8")
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    base = build_model("gpt", depth=2)
    float8 = {"enabled": True, "recipe": recipe, "exclude": ["head"]}
    failure = _torchao_failure(recipe)
    if failure is not None and torch.cuda.is_available():
        pytest.skip("a CPU model on a GPU machine is not probed: it most likely trains there")
    if failure is not None:  # this torch cannot run row-wise scaling on CPU
        model = copy.deepcopy(base)
        with pytest.raises(
            aotdist.ConfigError,
            match=rf"float8.recipe: '{recipe}' cannot run on cpu.*"
            "Fix: set float8.recipe: tensorwise",
        ):
            aotdist.parallelize(
                model, config={"float8": float8, "compile": {"backend": "aot_eager"}}
            )
        assert not any(isinstance(m, Float8Linear) for m in model.modules())  # untouched
        assert aotdist.parallelize_info(model) is None
        return

    eager, eager_losses, _, _ = _train(base, {"float8": float8, "compile": {"enabled": False}})
    model, losses, m, warned = _train(base, {"float8": float8, "compile": {"backend": "aot_eager"}})
    layers = [mod for mod in model.modules() if isinstance(mod, Float8Linear)]
    assert len(layers) == len(aotdist.parallelize_info(model).float8_fqns) > 0
    assert all(
        mod.config.cast_config_input.scaling_granularity is ScalingGranularity.AXISWISE
        for mod in layers
    )  # really the row-wise recipe
    assert m.frames_compiled and m.frames_compiled > 0  # really compiled
    # reused as one subgraph, or demoted with a warning that names the region and cause
    reused = m.regions.get("GPTBlock") is not None and m.regions["GPTBlock"].subgraphs == 1
    assert reused or any("'GPTBlock' cannot be a reusable subgraph" in w for w in warned), (
        m.regions,
        warned,
    )
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-4, atol=1e-5
    )
    initial = base.state_dict()
    for key, value in eager.state_dict().items():
        got = model.state_dict()[key]
        torch.testing.assert_close(
            got, value, rtol=1e-4, atol=1e-5, msg=lambda s, k=key: f"{k}: {s}"
        )
        assert not torch.equal(got, initial[key]), f"{key} never trained: the test is vacuous"


_NO_FP8_CPU = """
import aotdist, torch
from torchao.float8.float8_linear import Float8Linear
from aotdist.testing import build_model
model = build_model("gpt", depth=2)
try:
    aotdist.parallelize(model, config={"float8": {"enabled": True, "exclude": ["head"]},
                                       "compile": {"backend": "aot_eager"}})
except aotdist.ConfigError as exc:
    print("REFUSED", exc)
    print("TOUCHED", any(isinstance(m, Float8Linear) for m in model.modules()),
          aotdist.parallelize_info(model) is not None)
else:
    print("ACCEPTED")
"""


@pytest.mark.skipif(
    not os.path.exists("/proc/cpuinfo") or platform.machine() != "x86_64",
    reason="AMX and oneDNN's ISA cap: x86 Linux",
)
def test_cpu_float8_matmul_that_fails_is_refused_at_parallelize(tmp_path):
    # On a CPU with AMX torch runs float8 matmuls in oneDNN (elsewhere it emulates them);
    # capped below AMX by ONEDNN_MAX_CPU_ISA, oneDNN fails at the first step ("could not
    # create a primitive descriptor"). parallelize must refuse first, naming the cause and
    # the fix.
    pytest.importorskip("torchao.float8")
    with open("/proc/cpuinfo") as f:
        if "amx_int8" not in f.read():
            pytest.skip("no AMX: torch emulates the float8 matmul, which always runs")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-c", _NO_FP8_CPU],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSED float8.recipe: 'tensorwise' cannot run on cpu" in out.stdout, out.stdout
    assert "ONEDNN_MAX_CPU_ISA=AVX2 caps oneDNN below AMX" in out.stdout, out.stdout
    assert "float8.enabled: false" in out.stdout
    assert "TOUCHED False False" in out.stdout  # the model is left as it was
