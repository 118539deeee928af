"""``aotdist.capture`` on FSDP2-sharded models (2 gloo ranks), with and without Float8.

One spawn runs every config (process start-up dominates on a small machine); the tests
check what each rank returned against facts computed here from an unsharded model.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import aotdist
from aotdist.testing import build_model, example_inputs, run_distributed

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # a 30+ s spawn on 2 cores
WORLD = 2
CONFIGS = {
    "fsdp": {"fsdp": {"enabled": True}, "compile": {"enabled": False}},
    "fsdp+float8": {
        "fsdp": {"enabled": True},
        "compile": {"enabled": False},
        "float8": {"enabled": True, "exclude": ["head"]},
    },
    "fsdp+float8ag": {
        "fsdp": {"enabled": True},
        "compile": {"enabled": False},
        "float8": {"enabled": True, "exclude": ["head"], "fsdp_all_gather": True},
    },
}


def _capture_all(rank: int, world_size: int, out_dir: str) -> dict:
    from aotdist.cli.inspect import inspect_rank

    results = {}
    for name, config in CONFIGS.items():
        torch.manual_seed(0)
        model = aotdist.parallelize(build_model("gpt", depth=2), config=config)
        (x,), _ = example_inputs(model, generator=torch.Generator().manual_seed(rank))
        cap = aotdist.capture(model, x, loss_fn=lambda o: o.float().mean())
        d = cap.to_dict()
        d["grads_none"] = all(p.grad is None for p in model.parameters())
        d["summary"] = cap.summary()
        results[name] = d
    # The CLI's per-rank body (``aotdist inspect --nproc 2 --out DIR``).
    results["cli"] = inspect_rank(
        rank,
        world_size,
        {
            "model": "gpt",
            "depth": 2,
            "fsdp": True,
            "float8": False,
            "out": out_dir,
            "backend": "aot_eager",
        },
    )
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("inspect")
    return run_distributed(_capture_all, WORLD, str(out), timeout=500), out


def test_fsdp_capture_regions_are_per_region_frames(ranks):
    results, _ = ranks
    for rank_result in results:
        d = rank_result["fsdp"]
        assert d["mode"] == "frames" and d["grads_none"]
        region = d["regions"]["GPTBlock"]
        assert region["call_sites"] == ["blocks.0", "blocks.1"] == region["instances"]
        assert region["num_subgraphs"] == 1 == len(region["forward"]) == len(region["backward"])


def test_fsdp_inputs_report_sharded_and_unsharded_sizes(ranks):
    results, _ = ranks
    reference = dict(build_model("gpt", depth=2).named_parameters())
    d = results[0]["fsdp"]
    reported = {x["param"]: x for x in d["fsdp_inputs"]}
    block0 = {n for n in reference if n.startswith("blocks.0.")}
    assert block0 <= set(reported)  # every parameter of the first compiled block
    for name in block0:
        full = list(reference[name].shape)
        assert reported[name]["unsharded_shape"] == full
        assert reported[name]["sharded_shape"] == [math.ceil(full[0] / WORLD), *full[1:]]
        assert reported[name]["storage_nbytes_now"] == 0  # resharded between steps
    inputs = d["regions"]["GPTBlock"]["forward"][0]["inputs"]
    params = {i["name"] for i in inputs if i["kind"] == "parameter"}
    assert params == {n[len("blocks.0.") :] for n in block0}


def test_float8_subclass_inputs_only_with_float8_all_gather(ranks):
    results, _ = ranks
    assert results[0]["fsdp"]["subclass_inputs"] == []
    assert results[0]["fsdp+float8"]["subclass_inputs"] == []  # weights cast inside the graph
    sub = results[0]["fsdp+float8ag"]["subclass_inputs"]
    linears = {"attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight"}
    assert {x["input"].split(".", 2)[-1] for x in sub} == linears
    for x in sub:
        assert "Float8" in x["type"] and x["inner"], x
        assert any(v.get("dtype", "").startswith("float8") for v in x["inner"].values()), x
    for name in ("fsdp+float8", "fsdp+float8ag"):
        region = results[0][name]["regions"]["GPTBlock"]
        assert region["call_sites"] == ["blocks.0", "blocks.1"] and region["num_subgraphs"] == 1


def test_inspect_cli_with_fsdp_saves_the_capture(ranks):
    results, out = ranks
    assert "GPTBlock" in results[0]["cli"] and "fsdp input" in results[0]["cli"]
    saved = json.loads((out / "capture.json").read_text())
    assert saved["mode"] == "frames"
    # Frames mode: the region's forward is a top-level graph of its own.
    code = saved["regions"]["GPTBlock"]["forward"][0]["code"]
    assert code in (out / f"{saved['regions']['GPTBlock']['forward'][0]['name']}.py").read_text()
