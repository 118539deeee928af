"""One benchmark measurement, run in a fresh process with an empty compiler cache.

The parent (:mod:`aotdist.bench`) starts ``python -m aotdist.bench.runner`` once per
(strategy, model, depth) with ``TORCHINDUCTOR_CACHE_DIR`` pointing at a new empty
directory, so every compile is cold; the child prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
import warnings

STRATEGIES = ("eager", "full", "accelerate", "aotdist")


def _apply(strategy: str, model, backend: str):
    import aotdist

    if strategy == "eager":
        return model
    if strategy == "full":
        model.compile(backend=backend)
        return model
    if strategy == "accelerate":
        from accelerate.utils import compile_regions as accelerate_compile_regions

        return accelerate_compile_regions(model, backend=backend)
    if strategy == "aotdist":
        return aotdist.compile_regions(model, backend=backend)
    raise ValueError(f"unknown strategy {strategy!r}; choose from {STRATEGIES}")


def measure(strategy: str, model_name: str, depth: int, *, backend: str, steps: int,
            batch: int, device: str) -> dict:
    """Builds the model, applies ``strategy`` and times training steps."""
    import torch
    import torch.nn.functional as F

    from aotdist import metrics
    from aotdist.testing.models import build_model, example_inputs

    torch.manual_seed(0)
    model = build_model(model_name, depth=depth).to(device)
    model = _apply(strategy, model, backend)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    (x,), y = example_inputs(model if strategy != "accelerate" else model._orig_mod,
                             batch, generator=g)
    x, y = x.to(device), y.to(device)

    def step() -> float:
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        sync()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        sync()
        return time.perf_counter() - start

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with metrics.track(model if strategy == "aotdist" else None) as m:
            first = step()
        step()  # warm-up
        with metrics.track(None) as steady_metrics:
            times = [step() for _ in range(steps)]
    steady = statistics.median(times)
    if device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    regions = {n: vars(s) for n, s in m.regions.items()}
    return {
        "strategy": strategy, "model": model_name, "depth": depth, "backend": backend,
        "device": device, "first_step_s": first, "steady_step_s": steady,
        "compile_s": max(first - steady, 0.0) if strategy != "eager" else 0.0,
        "compile_split_s": {"dynamo": m.dynamo_seconds, "aot_autograd": m.aot_autograd_seconds,
                            "backend": m.backend_seconds},
        "peak_mem_mib": peak, "frames_compiled": m.frames_compiled,
        "graph_breaks": m.num_graph_breaks,
        "recompiles_after_first_step": len(steady_metrics.recompiles),
        "regions": regions, "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--strategy", required=True, choices=STRATEGIES)
    p.add_argument("--model", default="gpt")
    p.add_argument("--depth", type=int, required=True)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    result = measure(a.strategy, a.model, a.depth, backend=a.backend, steps=a.steps,
                     batch=a.batch, device=a.device)
    print("AOTDIST_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
