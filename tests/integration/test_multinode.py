"""Two torchrun "nodes" on this machine (static rendezvous, 2 processes each), HSDP across
them: a rank that dies on one node ends the whole job with an error naming it, no hang.
(The Accelerate recipe as two nodes: ``test_accelerate.py``.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # two 2-process torchrun launches

SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    import aotdist
    from aotdist.testing import TinyGPT

    dist.init_process_group("gloo")
    model = TinyGPT(depth=2)
    aotdist.parallelize(model, config={"fsdp": {"enabled": True, "replicate_degree": 2},
                                       "compile": {"backend": "aot_eager"}})
    if dist.get_rank() == 3:  # on node 1
        raise RuntimeError("rank 3 lost its data loader")
    model(torch.randint(0, 64, (2, 16))).sum().backward()  # the others wait for rank 3
""")


def test_a_rank_dying_on_one_node_ends_the_job_on_both(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(n),
                "--rdzv-endpoint",
                f"localhost:{port}",
                "--nproc-per-node",
                "2",
                str(script),
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in (0, 1)
    ]
    try:
        outs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [1, 1], outs
    assert "rank 3 lost its data loader" in outs[1]  # the node it died on names it
    assert "ChildFailedError" in outs[0] and "ChildFailedError" in outs[1]
