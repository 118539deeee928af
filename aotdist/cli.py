"""The ``aotdist`` command: ``bench``, ``inspect``, ``check`` and ``zoo``.

One error path: a user mistake (an unknown model, a ``module:factory`` that does not
import or raises, a bad config) ends in one screen on stderr that says what is wrong
and the fix; exit 2 for usage, 1 for a failed check. ``--debug`` or ``AOTDIST_DEBUG=1``
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import traceback
import warnings

__all__ = ["main"]

DEBUG_ENV = "AOTDIST_DEBUG"  # set (not "0") to see tracebacks instead of one screen
_debug = False  # --debug or DEBUG_ENV: errors propagate as they are


class _UsageError(Exception):
    """A mistake in what the user asked for: exit 2, the message is the whole screen."""


class _NotBuilt(_UsageError):
    """A model the user named that cannot be built: one line, exit 1 (a failed check)."""


class _UserCodeError(Exception):
    """The user's own code (a ``module:factory``, the model it built) raised: exit 1."""

    def __init__(self, spec: str, exc: BaseException):
        super().__init__(spec)
        self.spec, self.exc = spec, exc


def _import_factory(spec: str):
    """The function ``module:factory`` names, imported as ``python -m`` would: with the
    working directory on ``sys.path``.

    Raises:
        _UsageError: The module does not import, or has no such attribute.
    """
    mod_name, _, attr = spec.partition(":")
    cwd = os.getcwd()
    if not any(os.path.abspath(p or ".") == cwd for p in sys.path):
        sys.path.insert(0, cwd)  # a console script does not put it there; python -m does
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        if not (exc.name and (mod_name == exc.name or mod_name.startswith(exc.name + "."))):
            if _debug:
                raise
            raise _UserCodeError(spec, exc) from exc  # the user's module imports a missing one
        raise _UsageError(
            f"cannot import {mod_name!r} for {spec!r} (looked in {cwd} and sys.path). Fix: "
            f"run from the directory holding {mod_name.replace('.', '/')}.py, or add its "
            "directory to PYTHONPATH.") from None
    except Exception as exc:  # noqa: BLE001 - the module's own top level raised
        if _debug:
            raise
        raise _UserCodeError(spec, exc) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        from aotdist.config.validation import did_you_mean

        public = [n for n in vars(module) if not n.startswith("_")
                  and callable(getattr(module, n))]
        raise _UsageError(
            f"{mod_name!r} ({getattr(module, '__file__', '?')}) has no function {attr!r}"
            f"{did_you_mean(attr, public)}. Fix: name a zero-argument function of it, "
            f"{mod_name}:FUNCTION.")
    return factory


@contextlib.contextmanager
def _user_code(spec: str):
    """Within: an exception (not aotdist's own) is the user's code's, named as such."""
    from aotdist.errors import AOTDistError

    try:
        yield
    except (AOTDistError, _UsageError, _UserCodeError):
        raise
    except Exception as exc:  # noqa: BLE001 - reported as the user's error, one screen
        if _debug:
            raise
        raise _UserCodeError(spec, exc) from exc


