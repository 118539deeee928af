"""The ``aotdist`` command: ``aotdist bench`` and ``aotdist inspect``."""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings

__all__ = ["main"]


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _ints(text: str) -> list[int]:
    try:
        values = [int(t) for t in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _build(model: str, depth: int):
    from aotdist.testing.models import build_model

    if ":" in model:  # module:factory, a zero-argument function returning a module
        mod_name, _, attr = model.partition(":")
        return getattr(importlib.import_module(mod_name), attr)()
    return build_model(model, depth=depth)


def _cmd_bench(args) -> int:
    from aotdist.bench import plan_cases, run_bench
    from aotdist.errors import BenchError, ConfigError

    try:
        cases = plan_cases(models=args.model, depths=args.depths, nprocs=args.nproc,
                           strategies=args.strategies)
    except ConfigError as exc:
        print(f"aotdist bench: {exc}", file=sys.stderr)
        return 2
    try:
        run_bench(cases, backend=args.backend, steps=args.steps, warmup=args.warmup,
                  device=args.device, float8=args.float8, repeats=args.repeats, out=args.out,
                  timeout=args.timeout, profile=args.profile)
    except (BenchError, ConfigError) as exc:
        print(f"aotdist bench: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}/bench.json, bench.md, bench.png")
    return 0


def _cmd_inspect(args) -> int:
    import torch

    import aotdist
    from aotdist import metrics
    from aotdist.testing.models import example_inputs

    model = _build(args.model, args.depth)
    plan = aotdist.find_regions(model)
    print(plan)
    aotdist.compile_regions(model, plan=plan, backend=args.backend)
    try:
        (x,), _ = example_inputs(model)
    except TypeError:
        print("(no built-in example inputs for this model: printed the plan only)")
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", aotdist.RegionCompileWarning)
        with metrics.track(model) as m:
            out = model(x)
            (out if isinstance(out, torch.Tensor) else out[0]).float().mean().backward()
    for w in caught:
        if issubclass(w.category, aotdist.RegionCompileWarning):
            print(f"warning: {w.message}")
    print(m.summary())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``aotdist`` console script."""
    parser = argparse.ArgumentParser(prog="aotdist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser(
        "bench", help="compile time, step time and memory of eager / full torch.compile / "
        "Accelerate compile_regions / aotdist, side by side",
        description="Without --model, --depths and --nproc: the main job (GPT at depths 2, 8, "
        "32 with every strategy; torchvision ViT at depth 8; GPT at depth 8 on 2 ranks with "
        "FSDP2), about 8 minutes on a 2-core CPU. With any of them: their grid.")
    b.add_argument("--model", type=_csv, default=None, help="gpt, vit, resnet (comma-separated)")
    b.add_argument("--depths", type=_ints, default=None, help="e.g. 2,8,32")
    b.add_argument("--nproc", type=_ints, default=None,
                   help="ranks, e.g. 1,2; > 1 shards with FSDP2 (gloo on CPU, NCCL on CUDA)")
    b.add_argument("--strategies", type=_csv, default=None,
                   help="comma-separated, default all: eager, full, accelerate, aotdist")
    b.add_argument("--backend", default="inductor")
    b.add_argument("--steps", type=int, default=20, help="steady steps timed (median)")
    b.add_argument("--warmup", type=int, default=3, help="untimed steps after the cold one")
    b.add_argument("--repeats", type=int, default=1, help="fresh processes per cell (medians)")
    b.add_argument("--float8", action="store_true", help="torchao Float8 in every strategy")
    b.add_argument("--device", default="cpu", help="cpu or cuda")
    b.add_argument("--timeout", type=float, default=1200.0, help="seconds per measurement")
    b.add_argument("--profile", action="store_true", help="write cProfile, torch.profiler and "
                   "compile-phase files per measurement to OUT/profile (inflates timings)")
    b.add_argument("--out", default="bench-out")
    b.set_defaults(func=_cmd_bench)

    i = sub.add_parser("inspect", help="region plan and compile metrics of a model")
    i.add_argument("--model", default="gpt", help="gpt, vit, resnet, aliasing or module:factory")
    i.add_argument("--depth", type=int, default=4)
    i.add_argument("--backend", default="aot_eager")
    i.set_defaults(func=_cmd_inspect)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
