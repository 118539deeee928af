"""The backend for a ``torch.compile`` backend name or callable, as aotdist uses it.

``inductor`` gets Inductor's own wrapper with aotdist's default options (buffer reuse
off on the torch releases with the reuse bug: see README "Known limits"), scoped to this model's compiles; another name is
checked against the registered backends; a callable is used as it is.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from aotdist import _compat
from aotdist.errors import ConfigError, RegionCompileWarning

__all__ = ["_make_backend", "inductor_buffer_reuse_is_unsafe"]


def inductor_buffer_reuse_is_unsafe() -> bool:
    """Whether this torch has the Inductor buffer-reuse bug that corrupts reused regions.

    With the bug, the outer graph reuses the storage of a region's output, which a later
    reused region's partitioned forward returns as an activation saved for backward, and
    a LayerNorm weight gradient comes out wrong (~70%, TinyGPT, see
    ``tests/unit/test_external_models.py::test_tinygpt_inductor_buffer_reuse_torch_bug``).
    No cheap feature probe exists (showing it takes an Inductor C++ compile), so this is a
    version gate. Checked: torch 2.11.0 (absent: parity holds with buffer reuse on) and
    2.15.0 (present). 2.12-2.14 were not checked and count as affected, the safe side:
    the workaround only costs memory.
    """
    version = torch.torch_version.TorchVersion(torch.__version__)
    return version >= (2, 12)


def _make_backend(backend: str | Callable, mode: str | None, options: dict | None,
                  dynamic: bool | None) -> Callable:
    if backend == "inductor":
        options = dict(options or {})
        if inductor_buffer_reuse_is_unsafe():
            if options.get("allow_buffer_reuse"):
                warnings.warn(
                    f"allow_buffer_reuse=True: with torch {torch.__version__}, Inductor's "
                    "buffer reuse can overwrite an activation a reused region saved for "
                    "backward (wrong gradients, see README 'Known limits'). aotdist turns "
                    "it off by default.",
                    RegionCompileWarning, stacklevel=3,
                )
            # Scoped to this model's compiles: the wrapper applies options as config patches.
            options.setdefault("allow_buffer_reuse", False)
        return _compat.inductor_wrapper(mode, options, dynamic)
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
