"""Optional dependencies: imported where used, with an error naming the extra to install.

The core needs torch (and pyyaml). Lightning, Accelerate, torchao, torchvision and
matplotlib are extras of the ``aotdist`` distribution (``pyproject.toml``); every place
that needs one imports it through :func:`require`, so a missing one says which extra
installs it instead of a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from aotdist.errors import MissingDependencyError

# top-level module -> the extra that installs it
EXTRAS = {
    "accelerate": "accelerate",
    "diffusers": "zoo",
    "jsonargparse": "lightning",
    "lightning": "lightning",
    "matplotlib": "bench",
    "torchao": "float8",
    "torchvision": "bench",
    "transformers": "hf",
    "trl": "trl",
}


def require(module: str, *, feature: str) -> ModuleType:
    """Imports ``module``, or raises an error naming the ``aotdist[...]`` extra to install.

    Args:
        module: A dotted module name whose top-level package is one of :data:`EXTRAS`.
        feature: What needs it, for the message (``"float8.enabled"``...).

    Returns:
        The imported module.

    Raises:
        MissingDependencyError: The package (or a module of it) cannot be imported.
    """
    top = module.split(".")[0]
    extra = EXTRAS[top]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"{feature} needs {top}, which cannot be imported ({type(exc).__name__}: {exc}). "
            f"Fix: pip install 'aotdist[{extra}]'.",
            extra=extra,
        ) from exc
