"""``aotdist.cache`` in one process: config, invalidation, corrupt and unsafe bundles, round
trip."""

from __future__ import annotations

import os
import stat
import warnings

import pytest
import torch
import torch.nn.functional as F

import aotdist
from aotdist.cache import CacheWarning, cache_key, store
from aotdist.cache.artifacts import kernel_files as _kernel_files
from aotdist.cache.artifacts import mega_bytes as _mega_bytes
from aotdist.cache.bundle import check_safe, write_atomic
from aotdist.cache.bundle import decode as _decode
from aotdist.cache.bundle import encode as _encode
from aotdist.cache.store import CacheStatus, _use
from aotdist.config import AOTDistConfig, CacheConfig
from aotdist.errors import ConfigError
from aotdist.testing import build_model, example_inputs


def _config(tmp_path, mode="local"):
    return AOTDistConfig.from_dict(
        {"compile": {"backend": "aot_eager"}, "cache": {"mode": mode, "dir": str(tmp_path)}}
    )


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
    _, _, uncached, _ = _run(
        AOTDistConfig.from_dict({"compile": {"backend": "aot_eager"}}), depth=3
    )
    assert losses == uncached


def test_changed_config_or_version_is_named(tmp_path):
    config = _config(tmp_path)
    model, *_ = _run(config)
    key = cache_key(model, config)
    other = AOTDistConfig.from_dict({**config.to_dict(), "compile": {"backend": "inductor"}})
    stale = _use(_encode(key, b"x", {}), cache_key(model, other), "p", model, other)
    assert stale.reason.count("config")
    old = {**key, "torch": "2.0.0"}
    assert "torch '2.0.0'" in _use(_encode(old, b"x", {}), key, "p", model, config).reason


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


@pytest.fixture
def bundle(tmp_path, monkeypatch):
    """A valid bundle for ``_run``'s model: 0o644 in a 0o755 directory. Returns the
    config, its path and the Mega-Cache bytes installed (a recording loader)."""
    installed = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", installed.append)
    folder = tmp_path / "cache"
    folder.mkdir()
    os.chmod(folder, 0o755)  # mkdir's mode is subject to the umask
    config = _config(folder)
    model, *_ = _run(config)
    path = folder / "artifacts.aotc"
    write_atomic(str(path), _encode(cache_key(model, config), b"mega", {}))
    return config, path, installed


