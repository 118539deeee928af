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

import logging
import warnings

__all__ = ["LOGGER_NAME", "get_logger", "rank_zero_warn"]

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


def _rank() -> int | None:
    """This process's rank in the default process group; ``None`` without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return None


def rank_zero_warn(message: str, category: type[Warning] = UserWarning, *,
                   stacklevel: int = 2) -> None:
    """Warns once per job: on rank 0 when distributed, else in this process.

    Args:
        message: The warning text.
        category: The warning class (``RegionCompileWarning``, ``ConfigWarning``...).
        stacklevel: As for :func:`warnings.warn`, counted from the caller of this function.
    """
    rank = _rank()
    if rank is None or rank == 0:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
        return
    get_logger().debug("rank %d: %s (warned on rank 0): %s", rank, category.__name__, message)
