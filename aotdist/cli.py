"""The ``aotdist`` command: ``bench``, ``inspect``, ``check`` and ``zoo``."""

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


def _mesh(text: str) -> tuple[int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"expected REPLICASxSHARDS such as 2x2, got {text!r}")
    return int(parts[0]), int(parts[1])


def _build(model: str, depth: int):
    from aotdist.testing.models import build_model

    if ":" in model:  # module:factory, a zero-argument function returning a module
        mod_name, _, attr = model.partition(":")
        return getattr(importlib.import_module(mod_name), attr)()
    return build_model(model, depth=depth)


def _cmd_bench(args) -> int:
    from aotdist.bench import MAIN_SETTINGS, QUICK_SETTINGS, plan_cases, run_bench
    from aotdist.errors import BenchError, ConfigError

    job = QUICK_SETTINGS if args.quick else MAIN_SETTINGS
    try:
        cases = plan_cases(models=args.model, depths=args.depths, nprocs=args.nproc,
                           strategies=args.strategies, quick=args.quick)
    except ConfigError as exc:
        print(f"aotdist bench: {exc}", file=sys.stderr)
        return 2
    try:
        run_bench(cases, backend=args.backend,
                  steps=job.steps if args.steps is None else args.steps,
                  warmup=job.warmup if args.warmup is None else args.warmup,
                  repeats=job.repeats if args.repeats is None else args.repeats,
                  device=args.device, float8=args.float8, out=args.out,
                  timeout=args.timeout, profile=args.profile, mesh=args.mesh,
                  mode=args.mode)
    except (BenchError, ConfigError) as exc:
        print(f"aotdist bench: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}/bench.json, bench.md, bench.png")
    return 0


