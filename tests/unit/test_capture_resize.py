"""The storage-resize pattern (FSDP's, on a buffer): torch 2.15 segfaults, aotdist must not.

Every run is a subprocess, so that a crash fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(600)

MODULE = textwrap.dedent("""
    import json, sys, warnings
    import torch
    from torch import nn

    class Resizer(nn.Module):
        def __init__(self, n=16):
            super().__init__()
            self.w = nn.Parameter(torch.randn(n))
            self.register_buffer("full", torch.empty(n))
            self.full.untyped_storage().resize_(0)

        def forward(self, x):
            self.full.untyped_storage().resize_(self.w.numel() * self.w.element_size())
            with torch.no_grad():
                self.full.copy_(self.w)
            y = (x + self.full) * self.w
            self.full.untyped_storage().resize_(0)
            return y

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(16, 16)
            self.layers = nn.ModuleList(Resizer() for _ in range(2))

        def forward(self, x):
            x = self.embed(x)
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(4, 16)
    ref = model(x)
    ref.sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
""")


def _run(body: str) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-c", MODULE + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=500,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return proc.returncode, (json.loads(lines[-1]) if lines else {"stderr": proc.stderr[-3000:]})


def test_plain_torch_compile_crashes_on_the_pattern():
    """The reproduction: plain torch.compile(aot_eager) dies. If torch fixes it, this
    fails, and aotdist's repair can be retired."""
    rc, result = _run("""
        out = torch.compile(model, backend="aot_eager")(x)
        out.sum().backward()
        print(json.dumps({"survived": True}))
    """)
    # A segfault: subprocess reports the signal as -11 (not a Python error, exit code 1)
    assert rc == -signal.SIGSEGV, (rc, result)


@pytest.mark.parametrize("how", ["compile_regions", "capture"])
def test_aotdist_compiles_it_and_matches_eager(how):
    rc, result = _run(f"""
        import aotdist
        how = {how!r}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if how == "capture":
                cap = aotdist.capture(model, x, loss_fn=lambda o: o.sum(),
                                      plan=aotdist.RegionPlan([]))
                resizes = [m for m in cap.mutations if m["kind"] == "storage_resize"]
                aotdist.compile_regions(model, backend="aot_eager", plan=aotdist.RegionPlan([]))
            else:
                aotdist.compile_regions(model, backend="aot_eager")
                resizes, cap = [], None
            outs = [model(x) for _ in range(2)]
            outs[-1].sum().backward()
        print(json.dumps({{
            "match": all(torch.allclose(o, ref) for o in outs),
            "grads": all(torch.allclose(p.grad, g) for p, g in zip(model.parameters(), ref_grads)),
            "storage": [m.full.untyped_storage().nbytes() for m in model.layers],
            "resizes": resizes,
            "fixes": cap.fixes if cap else [],
            "eager_warnings": [str(w.message) for w in caught if "runs eagerly" in str(w.message)],
        }}))
    """)
    assert rc == 0, result
    assert result["match"] and result["grads"], result
    assert result["storage"] == [0, 0]  # freed again, as in eager
    assert not result["eager_warnings"]  # compiled, not run eagerly
    if how == "capture":
        inputs = {m["input"] for m in result["resizes"]}
        assert inputs == {"layers.0.full", "layers.1.full"}, result
        nbytes = sorted({m.get("nbytes") for m in result["resizes"] if "nbytes" in m})
        assert nbytes == [0, 64], result
        assert len(result["fixes"]) == 2, result


def test_a_backend_aotdist_cannot_rebuild_runs_the_graph_eagerly():
    rc, result = _run("""
        import aotdist
        from torch._dynamo.backends.debugging import aot_eager

        def custom(gm, example_inputs):  # an AOTAutograd backend aotdist does not know
            return aot_eager(gm, example_inputs)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            aotdist.compile_regions(model, backend=custom)
            out = model(x)
        print(json.dumps({"match": torch.allclose(out, ref),
                          "warned": any("runs eagerly" in str(w.message) for w in caught)}))
    """)
    assert rc == 0, result
    assert result == {"match": True, "warned": True}
