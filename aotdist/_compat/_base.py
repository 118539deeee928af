"""What every accessor of :mod:`aotdist._compat` shares: the versions checked, the error."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from aotdist.errors import TorchFeatureUnavailable

# The torch versions CI runs (.ci/run: 2.11.0 and 2.14.1); an accessor names the ones it
# was checked on with :func:`checked_on`. pyproject.toml admits <2.16, but 2.15 cannot be
# installed on the CI machines, so it is not listed.
CHECKED_ON = ("2.11", "2.14")

T = TypeVar("T")


def checked_on(*versions: str, note: str = "") -> Callable[[T], T]:
    """Records on an accessor the torch versions it was checked on (each one of
    :data:`CHECKED_ON`), with an optional ``note`` (what differs between them), as its
    ``__aotdist_checked_on__`` attribute: ``(versions, note)``.

    Returns the decorated object itself, not a wrapper, so it goes outermost, above
    ``contextlib.contextmanager`` or ``functools.cache``, and changes nothing that
    calls, traces or inspects the accessor.

    Raises:
        ValueError: No version, or one not in :data:`CHECKED_ON`.
    """
    if not versions or any(v not in CHECKED_ON for v in versions):
        raise ValueError(
            f"checked_on({', '.join(map(repr, versions))}): name one or more of the torch "
            f"versions CI runs, {', '.join(CHECKED_ON)}"
        )

    def record(obj: T) -> T:
        obj.__aotdist_checked_on__ = (tuple(versions), note)
        return obj

    return record


def unavailable(what: str, exc: BaseException | None = None) -> TorchFeatureUnavailable:
    why = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
    return TorchFeatureUnavailable(
        f"{what} is not available in torch {torch.__version__}{why}; aotdist was checked on "
        f"torch {' and '.join(CHECKED_ON)}. Fix: install a torch in that range."
    )


def attr(module: str, name: str) -> Any | None:
    """``module.name`` if both exist, else ``None``."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
