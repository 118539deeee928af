"""``aotdist.cache`` in one process: config, invalidation, corrupt bundles, round trip."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import aotdist
from aotdist.cache import CacheWarning, cache_key
from aotdist.cache.artifacts import kernel_files as _kernel_files
from aotdist.cache.artifacts import mega_bytes as _mega_bytes
from aotdist.cache.bundle import encode as _encode
from aotdist.cache.store import _use
from aotdist.config import AOTDistConfig, CacheConfig
from aotdist.errors import ConfigError
from aotdist.testing import build_model, example_inputs


def _config(tmp_path, mode="local"):
    return AOTDistConfig.from_dict({"compile": {"backend": "aot_eager"},
                                    "cache": {"mode": mode, "dir": str(tmp_path)}})


def _losses(model, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        (x,), y = example_inputs(model, 2, generator=g)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _run(config, depth=2):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model("gpt", depth=depth)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aotdist.parallelize(model, config=config)
        losses = _losses(model)
    state = vars(model).get(aotdist.cache.STATE_ATTR)
    return model, state and state["load"], losses, [w for w in caught if w.category is CacheWarning]


def test_config_section_is_validated():
    assert AOTDistConfig().cache == CacheConfig(mode="off")
    cfg = AOTDistConfig.from_dict({"cache": {"mode": "shared", "dir": "/tmp/x"}})
    assert AOTDistConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="cache.dir: required"):
        AOTDistConfig.from_dict({"cache": {"mode": "local"}})
    with pytest.raises(ConfigError, match="cache.mode: unknown mode 'global'"):
        AOTDistConfig.from_dict({"cache": {"mode": "global", "dir": "d"}})


def test_first_run_finds_no_bundle_quietly(tmp_path):
    _, load, _, caught = _run(_config(tmp_path))
    assert load.status == "missing" and caught == []


def test_changed_model_invalidates(tmp_path):
    config = _config(tmp_path)
    small, *_ = _run(config, depth=2)
    with open(os.path.join(tmp_path, "artifacts.aotc"), "wb") as fh:
        fh.write(_encode(cache_key(small, config), b"x", {}))
    _, load, losses, caught = _run(config, depth=3)
    assert load.status == "stale" and "model" in load.reason
    assert len(caught) == 1 and "made for another setup" in str(caught[0].message)
    _, _, uncached, _ = _run(AOTDistConfig.from_dict({"compile": {"backend": "aot_eager"}}),
                             depth=3)
    assert losses == uncached


def test_changed_config_or_version_is_named(tmp_path):
    config = _config(tmp_path)
    model, *_ = _run(config)
    key = cache_key(model, config)
    other = AOTDistConfig.from_dict({**config.to_dict(), "compile": {"backend": "inductor"}})
    assert _use(_encode(key, b"x", {}), cache_key(model, other), "p").reason.count("config")
    old = {**key, "torch": "2.0.0"}
    assert "torch '2.0.0'" in _use(_encode(old, b"x", {}), key, "p").reason


@pytest.mark.parametrize("damage", ["truncate", "flip", "header"])
def test_corrupt_bundle_is_reported_and_ignored(tmp_path, damage):
    config = _config(tmp_path)
    model, _, uncached, _ = _run(config)
    data = bytearray(_encode(cache_key(model, config), b"mega" * 100, {"ab/cab.so": b"\0" * 64}))
    if damage == "truncate":
        data = data[: len(data) - 50]
    elif damage == "flip":
        data[-10] ^= 0xFF
    else:
        data[20] ^= 0xFF
    with open(os.path.join(tmp_path, "artifacts.aotc"), "wb") as fh:
        fh.write(bytes(data))
    _, load, losses, caught = _run(config)
    assert load.status == "corrupt", load
    assert len(caught) == 1 and "corrupt bundle" in str(caught[0].message)
    assert losses == uncached  # compiled normally, same results


@pytest.mark.inductor
def test_bundle_round_trip_loads_inductor_artifacts(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    fn = torch.compile(lambda x: (x.sin() * 2).sum(1), backend="inductor")
    fn(torch.randn(4, 8))
    mega, kernels = _mega_bytes(), _kernel_files()
    assert mega is not None and kernels  # the kernel binaries travel with the FX entries
    key = {"k": 1}
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "fresh"))
    result = _use(_encode(key, mega, kernels), key, "p")
    assert result.status == "loaded" and result.artifacts.get("inductor", 0) >= 1
    for path in kernels:
        assert (tmp_path / "fresh" / path).exists()


def test_isa_probe_load_markers_are_installed_only_on_the_same_cpu(tmp_path, monkeypatch):
    """A probe's ``.so.load_ok`` marker skips its load check: it travels only to a machine
    whose CPU signature matches the one that made it."""
    from aotdist.cache import artifacts

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda mega: None)
    files = {"ab/cabprobe.so": b"\x7fELF", "ab/cabprobe.so.load_ok": b""}
    here = artifacts.cpu_signature()
    for n, signature in enumerate([here, "another cpu", None]):
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / str(n)))
        bundle = dict(files) if signature is None else {
            **files, artifacts.CPU_ENTRY: signature.encode()}
        artifacts.install(b"", bundle)
        root = tmp_path / str(n)
        assert (root / "ab" / "cabprobe.so").exists()
        assert (root / "ab" / "cabprobe.so.load_ok").exists() == (signature == here != "")
        assert not (root / "aotdist").exists()  # the signature entry is no cache file


_WARM_CHILD = r"""
import json, os, sys, torch
import torch._inductor.cpp_builder as cb
import torch._inductor.cpu_vec_isa as isa
builds, probes = [], []
build = cb.CppBuilder.build
def counted_build(self, *a, **k):
    builds.append(os.path.basename(self.get_target_file_path()))
    return build(self, *a, **k)
