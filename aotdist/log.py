"""aotdist's package logger and once-per-job warnings.

* Progress messages go to the ``aotdist`` logger and its per-module children
  (``logging.getLogger(__name__)`` in each module: ``aotdist.parallelize``,
  ``aotdist.cache.store``...). aotdist adds no handler; configure ``logging`` to see them,
  e.g. ``logging.getLogger("aotdist").setLevel(logging.INFO)`` with a root handler.
* User-facing warnings that every rank would emit alike (a region demoted, a config option
  without effect) go through :func:`rank_zero_warn`: with ``torch.distributed`` initialized only
  rank 0 warns, as Lightning's ``rank_zero_warn`` does, and the other ranks log the same
  message at ``DEBUG`` on the ``aotdist`` logger, so nothing is lost. Without a process
  group every process warns. A warning about one rank's own state (its cache file, its
  share of rank 0's compiles) stays a plain :func:`warnings.warn` on that rank.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import sysconfig
import warnings

__all__ = [
    "LOGGER_NAME",
    "get_logger",
    "is_user_file",
    "rank_zero_info",
    "rank_zero_warn",
    "user_stacklevel",
]

LOGGER_NAME = "aotdist"


def get_logger(name: str | None = None) -> logging.Logger:
    """The ``aotdist`` logger, or its child ``name`` (a module's ``__name__``).

    Args:
        name: ``None`` for the package logger, ``"aotdist.x.y"`` or ``"x.y"`` for a child.

    Returns:
        ``logging.getLogger("aotdist")`` or ``logging.getLogger("aotdist.x.y")``.
    """
    if not name or name == LOGGER_NAME:
        return logging.getLogger(LOGGER_NAME)
    if not name.startswith(LOGGER_NAME + "."):
        name = f"{LOGGER_NAME}.{name}"
    return logging.getLogger(name)


def rank_zero_info(logger: logging.Logger, message: str, *args) -> None:
    """``logger.info`` on rank 0 (or without a process group), DEBUG on the other ranks."""
    logger.log(logging.INFO if _rank() in (None, 0) else logging.DEBUG, message, *args)


def _rank() -> int | None:
    """This process's rank in the default process group; ``None`` without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


@functools.cache
def _internal_prefixes() -> tuple[str, ...]:
    """Directories whose frames are never the user's line: aotdist (and its callbacks),
    the standard library and installed packages (torch, Lightning, Accelerate...)."""
    import aotdist

    dirs = {
        os.path.dirname(os.path.abspath(aotdist.__file__)),
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep + "callbacks",
    }
    dirs |= {os.path.abspath(sysconfig.get_paths()[k]) for k in ("stdlib", "purelib", "platlib")}
    # packages found outside this environment's own: a venv with --system-site-packages,
    # a .pth file naming another environment's site-packages, a user site
    dirs |= {
        os.path.abspath(p)
        for p in sys.path
        if os.path.basename(os.path.normpath(p)) in ("site-packages", "dist-packages")
    }
    return tuple(d + os.sep for d in dirs)


def is_user_file(filename: str) -> bool:
    """Whether ``filename`` is the user's code: not aotdist's, not the standard library's or
    an installed package's, not generated (``<string>``)."""
    return not (
        filename.startswith("<") or os.path.abspath(filename).startswith(_internal_prefixes())
    )


def user_stacklevel(default: int) -> int:
    """The ``stacklevel``, for a :func:`warnings.warn` in the caller of this function, of the
    innermost frame outside aotdist and the installed libraries: the user's line (through
    ``parallelize``'s keyword-only wrapper, hooks and compiled calls alike), so a filter on
    the user's module and the warning's file name work. ``default`` when there is none.

    Args:
        default: The ``stacklevel`` to use when every frame is aotdist's or a library's.
    """
    frame, level = sys._getframe(2), 2  # level 1 is the caller's own frame
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            return level
        frame, level = frame.f_back, level + 1
    return default


def rank_zero_warn(
    message: str, category: type[Warning] = UserWarning, *, stacklevel: int = 2
) -> None:
    """Warns once per job: on rank 0 when distributed, else in this process. The warning
    names the user's line: the innermost frame outside aotdist and the installed libraries.

    Args:
        message: The warning text.
        category: The warning class (``RegionCompileWarning``, ``ConfigWarning``...).
        stacklevel: As for :func:`warnings.warn`, counted from the caller of this function;
            used only when every frame on the stack is aotdist's or a library's.
    """
    rank = _rank()
    if rank is None or rank == 0:
        warnings.warn(message, category, stacklevel=user_stacklevel(stacklevel + 1))
        return
    get_logger().debug("rank %d: %s (warned on rank 0): %s", rank, category.__name__, message)
