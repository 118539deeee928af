"""What every accessor of :mod:`aotdist._compat` shares: the versions checked, the error."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from aotdist.errors import TorchFeatureUnavailable

__all__ = ["CHECKED_ON"]

CHECKED_ON = ("2.11", "2.15")


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