def _user_frame(exc: BaseException) -> str:
    """``file:line in function: code`` of the innermost frame outside aotdist, torch and
    the installed packages (the user's own line), or ``""``."""
    from aotdist.log import is_user_file

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
    if not frames:
        return ""
    f = frames[-1]
    path = os.path.relpath(f.filename) if os.path.abspath(f.filename).startswith(
        os.getcwd()) else f.filename
    return f"{path}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def _screen(exc: BaseException) -> tuple[int, str]:
    """The exit code and the one screen for an error that ended a command."""
    from aotdist.errors import AOTDistError, ConfigError, MissingDependencyError, first_line

    hint = f"(--debug or {DEBUG_ENV}=1 shows the traceback)"
    if isinstance(exc, _UsageError):
        return (1 if isinstance(exc, _NotBuilt) else 2), str(exc)
    if isinstance(exc, (ConfigError, MissingDependencyError)):
        return 2, str(exc)
    if isinstance(exc, _UserCodeError):
        where = _user_frame(exc.exc)
        if not where:  # aotdist refused what the factory returned: the message has the fix
            return 1, f"{first_line(exc.exc, 600)} {hint}"
        return 1, "\n".join(
            [f"{exc.spec} raised {first_line(exc.exc, 600)}", f"  at {where}",
             f"Fix: make {exc.spec} build its model without error (try calling it in "
             f"Python first) {hint}"])
    if isinstance(exc, AOTDistError):
        return 1, str(exc)
    where = _user_frame(exc)
    return 1, "\n".join([f"failed: {first_line(exc, 600)}"]
                        + ([f"  at {where}"] if where else []) + [hint])


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
        factory = _import_factory(model)
        with _user_code(model):
            return factory()
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
    if args.fsdp not in (None, True):  # --fsdp N, as check spells it: N ranks
        if args.nproc not in (1, args.fsdp):
            raise _UsageError(f"--fsdp {args.fsdp} and --nproc {args.nproc} disagree. Fix: "
                              f"give the ranks once, --fsdp {args.fsdp}")
        args.nproc = args.fsdp
    args.fsdp = args.fsdp is not None
    opts = {k: getattr(args, k) for k in ("model", "depth", "fsdp", "fsdp_mode", "float8", "out",
                                          "backend")}
    if ":" in args.model:
        _import_factory(args.model)  # here, so a bad name is one screen, not one per rank
    else:
        from aotdist.testing.models import build_model

        build_model(args.model, depth=1)  # an unknown name: ConfigError, before any rank
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
        raise _UsageError("give one model: a family name or module:factory, --hf TYPE or "
                          "--torchvision NAME")
    spec = args.model or (f"hf:{args.hf}" if args.hf else f"torchvision:{args.torchvision}")
    try:
        family = resolve(spec)
    except ValueError as exc:
        from aotdist.check import FAMILIES
        from aotdist.config.validation import did_you_mean

        raise _UsageError(f"{exc}{did_you_mean(spec, [f.name for f in FAMILIES])}") from None
    if family.source == "user":
        _import_factory(spec)
    else:
        _check_library_name(args)
    limit_memory(args.memory_limit)
    with _user_code(spec) if family.source == "user" else contextlib.nullcontext():
        if args.fsdp and args.fsdp > 1:
            if family.source == "user":  # here, so a factory that raises is one screen
                family.build(0)
            result = check_fsdp(spec, args.fsdp, backend=args.backend, timeout=args.timeout,
                                mode=args.fsdp_mode)
        else:
            result = check_family(family, backend=args.backend)
    print(result.line())
    for name, why in result.notes.items():
        print(f"  {name}: {why}")
    if result.status == "crash" and result.error:
        print(result.error, file=sys.stderr)
    if result.status == "not built":  # the user named it: nothing was checked, a failure
        print(f"aotdist check: {spec} was not built, so nothing was checked: "
              f"{result.error.splitlines()[0] if result.error else 'no error given'}. Fix: "
              "see `aotdist check --help` for what models are accepted.", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
    return 0 if result.ok and result.status != "not built" else 1


def _check_library_name(args) -> None:
    """An ``--hf`` type or ``--torchvision`` name the installed library lacks: one line
    with the closest name and the fix (exit 1: the model the user named is not built)."""
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
    raise _NotBuilt(
        f"{flag} {name}: the installed {source} has no {what} {name!r}"
        f"{did_you_mean(name, names)}. Fix: a name it has, e.g. {', '.join(checked[:6])}; "
        f"all {len(names)}: python -c \"import {source}; print({listing})\"")


def _cmd_zoo(args) -> int:
    import os

    from aotdist.check import FAILING, render, run_zoo
    from aotdist.check.zoo import FSDP_FAMILIES, SOURCES

    unknown = [s for s in args.source if s not in SOURCES]
    if unknown:
        raise _UsageError(f"--source {unknown[0]}: the sources are {', '.join(SOURCES)}")
    results = run_zoo(args.families, backend=args.backend,
                      fsdp_names=FSDP_FAMILIES if args.fsdp_families is None
                      else args.fsdp_families, fsdp_ranks=args.fsdp, timeout=args.timeout,
                      memory_gb=args.memory_limit, source=args.source)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(render(results, backend=args.backend, source=args.source))
        print(f"wrote {args.out}")
    named = {n.rpartition(":")[2] for n in args.families or () if n != "all"}
    failing = [r.name for r in results if r.status in FAILING
               or (r.status == "not built" and r.name in named)]  # the user asked for it
    if failing:
        print(f"failing: {', '.join(failing)}", file=sys.stderr)
    return 1 if failing else 0


class _HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default, where it has one its help does not state already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default in (None, False, "", argparse.SUPPRESS) or "default" in text
                or not action.option_strings):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {shown})".strip()