def test_own_bundle_in_own_directory_loads(bundle):
    config, path, installed = bundle
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o755
    _, load, _, caught = _run(config)
    assert load.status == CacheStatus.LOADED and caught == [] and installed == [b"mega"]


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="no user ids: no check")
@pytest.mark.parametrize(
    ("where", "mode", "safe"),
    [("file", 0o666, 0o644), ("directory", 0o775, 0o755), ("directory", 0o777, 0o755)],
    ids=["file-0o666", "directory-0o775", "directory-0o777"],
)
def test_bundle_others_could_write_is_not_read(bundle, monkeypatch, where, mode, safe):
    """A bundle is code: one that group or others could have written is neither decoded
    nor installed; the run compiles normally. The same bundle, mode restored, loads."""
    config, path, installed = bundle
    decoded = []
    monkeypatch.setattr(store, "decode", lambda data: decoded.append(data) or _decode(data))
    target = path if where == "file" else path.parent
    os.chmod(target, mode)
    _, load, losses, caught = _run(config)
    assert load.status == CacheStatus.UNSAFE == "unsafe", load
    assert decoded == [] and installed == []
    assert len(caught) == 1, caught
    message = str(caught[0].message)
    assert f"{where} {target} is writable by group or others (mode {mode:#o})" in message
    assert f"chmod go-w {target}" in message and load.reason in message
    _, _, uncached, _ = _run(AOTDistConfig.from_dict({"compile": {"backend": "aot_eager"}}))
    assert losses == uncached  # compiled normally, same results
    os.chmod(target, safe)
    _, load, _, caught = _run(config)
    assert load.status == CacheStatus.LOADED and caught == [] and installed == [b"mega"]
    assert len(decoded) == 1  # the check alone refused it


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="no user ids: no check")
def test_check_safe_refuses_links_and_files_of_others(tmp_path, monkeypatch):
    os.chmod(tmp_path, 0o755)
    real = tmp_path / "real.aotc"
    write_atomic(str(real), b"bundle")
    assert check_safe(str(real)) is None
    link = tmp_path / "link.aotc"
    link.symlink_to(real)
    assert f"{link} is a symbolic link" in check_safe(str(link))
    with pytest.raises(FileNotFoundError):
        check_safe(str(tmp_path / "none.aotc"))
    uid = os.getuid()
    if uid == 0:  # root can give the file away; root's own files are accepted, as SSH does
        os.chown(real, 4242, -1)
        owner, me = 4242, 0
    else:  # another user's view of this user's files
        monkeypatch.setattr(os, "getuid", lambda: uid + 1)
        owner, me = uid, uid + 1
    problem = check_safe(str(real))
    assert f"file {real} is owned by uid {owner}, not by this user (uid {me})" in problem
    assert f"chown {me} {real}" in problem
    monkeypatch.delattr(os, "getuid")  # Windows: no user ids, no check
    assert check_safe(str(link)) is None


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="no user ids: no check")
@pytest.mark.parametrize("rank", [0, 1])
def test_shared_mode_rank0_judges_and_every_rank_joins_the_broadcast(bundle, monkeypatch, rank):
    """Rank 0 checks the file and broadcasts its verdict; no rank's own file decides
    whether it joins the broadcast (that would hang the job)."""
    _, path, installed = bundle
    config = _config(path.parent, mode="shared")
    good = path.read_bytes()
    sent = []

    def broadcast(box, src):
        assert src == 0
        sent.append(list(box))
        if rank == 1:  # rank 0 found the bundle safe
            box[:] = [good, None]

    class NoSharing:
        def __init__(self, rank, *, timeout_s):
            pass

        start = stop = lambda self: None

    monkeypatch.setattr(store, "_rank_world", lambda: (rank, 2))
    monkeypatch.setattr(store.dist, "broadcast_object_list", broadcast)
    monkeypatch.setattr(store, "CompileSharing", NoSharing)
    os.chmod(path, 0o666)  # seen by rank 0 only: rank 1 reads no file
    _, load, _, caught = _run(config)
    assert len(sent) == 1
    if rank == 0:
        assert sent[0][0] is None and "mode 0o666" in sent[0][1]  # the verdict, not the bytes
        assert load.status == CacheStatus.UNSAFE and installed == [] and len(caught) == 1
    else:
        assert sent[0] == [None, None]
        assert load.status == CacheStatus.LOADED and installed == [b"mega"]


@pytest.mark.inductor
def test_bundle_round_trip_loads_inductor_artifacts(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    fn = torch.compile(lambda x: (x.sin() * 2).sum(1), backend="inductor")
    fn(torch.randn(4, 8))
    mega, kernels = _mega_bytes(), _kernel_files()
    assert mega is not None and kernels  # the kernel binaries travel with the FX entries
    key = {"k": 1}
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "fresh"))
    result = _use(_encode(key, mega, kernels), key, "p", torch.nn.Linear(1, 1), _config(tmp_path))
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
        bundle = (
            dict(files) if signature is None else {**files, artifacts.CPU_ENTRY: signature.encode()}
        )
        artifacts.install(b"", bundle)
        root = tmp_path / str(n)
        assert (root / "ab" / "cabprobe.so").exists()
        assert (root / "ab" / "cabprobe.so.load_ok").exists() == (signature == here != "")
        assert not (root / "aotdist").exists()  # the signature entry is no cache file


