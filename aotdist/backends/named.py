"""The backend for a ``torch.compile`` backend name or callable, as aotdist uses it.

``inductor`` gets Inductor's own wrapper with aotdist's default options (on the torch
releases with the buffer-reuse bug, a post-grad pass that makes reuse safe: see
:mod:`aotdist.backends.reuse`), scoped to this model's compiles; another name is
checked against the registered backends; a callable is used as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from aotdist import _compat
from aotdist.backends.reuse import is_reuse_pass, reuse_pass
from aotdist.errors import ConfigError, RegionCompileWarning
from aotdist.log import rank_zero_warn

__all__ = ["_make_backend", "inductor_buffer_reuse_is_unsafe", "inductor_options"]


def inductor_buffer_reuse_is_unsafe() -> bool:
    """Whether this torch has the Inductor buffer-reuse bug that corrupts reused regions.

    With the bug, the outer graph reuses the storage of a region's output, which a later
    reused region's partitioned forward returns as an activation saved for backward, and
    a LayerNorm weight gradient comes out wrong (~70%, TinyGPT, see
    ``tests/unit/test_external_models.py::test_tinygpt_inductor_buffer_reuse_torch_bug``).
    No cheap feature probe exists (showing it takes an Inductor C++ compile). Seen on torch
    2.15.0 (single-process TinyGPT) and on 2.11.0 once graph-mode regions
    became reused subgraphs there (2 gloo ranks, Inductor: loss off by 7.5e-4 after 4
    steps with reuse on, equal to eager with reuse off or with this pass). Single-process
    TinyGPT on 2.11 did not show it. So every supported torch counts as affected: the
    pass only rewrites graphs that have the pattern.
    """
    return True


_REUSE_PASS_ON = [True]


@contextlib.contextmanager
def _without_reuse_pass() -> Iterator[None]:
    """Backends made inside leave out aotdist's buffer-reuse pass (to reproduce the torch
    bug in tests)."""
    _REUSE_PASS_ON.append(False)
    try:
        yield
    finally:
        _REUSE_PASS_ON.pop()


def inductor_options(options: dict | None = None, *, warn: bool = True) -> dict:
    """The Inductor options (config patches) of every aotdist compile: ``options`` plus,
    on a torch with the buffer-reuse bug, aotdist's post-grad pass
    (:mod:`aotdist.backends.reuse`), which makes buffer reuse safe, so reuse stays on
    unless ``options`` turns it off.

    The one place that decides them: :func:`aotdist.compile_regions` (through
    ``_make_backend``), ``aotdist.capture(..., backend="inductor")`` (through
    :func:`aotdist.backends.aot.aot_backend`, which passes options already completed
    here: completing them again changes nothing), and so the cache and the bench's aotdist
    strategy, which compile through those. ``warn``: warn when buffer reuse is on without
    aotdist's pass.

    A ``post_grad_custom_post_pass`` of the user (in ``options`` or Inductor's config)
    runs first, chained with aotdist's.

    Raises:
        ConfigError: A user post-grad pass is set and this torch takes one pass only.
    """
    options = dict(options or {})
    if not inductor_buffer_reuse_is_unsafe():
        return options
    reuse = options.setdefault("allow_buffer_reuse", _compat.inductor_buffer_reuse_default())
    if not reuse:
        return options
    if not _REUSE_PASS_ON[-1]:
        if warn:
            rank_zero_warn(
                f"allow_buffer_reuse=True without aotdist's pass: with torch "
                f"{torch.__version__}, Inductor's buffer reuse can overwrite an activation a "
                "reused region saved for backward (wrong gradients, see README 'Known "
                "limits').",
                RegionCompileWarning, stacklevel=4,
            )
        return options
    user = options.get("post_grad_custom_post_pass", _compat.inductor_post_grad_post_pass())
    users = list(user) if isinstance(user, (list, tuple)) else [] if user is None else [user]
    if any(is_reuse_pass(p) for p in users):  # completed here already
        return options
    if users and not _compat.inductor_takes_pass_lists():
        raise ConfigError(
            f"post_grad_custom_post_pass={user!r}: with torch {torch.__version__} Inductor "
            "takes one post-grad pass and aotdist needs that slot for its buffer-reuse "
            "pass. Fix: pass options={'allow_buffer_reuse': False} to keep your pass."
        )
    options["post_grad_custom_post_pass"] = [*users, reuse_pass()] if users else reuse_pass()
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
