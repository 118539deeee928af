"""torchao is imported only when Float8 is on: a run with Float8 off loads none of it (and
prints none of its deprecation notices), through parallelize, a training step, the scale
precompute and Accelerate's prepare."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

PROBE = """
    import json, sys
    import torch
    import aotdist
    from aotdist.errors import AOTDistError
    from aotdist.testing import TinyGPT

    def torchao():
        return sorted(k for k in sys.modules if k.split(".")[0] == "torchao")

    seen = {}
    model = TinyGPT(depth=2)
    aotdist.parallelize(model, config={"compile": {"backend": "aot_eager"}})
    model(torch.randint(0, 64, (2, 16))).sum().backward()
    aotdist.precompute_float8_scales(model)
    seen["parallelize, a step, the precompute"] = torchao()
    try:
        from accelerate import Accelerator
        from aotdist.callbacks import prepare
    except ImportError:
        pass
    else:
        other = TinyGPT(depth=2)
        optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
        prepare(Accelerator(cpu=True), other, optimizer,
                config={"compile": {"backend": "aot_eager"}})
        seen["accelerate prepare"] = torchao()
    try:  # Float8 on: now torchao loads (the conversion may refuse this CPU)
        aotdist.parallelize(TinyGPT(depth=2, dim=32),
                            config={"float8": {"enabled": True}, "compile": {"enabled": False}})
    except AOTDistError:
        pass
    seen["float8 on"] = bool(torchao())
    print(json.dumps(seen))
"""


@pytest.mark.timeout(120)
def test_torchao_is_not_imported_when_float8_is_off(tmp_path):
    pytest.importorskip("torchao")
    # plain python, as a user runs it: no launcher's variables (Accelerate would rendezvous)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PROBE)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen.pop("float8 on") is True
    assert seen and all(loaded == [] for loaded in seen.values()), seen
