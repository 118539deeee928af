"""The arguments ``aotdist`` subcommands share, each built once by one function here.

Ranks (``--nproc``), the FSDP mode (``--fsdp-mode``), the ``torch.compile`` backend, the
memory cap (``--memory-limit``), the output (``--out``), the timeout and Float8 are
spelled and explained the same way in every subcommand. Defaults are read from the
setting the code runs with (a config dataclass's field, the called function's keyword
default) and shown in ``--help``, so help and behaviour cannot drift. An old spelling
stays as a hidden alias that still works and names its new spelling on stderr.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable
from typing import Any

from aotdist.cli.errors import DEBUG_ENV, UsageError


def default_of(fn: Callable[..., Any], name: str) -> Any:
    """The default of ``fn``'s keyword ``name``: what runs when the flag is not given."""
    return inspect.signature(fn).parameters[name].default


def fsdp_modes() -> tuple[str, ...]:
    """The ``fsdp.mode`` values the config accepts, and its default first."""
    from aotdist.config import FSDP_MODES, FSDPConfig

    default = FSDPConfig().mode
    return (default, *(m for m in FSDP_MODES if m != default))


class HelpFormatter(argparse.HelpFormatter):
    """Shows each option's default, where it has one its help does not state already, and
    never wraps a line inside a hyphenated name (``aotdist-graph``)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            default is None
            or default is False
            or default == ""
            or default is argparse.SUPPRESS
            or "default" in text
            or not action.option_strings
        ):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {shown})".strip()


def add_command(sub: Any, name: str, *, summary: str, description: str) -> argparse.ArgumentParser:
    """A subcommand: ``summary`` is its line in ``aotdist --help``, ``description`` its
    ``--help``; it takes ``--debug`` after its name too and shows defaults."""
    parser = sub.add_parser(
        name, help=summary, description=description, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help=f"on an error, show the traceback (or set {DEBUG_ENV}=1)",
    )
    return parser


def csv(text: str) -> list[str]:
    """``a,b`` -> ``["a", "b"]``."""
    return [t.strip() for t in text.split(",") if t.strip()]


def ints(text: str) -> list[int]:
    """``1,2`` -> ``[1, 2]``, each >= 1."""
    try:
        values = [int(t) for t in csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _rank_count(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def mesh(text: str) -> tuple[int, int]:
    """``2x2`` -> ``(2, 2)``: replicas by shards."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"expected REPLICASxSHARDS such as 2x2, got {text!r}")
    return int(parts[0]), int(parts[1])


class _Given(argparse.Action):
    """Stores the value and notes that the user gave it (an alias may not contradict it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


class _OldRanks(argparse.Action):
    """A hidden old spelling of ``--nproc`` (``--fsdp N``): still works, says so."""

    def __call__(self, parser, namespace, values, option_string=None):
        new = "--nproc" if values is None else f"--nproc {values}"
        print(f"{parser.prog}: {option_string} is an old spelling; use {new}", file=sys.stderr)
        namespace.nproc_alias = True if values is None else values


class _OldSpelling(argparse.Action):
    """A hidden old spelling of an option: still works, names the new one on stderr."""

    def __init__(self, *args, new: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: {option_string} is an old spelling; use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_old_spelling(p: argparse.ArgumentParser, old: str, new: str, **kwargs: Any) -> None:
    """``old``, hidden from help, sets what ``new`` sets."""
    dest = new.lstrip("-").replace("-", "_")
    p.add_argument(
        old,
        dest=dest,
        action=_OldSpelling,
        new=new,
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
        **kwargs,
    )


def add_ranks(
    p: argparse.ArgumentParser,
    *,
    default: Any,
    help: str,
    grid: bool = False,
    old: str | None = None,
    old_switch: bool = False,
) -> None:
    """``--nproc``: how many ranks (gloo on CPU, NCCL on CUDA); ``grid``: a comma-separated
    list, one cell per count. ``old`` names a hidden old spelling taking a count (also a
    bare switch with ``old_switch``); :func:`resolve_ranks` settles it after parsing."""
    p.add_argument(
        "--nproc",
        type=ints if grid else _rank_count,
        default=default,
        metavar="N",
        action=_Given,
        help=help,
    )
    if old:
        p.add_argument(
            old,
            type=int,
            default=None,
            dest="nproc_alias",
            nargs="?" if old_switch else None,
            action=_OldRanks,
            help=argparse.SUPPRESS,
        )


def resolve_ranks(args: argparse.Namespace) -> None:
    """Applies an old spelling of the ranks; ``args.nproc_alias`` stays ``True`` where it
    was a bare switch.

    Raises:
        UsageError: The old and the new spelling name different counts.
    """
    old = getattr(args, "nproc_alias", None)
    if old is None or old is True:
        return
    old = args.nproc_alias = max(old, 1)  # the old spelling's 0 meant one rank, no FSDP
    if getattr(args, "nproc_given", False) and args.nproc != old:
        raise UsageError(
            f"--fsdp {old} and --nproc {args.nproc} disagree. Fix: give the "
            f"ranks once, --nproc {old}"
        )
    args.nproc = old


def add_fsdp_mode(p: argparse.ArgumentParser) -> None:
    """``--fsdp-mode``: ``fsdp.mode`` of the sharded run, its default the config's."""
    modes = fsdp_modes()
    p.add_argument(
        "--fsdp-mode",
        default=modes[0],
        choices=modes,
        help="with --nproc > 1 (fsdp.mode): FSDP2 units per region instance "
        "(hooks) or graph-mode FSDP (the collectives inside the compiled graph)",
    )


def add_backend(p: argparse.ArgumentParser, *, default: str, help: str) -> None:
    """``--backend``: the ``torch.compile`` backend."""
    p.add_argument("--backend", default=default, help=help)


def add_memory_limit(p: argparse.ArgumentParser, *, default: float | None = 0.0, help: str) -> None:
    """``--memory-limit GB``: an address-space cap, so that a run too big for the machine
    fails with an error instead of being killed."""
    p.add_argument("--memory-limit", type=float, default=default, metavar="GB", help=help)


def add_out(p: argparse.ArgumentParser, *, default: str | None, help: str) -> None:
    """``--out``: where the command writes what it produced."""
    p.add_argument("--out", default=default, help=help)


def add_timeout(p: argparse.ArgumentParser, *, default: float, help: str) -> None:
    """``--timeout``: seconds before a run is stopped and reported."""
    p.add_argument("--timeout", type=float, default=default, help=help)


def add_float8(p: argparse.ArgumentParser, *, help: str) -> None:
    """``--float8``: torchao Float8 training."""
    p.add_argument("--float8", action="store_true", help=help)
