"""What a warm start spends loading its bundle: no shared-header precompile for kernels
that only load, and no cyclic garbage collection while the saved graphs load."""

from __future__ import annotations

import gc

import pytest
import torch

import aotdist
from aotdist import _compat
from aotdist.cache import STATE_ATTR, store
from aotdist.testing import build_model


def test_loading_kernels_precompiles_no_header_and_restores_torch_after():
    import torch._inductor.codecache as codecache

    original = codecache._precompile_header
    with _compat.loading_kernels_only():
        assert codecache._precompile_header("any.h", "g++ -c") == ""  # falsy: unused
    assert codecache._precompile_header is original
    with pytest.raises(RuntimeError), _compat.loading_kernels_only():
        raise RuntimeError("a failed load")
    assert codecache._precompile_header is original


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_kernel_missing_from_the_cache_still_compiles_and_runs_in_the_loading_scope(
    tmp_path, monkeypatch
):
    """The scope's cost, should a saved kernel be missing: that kernel compiles without the
    precompiled header, from the same source and flags, and computes as eager does."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()

    def f(x):
        return (x.sin() * 2 + x.cos()).sum(1)

    x = torch.randn(4, 8)
    with _compat.loading_kernels_only():
        out = torch.compile(f, backend="inductor")(x)
    torch.testing.assert_close(out, f(x))
    assert any(p.suffix == ".so" for p in (tmp_path / "inductor").rglob("*.so"))


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_while_a_bundle_loads_and_restored_after(
    tmp_path, monkeypatch, enabled
):
    seen = []
    use = store._use

    def recording_use(*args, **kwargs):
        seen.append(gc.isenabled())
        return use(*args, **kwargs)

    monkeypatch.setattr(store, "_use", recording_use)
    torch.manual_seed(0)
    model = build_model("gpt", depth=2)
    config = {"compile": {"backend": "aot_eager"}, "cache": {"mode": "local", "dir": str(tmp_path)}}
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        aotdist.parallelize(model, config=config)  # it loads the bundle (none yet)
        after = gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False]  # the bundle is read and its graphs load with the collector off
    assert after is enabled  # and it is back as the user had it
    assert str(vars(model)[STATE_ATTR]["load"].status) == "missing"