def _inspect(rank: int, world_size: int, opts: dict) -> str:
    """Builds, optionally parallelizes, and captures one step; rank 0 saves. Returns the
    report text (module level: ``run_distributed`` spawns it)."""
    import torch

    import aotdist
    from aotdist.testing.models import example_inputs

    model = _build(opts["model"], opts["depth"])
    config: dict = {"compile": {"enabled": False}}
    fsdp_mode = opts.get("fsdp_mode", "hooks")
    if opts["fsdp"]:
        config["fsdp"] = {"enabled": True, "mode": fsdp_mode}
    if opts["float8"]:
        config["float8"] = {"enabled": True,
                            "fsdp_all_gather": opts["fsdp"] and fsdp_mode == "hooks"}
    plan = aotdist.find_regions(model)
    if opts["fsdp"] or opts["float8"]:
        aotdist.parallelize(model, config=config)
        plan = aotdist.parallelize_info(model).plan
    lines = [str(plan)]
    try:
        (x,), _ = example_inputs(model, generator=torch.Generator().manual_seed(rank))
    except TypeError:
        return "\n".join([*lines, "(no built-in example inputs for this model: printed the "
                           "plan only)"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", aotdist.RegionCompileWarning)
        cap = aotdist.capture(model, x, backend=opts["backend"],
                              loss_fn=lambda out: (out if isinstance(out, torch.Tensor)
                                                   else out[0]).float().mean())
    lines += [f"warning: {w.message}" for w in caught
              if issubclass(w.category, aotdist.RegionCompileWarning)]
    lines += [cap.metrics.summary(), cap.summary()]
    if opts["out"] and rank == 0:
        files = cap.save(opts["out"])
        lines.append(f"wrote {len(files)} files to {opts['out']}")
    return "\n".join(lines)


def _cmd_inspect(args) -> int:
    opts = {k: getattr(args, k) for k in ("model", "depth", "fsdp", "fsdp_mode", "float8", "out",
                                          "backend")}
    if args.fsdp or args.nproc > 1:
        from aotdist.launch import run_distributed

        texts = run_distributed(_inspect, args.nproc, opts, timeout=args.timeout)
    else:
        texts = [_inspect(0, 1, opts)]
    print(texts[0])
    return 0


def _cmd_check(args) -> int:
    import json

    from aotdist.check import check_family, check_fsdp, resolve
    from aotdist.check.zoo import limit_memory

    if sum(x is not None for x in (args.model, args.hf, args.torchvision)) != 1:
        print("aotdist check: give one model: a family name or module:factory, --hf TYPE "
              "or --torchvision NAME", file=sys.stderr)
        return 2
    spec = args.model or (f"hf:{args.hf}" if args.hf else f"torchvision:{args.torchvision}")
    try:
        resolve(spec)
    except ValueError as exc:
        print(f"aotdist check: {exc}", file=sys.stderr)
        return 2
    limit_memory(args.memory_limit)
    if args.fsdp and args.fsdp > 1:
        result = check_fsdp(spec, args.fsdp, backend=args.backend, timeout=args.timeout,
                            mode=args.fsdp_mode)
    else:
        result = check_family(spec, backend=args.backend)
    print(result.line())
    for name, why in result.notes.items():
        print(f"  {name}: {why}")
    if result.status == "crash" and result.error:
        print(result.error, file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
    return 0 if result.ok else 1


def _cmd_zoo(args) -> int:
    import os

    from aotdist.check import FAILING, render, run_zoo
    from aotdist.check.zoo import FSDP_FAMILIES

    results = run_zoo(args.families, backend=args.backend,
                      fsdp_names=FSDP_FAMILIES if args.fsdp_families is None
                      else args.fsdp_families, fsdp_ranks=args.fsdp, timeout=args.timeout,
                      memory_gb=args.memory_limit)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(render(results, backend=args.backend))
        print(f"wrote {args.out}")
    failing = [r.name for r in results if r.status in FAILING]
    if failing:
        print(f"failing: {', '.join(failing)}", file=sys.stderr)
    return 1 if failing else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``aotdist`` console script."""
    parser = argparse.ArgumentParser(prog="aotdist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser(
        "bench", help="compile time, step time and memory of eager / full torch.compile / "
        "Accelerate compile_regions / aotdist, side by side",
        description="Without --model, --depths and --nproc: the main job (GPT at depths 2, 8, "
        "32 with every strategy and at depth 64 with Accelerate and aotdist, transformers' "
        "Llama and a ModuleDict GPT at depth 8; 2 repeats run round robin, 20 timed steps, "
        "then the strategies side by side in one process per depth), about 12 minutes on a "
        "quiet 2-core Intel Xeon (twice that on slower cores); with --quick, GPT at depth 2, 1 repeat, 5 timed "
        "steps (under 2 minutes). With any of --model/--depths/--nproc: their grid.")
    b.add_argument("--model", type=_csv, default=None, help="gpt, vit, resnet, llama (transformers), dictgpt "
                   "(blocks in a ModuleDict); comma-separated")
    b.add_argument("--depths", type=_ints, default=None, help="e.g. 2,8,32")
    b.add_argument("--nproc", type=_ints, default=None,
                   help="ranks, e.g. 1,2; > 1 shards with FSDP2 (gloo on CPU, NCCL on CUDA)")
    b.add_argument("--strategies", type=_csv, default=None,
                   help="comma-separated, default all: eager, full, accelerate, aotdist")
    b.add_argument("--backend", default="inductor")
    b.add_argument("--mode", default=None, help="torch.compile mode of every compiling "
                   "strategy (reduce-overhead: CUDA graphs, with --device cuda)")
    b.add_argument("--quick", action="store_true", help="the developers' job: one depth, one "
                   "repeat, few steps (no spreads: do not judge targets from it)")
    b.add_argument("--steps", type=int, default=None,
                   help="steady steps timed per run (median; default 20, 5 with --quick)")
    b.add_argument("--warmup", type=int, default=None,
                   help="untimed steps after the cold one (default 3, 1 with --quick)")
    b.add_argument("--repeats", type=int, default=None,
                   help="runs per cell, each a fresh process, round robin over the cells; "
                   "the report gives medians, spreads and per-repeat ratios (default 3, 1 "
                   "with --quick)")
    b.add_argument("--float8", action="store_true", help="torchao Float8 in every strategy")
    b.add_argument("--mesh", type=_mesh, default=None, metavar="RxS",
                   help="with --nproc R*S: shard as HSDP on a (replicate, shard) mesh, e.g. 2x2")
    b.add_argument("--device", default="cpu", help="cpu or cuda")
    b.add_argument("--timeout", type=float, default=1200.0, help="seconds per measurement")
    b.add_argument("--profile", action="store_true", help="write cProfile, torch.profiler and "
                   "compile-phase files per measurement to OUT/profile (inflates timings)")
    b.add_argument("--out", default="bench-out")
    b.set_defaults(func=_cmd_bench)

    i = sub.add_parser("inspect", help="region plan and what AOTAutograd captured, per region")
    i.add_argument("--model", default="gpt", help="gpt, vit, resnet, aliasing or module:factory")
    i.add_argument("--depth", type=int, default=4)
    i.add_argument("--backend", default="aot_eager", help="aot_eager or inductor")
    i.add_argument("--nproc", type=int, default=1, help="ranks (gloo on CPU); with --fsdp")
    i.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (aotdist.parallelize)")
    i.add_argument("--fsdp-mode", default="hooks", choices=("hooks", "graph"),
                   help="with --fsdp: FSDP2 units (hooks) or graph-mode FSDP (collectives in "
                   "the graph, shown per graph)")
    i.add_argument("--float8", action="store_true",
                   help="torchao Float8 training (float8 all-gather with --fsdp)")
    i.add_argument("--out", default=None, help="save capture.json and one .py per graph")
    i.add_argument("--timeout", type=float, default=300.0, help="seconds, with --nproc/--fsdp")
    i.set_defaults(func=_cmd_inspect)

    c = sub.add_parser(
        "check", help="does aotdist train this model? one step eager, whole-model "
        "torch.compile and aotdist; exit 1 on a crash, a parity failure or a silent eager "
        "region")
    c.add_argument("model", nargs="?", default=None,
                   help="a family of `aotdist zoo` (e.g. llama) or module:factory, a function "
                   "returning (model, inputs), inputs a dict of keyword arguments or a tuple")
    c.add_argument("--hf", default=None, help="a transformers model type (tiny config)")
    c.add_argument("--torchvision", default=None, help="a torchvision.models constructor")
    c.add_argument("--fsdp", type=int, default=0, help="ranks: shard with FSDP2 "
                   "(aotdist.parallelize, gloo) and compare with single-process eager")
    c.add_argument("--fsdp-mode", default="hooks", choices=("hooks", "graph"),
                   help="with --fsdp: FSDP2 units (hooks) or graph-mode FSDP (collectives in "
                   "the compiled graph)")
    c.add_argument("--backend", default="aot_eager")
    c.add_argument("--timeout", type=float, default=600.0, help="seconds, with --fsdp")
    c.add_argument("--json", default=None, help="also write the result to this file")
    c.add_argument("--memory-limit", type=float, default=0.0, metavar="GB",
                   help="cap the address space of the check (and its ranks) at GB GiB, so "
                   "that a build too big for the machine fails instead of being killed")
    c.set_defaults(func=_cmd_check)

    z = sub.add_parser("zoo", help="check every model family (tiny transformers and "
                       "torchvision builds), each in a fresh process; write docs/models.md")
    z.add_argument("--families", type=_csv, default=None, help="default: the listed families; all: also every causal LM of the installed transformers")
    z.add_argument("--fsdp-families", type=_csv, default=None,
                   help="also checked under FSDP2 (default llama,qwen3_moe,bert)")
    z.add_argument("--fsdp", type=int, default=2, help="ranks for those (1: none)")
    z.add_argument("--backend", default="aot_eager")
    z.add_argument("--timeout", type=float, default=600.0, help="seconds per family")
    z.add_argument("--memory-limit", type=float, default=None, metavar="GB",
                   help="address space per check process (default: half the physical "
                   "memory; 0: none)")
    z.add_argument("--out", default="docs/models.md", help="the table ('' to skip)")
    z.set_defaults(func=_cmd_zoo)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
