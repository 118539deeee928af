"""``aotdist bench``: compile time, step time and memory of eager, whole-model
``torch.compile``, Accelerate's per-block compile and aotdist, side by side.

The flags map onto :func:`aotdist.bench.plan_cases` (the grid) and
:func:`aotdist.bench.run_bench` (how each cell runs); their defaults are read from there
and from the job settings (:data:`~aotdist.bench.MAIN_SETTINGS`, ``--quick``:
:data:`~aotdist.bench.QUICK_SETTINGS`).
"""

from __future__ import annotations

import argparse
import sys

from aotdist.cli import parser as cli
from aotdist.cli.errors import UsageError


def _run(args: argparse.Namespace) -> int:
    from aotdist.bench import MAIN_SETTINGS, QUICK_SETTINGS, plan_cases, run_bench
    from aotdist.check.zoo import limit_memory
    from aotdist.errors import BenchError, ConfigError

    job = QUICK_SETTINGS if args.quick else MAIN_SETTINGS
    try:
        cases = plan_cases(
            models=args.model,
            depths=args.depths,
            nprocs=args.nproc,
            strategies=args.strategies,
            quick=args.quick,
            full=args.full,
        )
    except ConfigError as exc:
        print(f"aotdist bench: {exc}", file=sys.stderr)
        return 2
    if args.memory_limit and args.device != "cpu":
        raise UsageError(
            f"--memory-limit with --device {args.device}: the cap is on address "
            "space, which CUDA reserves by the terabyte. Fix: drop --memory-limit"
        )
    limit_memory(args.memory_limit)  # every measurement's fresh process inherits the cap
    try:
        run_bench(
            cases,
            backend=args.backend,
            steps=job.steps if args.steps is None else args.steps,
            warmup=job.warmup if args.warmup is None else args.warmup,
            repeats=job.repeats if args.repeats is None else args.repeats,
            device=args.device,
            float8=args.float8,
            out=args.out,
            timeout=args.timeout,
            profile=args.profile,
            mesh=args.mesh,
            mode=args.compile_mode,
        )
    except (BenchError, ConfigError) as exc:
        print(f"aotdist bench: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}/bench.json, bench.md, bench.png")
    return 0


def register(sub) -> None:
    """Adds ``bench`` to the subcommands."""
    from aotdist.bench import ALL_STRATEGIES, MAIN_SETTINGS, QUICK_SETTINGS, run_bench
    from aotdist.bench.strategies import STRATEGIES
    from aotdist.config import COMPILE_MODES

    main, quick = MAIN_SETTINGS, QUICK_SETTINGS
    b = cli.add_command(
        sub,
        "bench",
        summary="compile time, step time and memory per strategy",
        description="Compile time, step time and memory of eager, whole-model torch.compile, "
        "per-block compile (Accelerate's compile_regions) and aotdist, side by side. Without "
        "--model, --depths and --nproc: the main job (time to the first 100 to 100,000 "
        "steps against whole-model, Accelerate's and per-block compile: GPT at depths "
        "8, 32 and 64, transformers' Llama at 32, a ModuleDict GPT at 8, warm restarts at "
        f"GPT 8; {main.repeats} repeats, {main.steps} timed steps, then the strategies side "
        "by side in one process per depth), 11 minutes on a quiet 2-core Intel Xeon; "
        "--full: the whole matrix; with --quick, GPT at depth 2, "
        f"{quick.repeats} repeat, "
        f"{quick.steps} timed steps (about 2 minutes there, up to twice that under load). "
        "With any of --model/--depths/--nproc: their grid.",
    )
    b.add_argument(
        "--model",
        type=cli.csv,
        default=None,
        help="gpt, vit, resnet, llama "
        "(transformers), dictgpt (blocks in a ModuleDict), flux (diffusers; with the "
        "repeated_blocks strategy); comma-separated",
    )
    b.add_argument("--depths", type=cli.ints, default=None, help="e.g. 2,8,32")
    cli.add_ranks(
        b,
        default=None,
        grid=True,
        help="ranks per cell, e.g. 1,2; > 1 shards with FSDP2 (gloo on CPU, NCCL on "
        "CUDA; graph-mode FSDP: the aotdist-graph strategies)",
    )
    b.add_argument(
        "--strategies",
        type=cli.csv,
        default=None,
        help=f"comma-separated, default {', '.join(ALL_STRATEGIES)}; also "
        f"{', '.join(s for s in STRATEGIES if s not in ALL_STRATEGIES)} (-graph: "
        "graph-mode FSDP; +cache: warm starts from the artifact cache); a +warm "
        "suffix (aotdist+warm) adds a warm restart on the kept compiler caches",
    )
    cli.add_backend(
        b,
        default=cli.default_of(run_bench, "backend"),
        help="torch.compile backend of every compiling strategy",
    )
    b.add_argument(
        "--compile-mode",
        default=cli.default_of(run_bench, "mode"),
        choices=COMPILE_MODES,
        metavar="MODE",
        help="torch.compile mode of every "
        f"compiling strategy: {', '.join(COMPILE_MODES)} (reduce-overhead: CUDA "
        "graphs, with --device cuda)",
    )
    cli.add_old_spelling(b, "--mode", "--compile-mode", choices=COMPILE_MODES)
    b.add_argument(
        "--quick",
        action="store_true",
        help="the developers' job: one depth, one "
        "repeat, few steps (no spreads: do not judge targets from it)",
    )
    b.add_argument(
        "--full",
        action="store_true",
        help="the main job's whole matrix: GPT and "
        "Llama at depths 8, 32 and 64 against every peer, ModuleDict GPT at 8 and "
        "32, warm restarts at depth 8, each with a short and a long run's compile "
        "(about 35 minutes on a 2-core CPU with the default 2 repeats)",
    )
    b.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steady steps timed per run "
        f"(median; default {main.steps}, {quick.steps} with --quick)",
    )
    b.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed steps after the cold one "
        f"(default {main.warmup}, {quick.warmup} with --quick)",
    )
    b.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs per cell, each a fresh process, round robin over the cells; "
        "the report gives medians, spreads and per-repeat ratios (default "
        f"{main.repeats}, {quick.repeats} with --quick)",
    )
    cli.add_float8(b, help="torchao Float8 training in every strategy")
    b.add_argument(
        "--mesh",
        type=cli.mesh,
        default=None,
        metavar="RxS",
        help="with --nproc R*S: shard as HSDP on a (replicate, shard) mesh, e.g. 2x2",
    )
    b.add_argument("--device", default=cli.default_of(run_bench, "device"), help="cpu or cuda")
    cli.add_memory_limit(
        b,
        help="cap each measurement's address space at GB GiB, so that a "
        "cell too big for the machine fails instead of being killed (CPU "
        "only; default 0: no cap)",
    )
    cli.add_timeout(b, default=cli.default_of(run_bench, "timeout"), help="seconds per measurement")
    b.add_argument(
        "--profile",
        action="store_true",
        help="write cProfile, torch.profiler and "
        "compile-phase files per measurement to OUT/profile (inflates timings)",
    )
    cli.add_out(
        b,
        default=str(cli.default_of(run_bench, "out")),
        help="directory of the report (bench.json, bench.md, bench.png)",
    )
    b.set_defaults(func=_run)
