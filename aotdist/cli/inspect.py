"""``aotdist inspect``: a model's region plan and what AOTAutograd captured, per region.

Builds a built-in model or a ``module:factory``, optionally shards it with FSDP2 on
``--nproc`` gloo ranks (:func:`aotdist.parallelize`), captures one training step
(:func:`aotdist.capture`) and prints the plan, the metrics and the capture summary;
``--out`` saves the graphs.
"""

from __future__ import annotations

import argparse
import warnings

from aotdist.cli import parser as cli
from aotdist.cli.errors import import_factory, user_code

DEFAULT_TIMEOUT_S = 300.0  # the ranks' start-up, one captured step and the save


def build(model: str, depth: int):
    """A built-in model of ``depth`` blocks, or what ``module:factory`` returns."""
    from aotdist.testing.models import build_model

    if ":" in model:  # module:factory, a zero-argument function returning a module
        factory = import_factory(model)
        with user_code(model):
            return factory()
    return build_model(model, depth=depth)


def inspect_rank(rank: int, world_size: int, opts: dict) -> str:
    """Builds, optionally parallelizes, and captures one step; rank 0 saves. Returns the
    report text (module level: ``run_distributed`` spawns it)."""
    import torch

    import aotdist
    from aotdist.testing.models import example_inputs

    model = build(opts["model"], opts["depth"])
    config: dict = {"compile": {"enabled": False}}
    fsdp_mode = opts.get("fsdp_mode", "hooks")
    if opts["fsdp"]:
        config["fsdp"] = {"enabled": True, "mode": fsdp_mode}
    if opts["float8"]:
        config["float8"] = {"enabled": True, "fsdp_all_gather": bool(opts["fsdp"])}
    plan = aotdist.find_regions(model)
    if opts["fsdp"] or opts["float8"]:
        aotdist.parallelize(model, config=config)
        plan = aotdist.parallelize_info(model).plan
    lines = [str(plan)]
    try:
        (x,), _ = example_inputs(model, generator=torch.Generator().manual_seed(rank))
    except TypeError:
        return "\n".join(
            [*lines, "(no built-in example inputs for this model: printed the plan only)"]
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", aotdist.RegionCompileWarning)
        cap = aotdist.capture(
            model,
            x,
            backend=opts["backend"],
            loss_fn=lambda out: (out if isinstance(out, torch.Tensor) else out[0]).float().mean(),
        )
    lines += [
        f"warning: {w.message}"
        for w in caught
        if issubclass(w.category, aotdist.RegionCompileWarning)
    ]
    lines += [cap.metrics.summary(), cap.summary()]
    if opts["out"] and rank == 0:
        files = cap.save(opts["out"])
        lines.append(f"wrote {len(files)} files to {opts['out']}")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    from aotdist.check.zoo import limit_memory

    fsdp = args.nproc > 1 or args.nproc_alias is not None  # the old --fsdp: also on 1 rank
    opts = {
        "model": args.model,
        "depth": args.depth,
        "fsdp": fsdp,
        "fsdp_mode": args.fsdp_mode,
        "float8": args.float8,
        "out": args.out,
        "backend": args.backend,
    }
    if ":" in args.model:
        import_factory(args.model)  # here, so a bad name is one screen, not one per rank
    else:
        from aotdist.testing.models import build_model

        build_model(args.model, depth=1)  # an unknown name: ConfigError, before any rank
    limit_memory(args.memory_limit)  # the ranks inherit the cap
    if fsdp:
        from aotdist.launch import run_distributed

        texts = run_distributed(inspect_rank, args.nproc, opts, timeout=args.timeout)
    else:
        texts = [inspect_rank(0, 1, opts)]
    print(texts[0])
    return 0


def register(sub) -> None:
    """Adds ``inspect`` to the subcommands."""
    import aotdist

    i = cli.add_command(
        sub,
        "inspect",
        summary="the region plan and what AOTAutograd captured per region",
        description="Builds a model, finds its regions and captures one "
        "training step: the region plan, then what AOTAutograd captured "
        "per region (graphs, call sites, subgraphs); --out saves them.",
    )
    i.add_argument("--model", default="gpt", help="gpt, vit, resnet, aliasing or module:factory")
    i.add_argument("--depth", type=int, default=4, help="blocks of a built-in model")
    cli.add_backend(
        i,
        default=cli.default_of(aotdist.capture, "backend"),
        help="torch.compile backend of the capture: aot_eager or inductor",
    )
    cli.add_ranks(
        i,
        default=1,
        old="--fsdp",
        old_switch=True,
        help="ranks (gloo on CPU); > 1 shards with FSDP2 (aotdist.parallelize)",
    )
    cli.add_fsdp_mode(i)
    cli.add_float8(i, help="torchao Float8 training (float8 all-gather with --nproc > 1)")
    cli.add_memory_limit(
        i,
        help="cap the address space of the command and its ranks at GB "
        "GiB, so that a model too big for the machine fails instead of being "
        "killed (default 0: no cap)",
    )
    cli.add_timeout(i, default=DEFAULT_TIMEOUT_S, help="seconds, with --nproc > 1")
    cli.add_out(i, default=None, help="save capture.json and one .py per graph in this directory")
    i.set_defaults(func=_run)
