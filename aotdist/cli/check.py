"""``aotdist check`` (does aotdist train this model?) and ``aotdist zoo`` (every family).

``check`` trains a family of :data:`aotdist.check.FAMILIES`, a ``--hf`` model type, a
``--torchvision`` constructor or the user's ``module:factory`` eager, with whole-model
``torch.compile`` and with aotdist, and exits 1 on a crash, a parity failure, a silent
eager region or a model not built. ``zoo`` runs ``check`` on every family, each in a fresh
process, and writes the table.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from aotdist.cli import parser as cli
from aotdist.cli.errors import UsageError, import_factory, user_code


def _check(args: argparse.Namespace) -> int:
    import json

    from aotdist.check import check_family, check_fsdp, resolve
    from aotdist.check.zoo import limit_memory

    if sum(x is not None for x in (args.model, args.hf, args.torchvision)) != 1:
        raise UsageError(
            "give one model: a family name or module:factory, --hf TYPE or --torchvision NAME"
        )
    spec = args.model or (f"hf:{args.hf}" if args.hf else f"torchvision:{args.torchvision}")
    try:
        family = resolve(spec)
    except ValueError as exc:
        from aotdist.check import FAMILIES
        from aotdist.config.validation import did_you_mean

        module, dot, factory = spec.rpartition(".")
        if dot and module and factory.isidentifier() and ":" not in spec:  # mymodels.build
            hint = f" (did you mean {module}:{factory!s}, a module:factory?)"
        else:
            hint = did_you_mean(spec, [f.name for f in FAMILIES])
        raise UsageError(f"{exc}{hint}") from None
    if family.source == "user":
        import_factory(spec)
    else:
        _check_library_name(args)
    limit_memory(args.memory_limit)
    with user_code(spec) if family.source == "user" else contextlib.nullcontext():
        if args.nproc > 1:
            if family.source == "user":  # here, so a factory that raises is one screen
                family.build(0)
            result = check_fsdp(
                spec, args.nproc, backend=args.backend, timeout=args.timeout, mode=args.fsdp_mode
            )
        else:
            result = check_family(family, backend=args.backend)
    print(result.line())
    for name, why in result.notes.items():
        print(f"  {name}: {why}")
    if result.status == "crash" and result.error:
        print(result.error, file=sys.stderr)
    if result.status == "not built":  # the user named it: nothing was checked, a failure
        print(
            f"aotdist check: {spec} was not built, so nothing was checked: "
            f"{result.error.splitlines()[0] if result.error else 'no error given'}. Fix: "
            "see `aotdist check --help` for what models are accepted.",
            file=sys.stderr,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
    return 0 if result.ok and result.status != "not built" else 1


def _check_library_name(args: argparse.Namespace) -> None:
    """An ``--hf`` type or ``--torchvision`` name the installed library lacks: one line
    with the closest name and the fix (exit 2, a usage mistake)."""
    from aotdist.check import FAMILIES
    from aotdist.config.validation import did_you_mean

    if args.hf is not None:
        from transformers import CONFIG_MAPPING

        flag, name, source, names = "--hf", args.hf, "transformers", list(CONFIG_MAPPING.keys())
        what, listing = "model type", "sorted(transformers.CONFIG_MAPPING)"
    elif args.torchvision is not None:
        import torchvision

        flag, name, source = "--torchvision", args.torchvision, "torchvision"
        names, what = torchvision.models.list_models(), "model"
        listing = "torchvision.models.list_models()"
    else:
        return
    if name in names:
        return
    checked = [f.name for f in FAMILIES if f.source == source and f.name in names]
    raise UsageError(
        f"{flag} {name}: the installed {source} has no {what} {name!r}"
        f"{did_you_mean(name, names)}. Fix: a name it has, e.g. {', '.join(checked[:6])}; "
        f'all {len(names)}: python -c "import {source}; print({listing})"'
    )


def _zoo(args: argparse.Namespace) -> int:
    import os

    from aotdist.check import FAILING, render, run_zoo
    from aotdist.check.zoo import SOURCES

    unknown = [s for s in args.source if s not in SOURCES]
    if unknown:
        raise UsageError(f"--source {unknown[0]}: the sources are {', '.join(SOURCES)}")
    results = run_zoo(
        args.families,
        backend=args.backend,
        fsdp_names=args.fsdp_families,
        fsdp_ranks=args.nproc,
        timeout=args.timeout,
        memory_gb=args.memory_limit,
        source=args.source,
    )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(render(results, backend=args.backend, source=args.source))
        print(f"wrote {args.out}")
    named = {n.rpartition(":")[2] for n in args.families or () if n != "all"}
    failing = [
        r.name
        for r in results
        if r.status in FAILING or (r.status == "not built" and r.name in named)
    ]  # the user asked for it
    if failing:
        print(f"failing: {', '.join(failing)}", file=sys.stderr)
    return 1 if failing else 0


def register(sub) -> None:
    """Adds ``check`` and ``zoo`` to the subcommands."""
    from aotdist.check.fsdp import check_fsdp  # defined there: the defaults
    from aotdist.check.runner import check_family
    from aotdist.check.zoo import run_zoo

    c = cli.add_command(
        sub,
        "check",
        summary="does aotdist train this model? (parity with eager)",
        description="Does aotdist train this model? Trains it eager, with whole-model "
        "torch.compile and with aotdist from the same weights and batches, compares losses, "
        "gradients and buffers, and says what aotdist did with each region. Exit 1 on a "
        "crash, a parity failure, a silent eager region or a model not built.",
    )
    c.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a family of `aotdist zoo` (e.g. llama) or module:factory, a function "
        "returning (model, inputs), inputs a dict of keyword arguments or a tuple",
    )
    c.add_argument("--hf", default=None, help="a transformers model type (tiny config)")
    c.add_argument("--torchvision", default=None, help="a torchvision.models constructor")
    cli.add_ranks(
        c,
        default=1,
        old="--fsdp",
        help="ranks; > 1 shards with FSDP2 "
        "(aotdist.parallelize, gloo) and compares with single-process eager",
    )
    cli.add_fsdp_mode(c)
    cli.add_backend(
        c,
        default=cli.default_of(check_family, "backend"),
        help="torch.compile backend of the check: aot_eager (fast, parity exact) "
        "or inductor (what training compiles with)",
    )
    cli.add_memory_limit(
        c,
        help="cap the address space of the check (and its ranks) at GB "
        "GiB, so that a build too big for the machine fails instead of being "
        "killed (default 0: no cap)",
    )
    cli.add_timeout(
        c, default=cli.default_of(check_fsdp, "timeout"), help="seconds, with --nproc > 1"
    )
    c.add_argument("--json", default=None, help="also write the result to this file")
    c.set_defaults(func=_check)

    z = cli.add_command(
        sub,
        "zoo",
        summary="check every model family; write the table",
        description="Runs `aotdist check` on every listed model family, each "
        "in a fresh process, then a few under FSDP2, and writes the table "
        "(--out). Exit 1 when a family fails or one you named is not built.",
    )
    z.add_argument(
        "--families",
        type=cli.csv,
        default=None,
        help="default: the listed "
        "families; all: also every causal LM of the installed transformers",
    )
    z.add_argument(
        "--source",
        type=cli.csv,
        default=["families"],
        help="whose models, when "
        "--families is not given: families (the listed transformers and "
        "torchvision ones), timm (40+ architectures, stochastic depth on), "
        "torchtitan (its Llama 3, Qwen 3, Qwen 3 MoE, DeepSeek-V3), diffusers "
        "(16 denoiser classes: DiT, MMDiT, UNet, video; also diffusers' own "
        "compile_repeated_blocks), peft (LoRA adapters on 6 causal LMs); several "
        "comma-separated",
    )
    z.add_argument(
        "--fsdp-families",
        type=cli.csv,
        default=list(cli.default_of(run_zoo, "fsdp_names")),
        help="also checked under FSDP2, on --nproc ranks",
    )
    cli.add_ranks(
        z,
        default=cli.default_of(run_zoo, "fsdp_ranks"),
        old="--fsdp",
        help="ranks of the --fsdp-families checks (1: none)",
    )
    cli.add_backend(
        z, default=cli.default_of(run_zoo, "backend"), help="torch.compile backend of every check"
    )
    cli.add_memory_limit(
        z,
        default=None,
        help="address space per check process (default: half the physical memory; 0: no cap)",
    )
    cli.add_timeout(z, default=cli.default_of(run_zoo, "timeout"), help="seconds per family")
    cli.add_out(
        z,
        default="zoo-out/models.md",
        help="the table ('' to skip; aotdist's own page: --out docs/models.md)",
    )
    z.set_defaults(func=_zoo)