_DESCRIPTION = (
    "Compile the repeated regions of PyTorch models once. Subcommands: check (does aotdist "
    "train this model?), zoo (check every family), bench (compile and step time side by "
    "side), inspect (what was captured). A mistake is one screen with the fix; --debug (or "
    f"{DEBUG_ENV}=1) shows the traceback. Exit 2: a usage mistake; 1: a failed check.")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``aotdist`` console script."""
    from aotdist.version import __version__

    parser = argparse.ArgumentParser(prog="aotdist", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"aotdist {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help=f"on an error, show the traceback (or set {DEBUG_ENV}=1)")
    debug = argparse.ArgumentParser(add_help=False)  # --debug after the subcommand too
    fmt = {"formatter_class": _HelpFormatter}
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser(
        "bench", parents=[debug], **fmt, help="compile time, step time and memory of eager / full torch.compile / "
        "Accelerate compile_regions / aotdist, side by side",
        description="Without --model, --depths and --nproc: the main job (GPT at depths 2, 8, "
        "32 with every strategy and at depth 64 with Accelerate and aotdist, transformers' "
        "Llama and a ModuleDict GPT at depth 8; 2 repeats run round robin, 20 timed steps, "
        "then the strategies side by side in one process per depth), about 12 minutes on a "
        "quiet 2-core Intel Xeon (twice that on slower cores or under load); with --quick, GPT "
        "at depth 2, 1 repeat, 5 timed steps (about 2 minutes there, up to twice that under "
        "load). With any of --model/--depths/--nproc: their grid.")
    b.add_argument("--model", type=_csv, default=None, help="gpt, vit, resnet, llama (transformers), dictgpt "
                   "(blocks in a ModuleDict); comma-separated")
    b.add_argument("--depths", type=_ints, default=None, help="e.g. 2,8,32")
    b.add_argument("--nproc", type=_ints, default=None,
                   help="ranks, e.g. 1,2; > 1 shards with FSDP2 (gloo on CPU, NCCL on CUDA)")
    b.add_argument("--strategies", type=_csv, default=None,
                   help="comma-separated, default eager, full, accelerate, aotdist; also "
                   "aotdist-graph (graph-mode FSDP), aotdist+cache, aotdist-graph+cache "
                   "(warm starts from the artifact cache)")
    b.add_argument("--backend", default="inductor", help="torch.compile backend")
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
    b.add_argument("--out", default="bench-out", help="directory of the report")
    b.set_defaults(func=_cmd_bench)

    i = sub.add_parser("inspect", parents=[debug], **fmt,
                       help="region plan and what AOTAutograd captured, per region",
                       description="Builds a model, finds its regions and captures one "
                       "training step: the region plan, then what AOTAutograd captured per "
                       "region (graphs, call sites, subgraphs); --out saves them.")
    i.add_argument("--model", default="gpt", help="gpt, vit, resnet, aliasing or module:factory")
    i.add_argument("--depth", type=int, default=4, help="blocks of a built-in model")
    i.add_argument("--backend", default="aot_eager", help="aot_eager or inductor")
    i.add_argument("--nproc", type=int, default=1, help="ranks (gloo on CPU); with --fsdp")
    i.add_argument("--fsdp", type=int, nargs="?", const=True, default=None, metavar="N",
                   help="shard with FSDP2 (aotdist.parallelize) on N ranks, as check "
                   "spells it (--fsdp alone: over --nproc ranks)")
    i.add_argument("--fsdp-mode", default="hooks", choices=("hooks", "graph"),
                   help="with --fsdp: FSDP2 units (hooks) or graph-mode FSDP (collectives in "
                   "the graph, shown per graph)")
    i.add_argument("--float8", action="store_true",
                   help="torchao Float8 training (float8 all-gather with --fsdp)")
    i.add_argument("--out", default=None, help="save capture.json and one .py per graph")
    i.add_argument("--timeout", type=float, default=300.0, help="seconds, with --nproc/--fsdp")
    i.set_defaults(func=_cmd_inspect)

    c = sub.add_parser(
        "check", parents=[debug], **fmt, help="does aotdist train this model? one step eager, whole-model "
        "torch.compile and aotdist; exit 1 on a crash, a parity failure, a silent eager "
        "region or a model not built")
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
    c.add_argument("--backend", default="aot_eager",
                   help="torch.compile backend of the check: aot_eager (fast, parity exact) "
                   "or inductor (what training compiles with)")
    c.add_argument("--timeout", type=float, default=600.0, help="seconds, with --fsdp")
    c.add_argument("--json", default=None, help="also write the result to this file")
    c.add_argument("--memory-limit", type=float, default=0.0, metavar="GB",
                   help="cap the address space of the check (and its ranks) at GB GiB, so "
                   "that a build too big for the machine fails instead of being killed")
    c.set_defaults(func=_cmd_check)

    z = sub.add_parser("zoo", parents=[debug], **fmt,
                       help="check every model family (tiny transformers and torchvision "
                       "builds), each in a fresh process; write the table",
                       description="Runs `aotdist check` on every listed model family, each "
                       "in a fresh process, then a few under FSDP2, and writes the table "
                       "(--out). Exit 1 when a family fails or one you named is not built.")
    z.add_argument("--families", type=_csv, default=None, help="default: the listed families; all: also every causal LM of the installed transformers")
    z.add_argument("--source", type=_csv, default=["families"], help="whose models, when "
                   "--families is not given: families (the listed transformers and "
                   "torchvision ones), timm (40+ architectures, stochastic depth on), "
                   "torchtitan (its Llama 3, Qwen 3, Qwen 3 MoE, DeepSeek-V3); several "
                   "comma-separated")
    z.add_argument("--fsdp-families", type=_csv, default=None,
                   help="also checked under FSDP2 (default llama,qwen3_moe,bert)")
    z.add_argument("--fsdp", type=int, default=2, help="ranks for those (1: none)")
    z.add_argument("--backend", default="aot_eager", help="torch.compile backend")
    z.add_argument("--timeout", type=float, default=600.0, help="seconds per family")
    z.add_argument("--memory-limit", type=float, default=None, metavar="GB",
                   help="address space per check process (default: half the physical "
                   "memory; 0: none)")
    z.add_argument("--out", default="zoo-out/models.md", help="the table ('' to skip; "
                   "aotdist's own page: --out docs/models.md)")
    z.set_defaults(func=_cmd_zoo)

    args = parser.parse_args(argv)  # a bad flag: argparse's usage line, exit 2
    global _debug
    _debug = args.debug or os.environ.get(DEBUG_ENV, "0") not in ("", "0")
    if _debug:
        return args.func(args)
    try:
        return args.func(args)
    except Exception as exc:  # noqa: BLE001 - the one error path: one screen, no traceback
        code, text = _screen(exc)
        print(f"aotdist {args.command}: {text}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