@pytest.mark.inductor
def test_a_passed_isa_load_check_is_remembered_and_a_failed_one_is_not(tmp_path, monkeypatch):
    """Inductor loads each CPU vector-ISA probe in a child Python; a passed load leaves a
    ``.so.load_ok`` marker that later checks (other processes) trust, on every torch
    (2.11 through aotdist's scope, 2.14+ natively). A failed load leaves none."""
    import subprocess

    import torch._inductor.cpu_vec_isa as cpu_vec_isa

    from aotdist import _compat

    isa = cpu_vec_isa.pick_vec_isa()
    if not isa:
        pytest.skip("Inductor finds no vector ISA on this CPU")
    code, original = cpu_vec_isa.VecISA._avx_code, cpu_vec_isa.VecISA.check_build
    real = {name: getattr(subprocess, name) for name in ("check_call", "run")}

    def children(behaviour):
        for name in real:
            monkeypatch.setattr(subprocess, name, behaviour or real[name])

    def fail(cmd, *args, **kwargs):
        raise subprocess.CalledProcessError(1, cmd)

    def forbidden(cmd, *args, **kwargs):
        raise AssertionError(f"a child process was started: {cmd}")

    def markers():
        return list(tmp_path.glob("*/*.so.load_ok"))

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    with _compat.remembered_isa_loads():
        children(fail)  # the load fails: no marker, and the next check loads again
        assert not isa.check_build(code) and markers() == []
        children(None)
        assert isa.check_build(code) and len(markers()) == 1
        children(forbidden)  # a later process: the marker alone decides
        assert isa.check_build(code)
    assert cpu_vec_isa.VecISA.check_build is original


def test_an_autotuning_result_from_another_cache_dir_is_found_under_this_one(tmp_path, monkeypatch):
    """A Triton kernel loaded from a cache entry keeps the path it had in the run that
    saved it; its autotuning result, which the Mega-Cache installs under this process's
    cache dir, is found only through aotdist's re-rooting scope. Without it the warm
    start benchmarks every config again (seen on an H100: 14 kernels, 0.8 s)."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from torch._inductor.runtime import autotune_cache, triton_heuristics
    from torch._inductor.runtime.triton_compat import Config
    from torch.compiler._cache import CacheArtifactFactory, CacheArtifactManager

    from aotdist import _compat

    configs = [
        Config({"XBLOCK": 64}, num_warps=4, num_stages=1),
        Config({"XBLOCK": 128}, num_warps=4, num_stages=1),
    ]
    meta = {"autotune_local_cache": True}
    then, now = tmp_path / "then", tmp_path / "now"
    kernel_file = str(then / "ab" / "cabkernel.py")  # the saving run's kernel path
    recorded = []
    monkeypatch.setattr(
        CacheArtifactManager,
        "record_artifact",
        classmethod(lambda cls, *args: recorded.append(args)),
    )
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(then))
    cache = autotune_cache.AutotuneCache.create(
        meta, kernel_file, triton_heuristics.hash_configs(configs)
    )
    cache.save(configs[1], 1_000_000)
    ((kind, key, content),) = recorded
    assert kind == "autotune"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(now))  # another machine's dir
    import shutil

    shutil.rmtree(then)
    CacheArtifactFactory.encode_create(kind, key, content).populate_cache()  # Mega-Cache load

    def loaded_kernel():
        return SimpleNamespace(
            filename=kernel_file,
            inductor_meta=meta,
            _could_rblock_scale=False,
            is_statically_launchable=lambda: True,
            compile_results=[SimpleNamespace(config=c) for c in configs],
        )

    recheck = triton_heuristics.CachingAutotuner.recheck_autotune_cache
    alone = loaded_kernel()
    recheck(alone, reload_kernel_from_src=None)
    assert alone.autotune_cache_info["autotune_cache_state"] == "miss"  # torch alone
    assert len(alone.compile_results) == 2
    kernel = loaded_kernel()
    with _compat.rerooted_autotune_lookups():
        triton_heuristics.CachingAutotuner.recheck_autotune_cache(
            kernel, reload_kernel_from_src=None
        )
    assert kernel.autotune_cache_info["autotune_cache_state"] == "hit"
    assert [r.config.kwargs for r in kernel.compile_results] == [{"XBLOCK": 128}]
    assert kernel.filename == str(now / "ab" / "cabkernel.py")
    assert triton_heuristics.CachingAutotuner.recheck_autotune_cache is recheck
    assert not then.exists()  # nothing written back under the old path


_WARM_CHILD = r"""
import json, os, sys, torch
import torch._inductor.cpp_builder as cb
import subprocess
builds, probes = [], []
build = cb.CppBuilder.build
def counted_build(self, *a, **k):
    builds.append(os.path.basename(self.get_target_file_path()))
    return build(self, *a, **k)
