"""Steady step of eager, whole-model compile, Accelerate per-block and aotdist side by side
in one process, with and without CUDA graphs (``mode="reduce-overhead"``).

The GPU counterpart of the bench's paired rounds, small enough for a short GPU lease
(about 2 minutes for the default configs on one H100):

    python scripts/gpu_probe.py --out probe.json               # on a CUDA machine
    python scripts/gpu_probe.py --device cpu --modes default   # a smoke run anywhere

Each config ``gpt:DIM:DEPTH`` builds TinyGPT (dim 32: the bench's GPT, sequence 16; larger
dims: sequence 256, vocabulary 4096, 8 heads) once per strategy from the same seed, takes
one cold step (compile; in one process later strategies can load kernels the earlier ones
compiled, so these are not the bench's cold compiles) and 3 warm-up steps, then times
``--rounds`` rounds of ``--steps`` steps of every strategy, the order rotating per round.
``aotdist+inline`` (only when ``--strategies`` names it) is aotdist with every region call
flattened before Inductor (docs/bench/levers.md, lever 1). The ratios (aotdist and
aotdist+inline over each peer) are computed per round and reported as median, min and
max. A strategy that fails is recorded with its traceback; the others go on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
import warnings

import torch

STRATEGIES = ("eager", "full", "accelerate", "aotdist", "aotdist+inline")
COMPARED = ("aotdist", "aotdist+inline")  # each one's ratios to every peer are reported


def _build(dim: int, depth: int, device: torch.device):
    from aotdist.testing.models import TinyGPT

    torch.manual_seed(0)
    small = dim <= 64
    return TinyGPT(
        vocab=64 if small else 4096,
        dim=dim,
        depth=depth,
        heads=2 if small else 8,
        seq_len=16 if small else 256,
    ).to(device)


def _apply(name: str, model, mode: str):
    """The bench's strategy ``name`` (eager, full, accelerate, aotdist) with ``mode``, or
    ``aotdist+inline``."""
    from aotdist.bench.strategies import Setup, get_strategy

    mode_or_none = None if mode == "default" else mode
    if name == "aotdist+inline":  # regions traced once, flattened before Inductor (lever 1)
        import aotdist
        from aotdist.backends.inline import inline_backend

        return aotdist.compile_regions(model, backend=inline_backend(mode_or_none))
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    return get_strategy(name).apply(model, Setup(backend="inductor", mode=mode_or_none))


def _step_fn(run, model, x, y, *, cuda_graphs: bool, sync):
    from aotdist.bench.models import training_loss

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> tuple[float, float]:
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        sync()
        start = time.perf_counter()
        loss = training_loss(run(x), y)  # the bench's loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - start, float(loss)

    return step


def probe(
    dim: int,
    depth: int,
    mode: str,
    *,
    strategies,
    device: torch.device,
    batch: int,
    rounds: int,
    steps: int,
) -> dict:
    """One config in one mode: cold step, first loss and per-round median step times of
    every strategy, and aotdist's ratios to each peer."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    entry = {
        "dim": dim,
        "depth": depth,
        "mode": mode,
        "cold_s": {},
        "first_loss": {},
        "rounds_s": {},
        "errors": {},
    }
    g = torch.Generator().manual_seed(1)
    shape = _build(dim, 1, torch.device("cpu"))
    vocab, seq = shape.vocab, shape.seq_len
    x = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    y = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
    steps_of = {}
    for name in strategies:
        if name == "eager" and mode != "default":
            continue
        try:
            model = _build(dim, depth, device)
            step = _step_fn(
                _apply(name, model, mode), model, x, y, cuda_graphs=mode != "default", sync=sync
            )
            start = time.perf_counter()
            _, loss = step()
            entry["cold_s"][name] = time.perf_counter() - start
            entry["first_loss"][name] = loss
            for _ in range(3):
                step()
            steps_of[name] = step
            print(
                f"gpt:{dim}:{depth} {mode} {name}: cold {entry['cold_s'][name]:.1f}s "
                f"loss {loss:.4f}",
                flush=True,
            )
        except Exception as exc:  # recorded; the other strategies go on
            entry["errors"][name] = traceback.format_exc()[-2000:]
            print(f"gpt:{dim}:{depth} {mode} {name}: FAILED {exc!r}"[:400], flush=True)
    names = list(steps_of)
    for r in range(rounds):
        k = r % max(len(names), 1)
        for name in names[k:] + names[:k]:
            times = [steps_of[name]()[0] for _ in range(steps)]
            entry["rounds_s"].setdefault(name, []).append(statistics.median(times))
    entry["step_ms"] = {n: statistics.median(v) * 1e3 for n, v in entry["rounds_s"].items()}
    for ours in COMPARED:
        for peer in ("full", "accelerate", "eager", "aotdist"):
            if ours != peer and ours in entry["rounds_s"] and peer in entry["rounds_s"]:
                ratios = [
                    a / b
                    for a, b in zip(entry["rounds_s"][ours], entry["rounds_s"][peer], strict=True)
                ]
                entry[f"{ours}_over_{peer}"] = [statistics.median(ratios), min(ratios), max(ratios)]
    return entry


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--configs", default="gpt:32:8,gpt:512:8", help="comma-separated gpt:DIM:DEPTH")
    p.add_argument(
        "--modes",
        default="default,reduce-overhead",
        help="default and/or reduce-overhead (CUDA graphs; CUDA only)",
    )
    p.add_argument(
        "--strategies",
        default="eager,full,accelerate,aotdist",
        help=f"comma-separated, from {', '.join(STRATEGIES)}",
    )
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default="probe.json")
    a = p.parse_args(argv)
    warnings.simplefilter("ignore")
    device = torch.device(a.device)
    results = []
    for cfg in a.configs.split(","):
        _, dim, depth = cfg.split(":")
        for mode in a.modes.split(","):
            if mode != "default" and device.type != "cuda":
                print(f"{cfg} {mode}: skipped (CUDA graphs need a CUDA device)")
                continue
            entry = probe(
                int(dim),
                int(depth),
                mode,
                strategies=a.strategies.split(","),
                device=device,
                batch=a.batch,
                rounds=a.rounds,
                steps=a.steps,
            )
            print(
                json.dumps({k: v for k, v in entry.items() if k not in ("errors", "rounds_s")}),
                flush=True,
            )
            results.append(entry)
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            with open(a.out, "w") as f:  # after every config: a timeout keeps the rest
                json.dump(
                    {
                        "torch": torch.__version__,
                        "device": (
                            torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
                        ),
                        "results": results,
                    },
                    f,
                    indent=1,
                )
    return 1 if any(e["errors"] for e in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
