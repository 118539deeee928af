"""The backend for a ``torch.compile`` backend name or callable, as aotdist uses it.

``inductor`` gets Inductor's own wrapper with aotdist's default options (buffer reuse
off: see README "Known limits"), scoped to this model's compiles; another name is
checked against the registered backends; a callable is used as it is.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from aotdist import _compat
from aotdist.errors import ConfigError, RegionCompileWarning

__all__ = ["_make_backend", "inductor_options"]


def inductor_options(options: dict | None = None, *, warn: bool = True) -> dict:
    """The Inductor options (config patches) of every aotdist compile: ``options`` with
    aotdist's defaults filled in.

    The one place that decides them: :func:`aotdist.compile_regions` (through
    ``_make_backend``), ``aotdist.capture(..., backend="inductor")`` (through
    :func:`aotdist.backends.aot.aot_backend`), and so the cache and the bench's aotdist
    strategy, which compile through those.

    Default: ``allow_buffer_reuse=False`` (Inductor's buffer reuse can overwrite an
    activation a reused region saved for backward; see README "Known limits").

    Args:
        options: The user's options; their values win over the defaults.
        warn: Warn when the user turns buffer reuse back on.

    Returns:
        A new dict.
    """
    options = dict(options or {})
    if warn and options.get("allow_buffer_reuse"):
        warnings.warn(
            "allow_buffer_reuse=True: with torch 2.15, Inductor's buffer reuse can "
            "overwrite an activation a reused region saved for backward (wrong "
            "gradients, see README 'Known limits'). aotdist turns it off by default.",
            RegionCompileWarning, stacklevel=4,
        )
    options.setdefault("allow_buffer_reuse", False)
    return options


def _make_backend(backend: str | Callable, mode: str | None, options: dict | None,
                  dynamic: bool | None) -> Callable:
    if backend == "inductor":
        # Scoped to this model's compiles: the wrapper applies options as config patches.
        return _compat.inductor_wrapper(mode, inductor_options(options), dynamic)
    if callable(backend) and not isinstance(backend, str):
        if mode is not None or options:
            raise ConfigError(
                "mode and options apply to named backends only; got a callable backend "
                f"{backend!r} with mode={mode!r}, options={options!r}. Fix: configure the "
                "callable yourself, or pass backend='inductor'."
            )
        return backend
    if not isinstance(backend, str):
        raise ConfigError(f"backend must be a name or a callable; got {backend!r}")
    if backend not in torch.compiler.list_backends(exclude_tags=()):
        raise ConfigError(
            f"unknown compile backend {backend!r}; available: "
            f"{sorted(torch.compiler.list_backends(exclude_tags=()))}"
        )
    return _compat.named_backend_wrapper(backend, mode, options, dynamic)
