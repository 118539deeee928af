"""The backend for a ``torch.compile`` backend name or callable, as aotdist uses it.

``inductor`` gets Inductor's own wrapper with aotdist's default options (a post-grad
pass that makes Inductor's buffer reuse safe around reused regions: see
:mod:`aotdist.backends.buffer_reuse`), scoped to this model's compiles; another name is
checked against the registered backends; a callable is used as it is.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

from aotdist import _compat
from aotdist.backends.buffer_reuse import is_reuse_pass, reuse_pass
from aotdist.errors import ConfigError, ConfigWarning, RegionCompileWarning
from aotdist.log import rank_zero_warn
from aotdist.version import __version__

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


_SCHEDULER = "aten_distributed_optimizations.enable_overlap_scheduling"
_PRE_BUCKETING = "aten_distributed_optimizations.pre_bucketing_fsdp_collectives"


def overlap_options() -> dict:
    """Inductor's compute/communication overlap keys, probed on this torch's config.

    The overlap scheduler (``aten_distributed_optimizations.enable_overlap_scheduling``,
    an FX pass that reorders collectives against compute; torch 2.11 and 2.14 have it)
    where the key exists, with its FSDP pre-bucketing off where this torch has that key
    (with it, two CPU ranks issued all-gathers of different sizes); otherwise the older
    scheduler-level reordering torchtitan's SimpleFSDP used
    (``reorder_for_compute_comm_overlap`` with its ``sink_waits_iterative`` /
    ``reorder_communication_preserving_peak_memory`` passes).

    Raises:
        ConfigError: This torch's Inductor has neither.
    """
    keys = _compat.inductor_config_keys()
    if _SCHEDULER in keys:
        return {_SCHEDULER: True, **{k: False for k in (_PRE_BUCKETING,) if k in keys}}
    if "reorder_for_compute_comm_overlap" in keys:
        return {
            "reorder_for_compute_comm_overlap": True,
            "reorder_for_compute_comm_overlap_passes": [
                "sink_waits_iterative",
                "reorder_communication_preserving_peak_memory",
            ],
        }
    raise ConfigError(
        f"fsdp.overlap: torch {torch.__version__}'s Inductor has no compute/communication "
        "overlap keys (aten_distributed_optimizations.enable_overlap_scheduling, "
        "reorder_for_compute_comm_overlap). Fix: set fsdp.overlap: false."
    )


def _passes(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [] if value is None else [value]


def _add_collective_options(options: dict, bucket_mb: float | None, overlap: bool) -> list:
    """Adds the overlap keys to ``options``; returns the bucketing pass to install (or
    nothing: off, or installed already)."""
    from aotdist.backends.bucketing import bucketing_pass, is_bucketing_pass

    if overlap:
        keys = overlap_options()
        for key, value in keys.items():
            options.setdefault(key, value)
        if _SCHEDULER in keys and bucket_mb:
            # torch's overlap scheduler reorders each post-grad graph after the custom
            # post-grad pass, and aotdist's bucketing pass leaves mutating collectives
            # there (all-gathers into one flat buffer) that the scheduler moves past their
            # readers: wrong losses (NaN on 2 gloo ranks, 30x off on one H100 rank).
            rank_zero_warn(
                f"fsdp.overlap: torch's overlap scheduler reorders the merged collectives "
                f"of fsdp.bucket_mb ({bucket_mb:g} MiB) wrongly (wrong losses), so this run "
                "gathers and reduce-scatters each parameter on its own, unbucketed. Fix: "
                "set fsdp.bucket_mb: null to keep overlap and silence this, or "
                "fsdp.overlap: false to keep the buckets.",
                ConfigWarning,
                stacklevel=5,
            )
            return []
    if not bucket_mb or _installed(options, is_bucketing_pass):
        return []
    return [bucketing_pass(bucket_mb)]


@functools.cache
def _chain_class() -> type:
    class ChainedPasses(_compat.custom_graph_pass_base()):
        """Several passes in one of the single-pass slots (post-grad, joint) of torch 2.11's
        Inductor."""

        def __init__(self, passes: list) -> None:
            self.passes = list(passes)

        def __call__(self, graph: torch.fx.Graph) -> None:
            for p in self.passes:
                p(graph)

        def uuid(self) -> str:
            return "aotdist.chain:" + ",".join(str(p.uuid()) for p in self.passes)

    return ChainedPasses


def _is_chain(p) -> bool:
    return isinstance(p, _chain_class())


def _is_ours(p) -> bool:
    from aotdist.backends.bucketing import is_bucketing_pass

    return is_reuse_pass(p) or is_bucketing_pass(p)


def _installed(options: dict, is_pass: Callable) -> bool:
    for p in _passes(options.get("post_grad_custom_post_pass")):
        if is_pass(p) or (_is_chain(p) and any(is_pass(q) for q in p.passes)):
            return True
    return False


def _install(options: dict, ours: list, why: str) -> None:
    """Chains ``ours`` after the user's post-grad pass(es) (a list where Inductor takes
    one, else one chained pass).

    Raises:
        ConfigError: The user set a pass and this torch takes one post-grad pass only.
    """
    if not ours:
        return
    user = options.get("post_grad_custom_post_pass", _compat.inductor_post_grad_post_pass())
    users = _passes(user)
    if users and _compat.inductor_takes_pass_lists():
        options["post_grad_custom_post_pass"] = [*users, *ours]
        return
    mine = [p for u in users for p in (u.passes if _is_chain(u) else [u]) if _is_ours(p)]
    if users and len(mine) != sum(len(u.passes) if _is_chain(u) else 1 for u in users):
        raise ConfigError(
            f"post_grad_custom_post_pass={user!r}: with torch {torch.__version__} Inductor "
            f"takes one post-grad pass and aotdist needs that slot for {why}."
        )
    ours = [*mine, *ours]
    options["post_grad_custom_post_pass"] = ours[0] if len(ours) == 1 else _chain_class()(ours)


def add_joint_pass(options: dict, new, slot: str = "joint_custom_pre_pass") -> None:
    """Appends ``new`` (a ``CustomGraphPass``) to the ``slot`` of ``options``
    (``joint_custom_pre_pass``, or ``joint_custom_post_pass``: after Inductor's own joint
    passes), after what is there (Inductor's config value where ``options`` has none):
    a list where this torch takes one, else one chained pass. A pass with ``new``'s uuid
    already there is not added again. On a torch whose slot takes one pass, a user's pass
    that is not a ``CustomGraphPass`` cannot be chained (no uuid for the compile cache): it
    keeps the slot and ``new`` is left out, with a warning.
    """
    current = (
        _compat.inductor_joint_pre_pass()
        if slot == "joint_custom_pre_pass"
        else _compat.inductor_joint_post_pass()
    )
    user = options.get(slot, current)
    users = _passes(user)
    flat = [p for u in users for p in (u.passes if _is_chain(u) else [u])]
    uuids = [p.uuid() for p in flat if callable(getattr(p, "uuid", None))]
    if new.uuid() in uuids:
        return
    if _compat.inductor_takes_pass_lists():
        options[slot] = [*users, new]
    elif len(uuids) < len(flat):
        rank_zero_warn(
            f"{slot}={user!r} is not a CustomGraphPass, and torch "
            f"{torch.__version__}'s Inductor takes one joint pass: aotdist's pass "
            f"{new.uuid()!r} is left out. Fix: make your pass a "
            "torch._inductor.custom_graph_pass.CustomGraphPass (with a uuid).",
            ConfigWarning,
            stacklevel=4,
        )
    else:
        passes = [*flat, new]
        options[slot] = passes[0] if len(passes) == 1 else _chain_class()(passes)


def inductor_options(
    options: dict | None = None,
    *,
    warn: bool = True,
    bucket_mb: float | None = None,
    overlap: bool = False,
) -> dict:
    """The Inductor options (config patches) of every aotdist compile: ``options`` plus
    aotdist's post-grad pass (:mod:`aotdist.backends.buffer_reuse`), which makes buffer reuse
    safe, so reuse stays on unless ``options`` turns it off; Inductor's layout optimization
    (channels-last convolutions) off unless ``options`` turns it on.

    The one place that decides them: :func:`aotdist.compile_regions` (through
    ``make_backend``), ``aotdist.capture(..., backend="inductor")`` (through
    :func:`aotdist.backends.aot.aot_backend`, which passes options already completed
    here: completing them again changes nothing), graph-mode FSDP (through
    :func:`graph_fsdp_backend`), and so the cache and the bench's aotdist strategies,
    which compile through those. ``warn``: warn when buffer reuse is on without
    aotdist's pass.

    A ``post_grad_custom_post_pass`` of the user (in ``options`` or Inductor's config)
    runs first, chained with aotdist's.

    Args:
        options: The user's Inductor options.
        warn: Warn when buffer reuse is on without aotdist's pass.
        bucket_mb: Graph-mode FSDP (``fsdp.bucket_mb``): add aotdist's post-grad pass that
            merges each graph's all-gathers / reduce-scatters into buckets of at most this
            many MiB (:mod:`aotdist.backends.bucketing`); ``None`` or ``0``: none.
        overlap: Graph-mode FSDP (``fsdp.overlap``): add Inductor's compute/communication
            overlap keys (:func:`overlap_options`); a key ``options`` sets wins.

    Raises:
        ConfigError: A user post-grad pass is set and this torch takes one pass only; or
            ``overlap`` on a torch without the overlap keys.
    """
    from aotdist.backends.recompute import boundaries_pass, recompute_pass

    options = dict(options or {})
    # Off unless the user sets it: with it, Inductor may save a convolution's output of the
    # whole-model graph for backward channels-last while the reused region that takes it was
    # compiled for contiguous inputs (torch 2.11-2.14: an InductorError or a stride assert in
    # the first backward; docs/guide/limits.md).
    options.setdefault("layout_optimization", False)
    add_joint_pass(options, recompute_pass())  # masks recomputed, not saved per call site
    # checkpointed regions recomputed one at a time (after Inductor's joint passes, which
    # would remove the copies it adds)
    add_joint_pass(options, boundaries_pass(), slot="joint_custom_post_pass")
    bucketing = _add_collective_options(options, bucket_mb, overlap)
    _install(
        options, bucketing, "its bucketing pass. Fix: set fsdp.bucket_mb: null to keep your pass"
    )
    reuse = options.setdefault("allow_buffer_reuse", _compat.inductor_buffer_reuse_default())
    if not reuse:
        return options
    if not _REUSE_PASS_ON[-1]:
        if warn:
            rank_zero_warn(
                f"allow_buffer_reuse=True without aotdist's pass: with torch "
                f"{torch.__version__}, Inductor's buffer reuse can overwrite an activation a "
                "reused region saved for backward (wrong gradients, see "
                "docs/guide/limits.md).",
                RegionCompileWarning,
                stacklevel=4,
            )
        return options
    if not _installed(options, is_reuse_pass):  # else: completed here already
        _install(
            options,
            [reuse_pass()],
            "its buffer-reuse pass. Fix: pass "
            "options={'allow_buffer_reuse': False} to keep your pass",
        )
    return options


def graph_fsdp_backend(
    backend: str | Callable,
    options: dict | None,
    *,
    bucket_mb: float | None,
    overlap: bool,
    device_type: str,
) -> tuple[str | Callable, dict | None]:
    """The ``(backend, options)`` graph-mode FSDP compiles with (``fsdp.bucket_mb``,
    ``fsdp.overlap``).

    - ``inductor``: the options completed by :func:`inductor_options` with the bucketing
      pass and, on CUDA, the overlap keys (scoped, as all of aotdist's Inductor options).
    - ``aot_eager`` without options: :func:`aotdist.backends.bucketing.bucketing_aot_eager`.
    - Anything else is returned as it is (no AOT graphs aotdist can bucket).

    ``overlap`` where it cannot apply (not CUDA, not Inductor) warns and is left out.

    Raises:
        ConfigError: As :func:`inductor_options`.
    """
    if overlap and (backend != "inductor" or device_type != "cuda"):
        rank_zero_warn(
            f"fsdp.overlap: Inductor's compute/communication overlap applies to the inductor "
            f"backend on CUDA; this run compiles with {backend!r} on {device_type!r}, so it "
            "has no effect (left off). Fix: drop fsdp.overlap, or use compile.backend: "
            "inductor on CUDA devices.",
            ConfigWarning,
            stacklevel=4,
        )
        overlap = False
    if backend == "inductor":
        # the gathers are autograd.Functions, which AOTAutograd would not cache: every warm
        # start and every rank sharing rank 0's compiles would trace and partition again
        return backend, {
            **_compat.cacheable_autograd_functions(f"aotdist {__version__}"),
            **inductor_options(options, bucket_mb=bucket_mb, overlap=overlap),
        }
    if backend == "aot_eager" and bucket_mb and not options:
        from aotdist.backends.bucketing import bucketing_aot_eager

        return bucketing_aot_eager(bucket_mb), None
    return backend, options


def make_backend(
    backend: str | Callable, mode: str | None, options: dict | None, dynamic: bool | None
) -> Callable:
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