cb.CppBuilder.build = counted_build
for name in ("check_call", "run"):  # a probe's load check: a child Python (2.11 and 2.15)
    def counted(cmd, *a, _real=getattr(subprocess, name), **k):
        if isinstance(cmd, list) and "LoadLibrary" in " ".join(map(str, cmd)):
            probes.append(cmd)
        return _real(cmd, *a, **k)
    setattr(subprocess, name, counted)
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
                  "precompiled": load.precompiled, "loss": loss.item()}))
"""


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_warm_start_runs_no_cpp_compiler_and_no_isa_probe(tmp_path):
    """A fresh process with an empty Inductor cache dir and the bundle of a previous run
    compiles no C++ (kernels and ISA probes travel; loading a saved graph, it does not
    even preprocess the shared header) and, on the same CPU, loads no ISA probe in a
    child process (their markers travel)."""
    import json
    import subprocess
    import sys

    def run(inductor_dir):
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / inductor_dir)}
        out = subprocess.run(
            [sys.executable, "-c", _WARM_CHILD, str(tmp_path / "bundle")],
            env=env,
            capture_output=True,
            text=True,
            timeout=500,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = run("cold"), run("warm")
    assert cold["status"] == "missing" and warm["status"] == "loaded", (cold, warm)
    assert len(cold["builds"]) > 5  # it compiled kernels and probes: there was work to skip
    # a saved graph loads its kernels only: not even the shared header is preprocessed
    # (where torch has no aot_compile, 2.11, Dynamo traces and the header is prepared)
    allowed = [] if warm["precompiled"] else ["header.i"]
    assert [b for b in warm["builds"] if b not in allowed] == [], warm
    assert cold["probes"] > 0 and warm["probes"] == 0, (cold, warm)
    assert warm["loss"] == cold["loss"]


def test_kernel_files_skip_the_cpp_builders_folders(tmp_path, monkeypatch):
    """torch's C++ builder can leave a ``<key>_CxxBuild`` folder beside a kernel's files;
    the bundle takes the files and passes the folder over (it failed every save with
    IsADirectoryError)."""
    from aotdist import _compat
    from aotdist.cache import artifacts

    key = "cabcdef0123"
    sub = tmp_path / key[1:3]
    (sub / f"{key}_CxxBuild").mkdir(parents=True)
    (sub / f"{key}.so").write_bytes(b"so")
    (sub / f"{key}.cpp").write_bytes(b"cpp")
    monkeypatch.setattr(_compat, "inductor_cache_dir", lambda: str(tmp_path))
    monkeypatch.setattr(_compat, "cpp_code_cache_keys", lambda: {key})
    monkeypatch.setattr(_compat, "isa_probe_keys", lambda root: {key})
    expected = {f"{key[1:3]}/{key}.so": b"so", f"{key[1:3]}/{key}.cpp": b"cpp"}
    assert artifacts.kernel_files() == expected
    probes = artifacts.isa_probe_files()
    assert {k: v for k, v in probes.items() if not k.startswith("aotdist/")} == expected
