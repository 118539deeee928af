"""The ``aotdist`` command: ``check``, ``zoo``, ``bench``, ``inspect`` and ``plan``.

:mod:`~aotdist.cli.parser` builds the arguments the subcommands share (ranks, FSDP mode,
backend, memory limit, output, timeout), each once, defaults read from the code that runs;
one module per subcommand group adds its own and runs it. One error path
(:mod:`~aotdist.cli.errors`): a user mistake ends in one screen on stderr that says what
is wrong and the fix; exit 2 for usage, 1 for a failed check. ``--debug`` or
``AOTDIST_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys

from aotdist.cli.errors import DEBUG_ENV, screen, set_debug

__all__ = ["DEBUG_ENV", "build_parser", "main"]

_DESCRIPTION = (
    "Compile the repeated regions of PyTorch models once. A mistake is one screen with the "
    f"fix; --debug (or {DEBUG_ENV}=1) shows the traceback. Exit 2: a usage mistake; 1: a "
    "failed check."
)


def build_parser() -> argparse.ArgumentParser:
    """The ``aotdist`` parser with every subcommand."""
    from aotdist.cli import bench, check, inspect, plan
    from aotdist.cli.parser import HelpFormatter
    from aotdist.version import __version__

    parser = argparse.ArgumentParser(
        prog="aotdist", description=_DESCRIPTION, formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"aotdist {__version__}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help=f"on an error, show the traceback (or set {DEBUG_ENV}=1)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check.register(sub)  # check, zoo
    bench.register(sub)
    inspect.register(sub)
    plan.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``aotdist`` console script."""
    from aotdist.cli.parser import resolve_ranks

    args = build_parser().parse_args(argv)  # a bad flag: argparse's usage line, exit 2
    debug = args.debug or os.environ.get(DEBUG_ENV, "0") not in ("", "0")
    set_debug(debug)
    try:
        resolve_ranks(args)
        return args.func(args)
    except Exception as exc:  # noqa: BLE001 - the one error path: one screen, no traceback
        if debug:
            raise
        code, text = screen(exc)
        print(f"aotdist {args.command}: {text}", file=sys.stderr)
        return code