cb.CppBuilder.build = counted_build
if hasattr(isa.VecISA, "_probe_load"):  # torch 2.15; 2.11 loads probes inline, every time
    probe = isa.VecISA._probe_load
    def counted_probe(self, path):
        probes.append(path)
        return probe(self, path)
    isa.VecISA._probe_load = counted_probe
import aotdist, aotdist.cache
from aotdist.testing import build_model, example_inputs
torch.manual_seed(0)
model = build_model("gpt", depth=2)
aotdist.parallelize(model, config={"compile": {"backend": "inductor"},
                            "cache": {"mode": "local", "dir": sys.argv[1]}})
(x,), y = example_inputs(model, 2, generator=torch.Generator().manual_seed(1))
loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
loss.backward()
aotdist.cache.save(model)
load = vars(model)[aotdist.cache.STATE_ATTR]["load"]
print(json.dumps({"builds": builds, "probes": len(probes), "status": str(load.status),
                  "loss": loss.item(), "can_count_probes": hasattr(isa.VecISA, "_probe_load")}))
"""


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_warm_start_runs_no_cpp_compiler_and_no_isa_probe(tmp_path):
    """A fresh process with an empty Inductor cache dir and the bundle of a previous run
    compiles no C++ (kernels and ISA probes travel) and, on the same CPU, loads no ISA
    probe in a child process (their markers travel)."""
    import json
    import subprocess
    import sys

    def run(inductor_dir):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / inductor_dir)}
        out = subprocess.run([sys.executable, "-c", _WARM_CHILD, str(tmp_path / "bundle")],
                             env=env, capture_output=True, text=True, timeout=500)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = run("cold"), run("warm")
    assert cold["status"] == "missing" and warm["status"] == "loaded", (cold, warm)
    assert len(cold["builds"]) > 5  # it compiled kernels and probes: there was work to skip
    assert [b for b in warm["builds"] if not b.endswith(".i")] == [], warm  # .i: a header
    if warm["can_count_probes"]:
        assert cold["probes"] > 0 and warm["probes"] == 0, (cold, warm)
    assert warm["loss"] == cold["loss"]
