"""Why ``parallelize`` refuses context parallelism on CPU, checked against torch itself:
``torch.distributed.tensor.experimental.context_parallel`` on 2 gloo ranks, causal SDPA
with the sequence sharded, fails on CPU SDPA's op. If a torch release runs it, this test
fails, and aotdist could support CP on CPU instead of refusing
(``aotdist.parallelize.refuse_context_parallel``)."""

from __future__ import annotations

from aotdist.testing import run_distributed


def _context_parallel_on_cpu(rank: int, world_size: int) -> str:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn import functional as F

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except Exception as exc:  # noqa: BLE001 - the failure is what this test reads
        return f"{type(exc).__name__}: {exc}"
    return "ran"


def test_torch_context_parallel_does_not_run_on_cpu():
    results = run_distributed(_context_parallel_on_cpu, 2, timeout=120.0)
    for rank, result in enumerate(results):
        assert result != "ran", (
            f"rank {rank}: torch's context_parallel ran on CPU; aotdist could support it "
            "there instead of refusing (aotdist.parallelize.refuse_context_parallel)"
        )
        assert "_scaled_dot_product_flash_attention_for_cpu" in result, (rank, result)
