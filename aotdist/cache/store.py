"""Loading and saving a model's bundle: the invalidation key, ``load`` and ``save``.

* :func:`load` (``parallelize`` calls it, before the first compile) reads the bundle,
  checks key and checksum, writes its kernel files into Inductor's cache directory and
  hot-loads the Mega-Cache. Any problem is a ``CacheWarning`` and a normal compile.
* :func:`save` (after the first training step, when the backward is compiled too; the
  callbacks call it) writes the bundle atomically.
* ``shared`` mode: rank 0 reads the bundle and broadcasts it; rank 0 alone saves; in a
  cold run :class:`~aotdist.cache.share.CompileSharing` serves rank 0's compiles.
* A bundle is code: one that others could have written (``bundle.check_safe``) is not read.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import time
import warnings
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from aotdist._compat.enums import StrEnum
from aotdist.cache import precompile
from aotdist.cache.artifacts import ENTRY_PREFIX, install, pack
from aotdist.cache.bundle import FORMAT, check_safe, decode, write_atomic
from aotdist.cache.examples import eval_pending, record, release_examples, watches_eval
from aotdist.cache.share import CompileSharing
from aotdist.compile.collector import collector_paused
from aotdist.compile.state import INFO_ATTR
from aotdist.compile.state import STATE_ATTR as REGION_STATE_ATTR
from aotdist.config import AOTDistConfig, CacheConfig
from aotdist.errors import CacheWarning
from aotdist.log import get_logger, rank_zero_warn
from aotdist.regions import RegionPlan
from aotdist.version import __version__

_log = get_logger(__name__)

STATE_ATTR = "_aotdist_cache"


class CacheStatus(StrEnum):
    """What ``aotdist.cache.load`` did with a bundle.

    Attributes:
        OFF: ``cache.mode: off``.
        MISSING: No bundle yet (the first run); this run compiles and saves one.
        LOADED: The bundle was loaded.
        STALE: Made for another setup (key mismatch); ignored.
        CORRUPT: Unreadable or failed to install; ignored.
        UNSAFE: The file or its directory is not this user's or is writable by others
            (a bundle is code); not read, and the reason names the fix.
    """

    OFF = "off"
    MISSING = "missing"
    LOADED = "loaded"
    STALE = "stale"
    CORRUPT = "corrupt"
    UNSAFE = "unsafe"


@dataclass(frozen=True)
class CacheLoad:
    """What :func:`load` did.

    Attributes:
        status: A :class:`~aotdist.cache.store.CacheStatus`: ``off``, ``missing`` (no bundle
            yet), ``loaded``, ``stale`` (key mismatch), ``corrupt`` or ``unsafe`` (others
            could have written it).
        reason: Why it was not loaded, empty when it was.
        path: The bundle file.
        artifacts: Mega-Cache entries loaded, by kind (``inductor``, ``aot_autograd``).
        kernel_files: Compiled kernel files written into Inductor's cache directory.
        precompiled: The bundle's whole-model graph was loaded: the model runs it without
            tracing (:mod:`aotdist.cache.precompile`).
        precompile_reason: Why not, when it was not; with no bundle loaded, why this run
            will save none (empty: it will).
        refresh: The bundle's saved graph could not be used (its model's source changed):
            this run saves the bundle again after its first step.
    """

    status: CacheStatus
    reason: str = ""
    path: str = ""
    artifacts: dict | None = None
    kernel_files: int = 0
    precompiled: bool = False
    precompile_reason: str = ""
    refresh: bool = False


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _bundle_path(cfg: CacheConfig, rank: int, world: int) -> str:
    name = "artifacts.aotc" if cfg.mode == "shared" or world == 1 else f"artifacts.rank{rank}.aotc"
    return os.path.join(cfg.dir, name)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_key(
    model: nn.Module,
    config: AOTDistConfig,
    *,
    plan: RegionPlan | None = None,
    device: str | None = None,
) -> dict:
    """The invalidation key stored with a bundle: versions, model structure, config, device.

    Args:
        model: The parallelized model (region plan signatures, parameter shapes and dtypes).
        config: Its config; the ``cache`` section itself is left out.
        plan: Its region plan; default: the plan ``aotdist.parallelize`` recorded.
        device: Device type; default: that of the model's first parameter.
    """
    if plan is None:  # the plan aotdist.parallelize recorded, if any
        plan = getattr(vars(model).get(INFO_ATTR), "plan", None)
    plan = [(r.name, r.signature, len(r.fqns)) for r in plan] if plan is not None else []
    params = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    first = next(model.parameters(), None)
    cfg = {k: v for k, v in config.to_dict().items() if k != "cache"}
    return {
        "format": FORMAT,
        "torch": torch.__version__,
        "aotdist": __version__,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "device": device or (first.device.type if first is not None else "cpu"),
        "model": _digest([type(model).__qualname__, plan, params]),
        "config": _digest(cfg),
    }


def _diff(stored: dict, key: dict) -> str:
    return ", ".join(
        f"{k} {stored.get(k)!r} -> {v!r}" for k, v in key.items() if stored.get(k) != v
    )


def _use(
    data: bytes | None, key: dict, path: str, model: nn.Module, config: AOTDistConfig
) -> CacheLoad:
    if data is None:
        return CacheLoad(
            CacheStatus.MISSING, "no bundle yet; this run compiles and saves one", path
        )
    try:
        header, mega, kernels = decode(data)
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        return CacheLoad(CacheStatus.CORRUPT, f"corrupt bundle: {exc}", path)
    if header.get("key") != key:
        return CacheLoad(
            CacheStatus.STALE, f"made for another setup ({_diff(header.get('key', {}), key)})", path
        )
    artifacts = install(mega, kernels)
    loaded, why, refresh = precompile.attach(model, config, kernels)
    files = sum(1 for p in kernels if not p.startswith(ENTRY_PREFIX))
    return CacheLoad(CacheStatus.LOADED, "", path, artifacts, files, loaded, why, refresh)


def load(
    model: nn.Module,
    config: AOTDistConfig,
    *,
    plan: RegionPlan | None = None,
    device: str | None = None,
) -> CacheLoad:
    """Loads the bundle for ``model`` before its first compile (``parallelize`` calls this).

    In ``shared`` mode every rank must call it (rank 0 broadcasts the bundle); there it
    also starts sharing rank 0's compiles with the other ranks until :func:`save`.

    Args:
        model: The parallelized, not yet run model.
        config: Its config; ``config.cache`` says where and how.
        plan: Its region plan (part of the key); default: the one ``parallelize`` recorded.
        device: Device type for the key; default: the model's.

    Returns:
        What happened; a bundle not used was reported with a :class:`CacheWarning`
        (``missing`` is not warned about: the first run has none).
    """
    cfg = config.cache
    if cfg.mode == "off":
        return CacheLoad(CacheStatus.OFF)
    start = time.perf_counter()
    rank, world = _rank_world()
    key = cache_key(model, config, plan=plan, device=device)
    path = _bundle_path(cfg, rank, world)
    data, unsafe = None, None
    if cfg.mode == "local" or rank == 0:
        try:
            unsafe = check_safe(path)  # before reading: an unsafe bundle is never decoded
            if unsafe is None:
                with open(path, "rb") as fh:
                    data = fh.read()
        except FileNotFoundError:
            pass
        except OSError as exc:
            warnings.warn(
                f"aotdist cache: cannot read {path} on rank {rank} ({exc}); compiling normally.",
                CacheWarning,
                stacklevel=2,
            )
    if cfg.mode == "shared" and world > 1:
        # every rank joins, whatever rank 0 found: rank 0's verdict travels with the bytes
        box = [data, unsafe]
        dist.broadcast_object_list(box, src=0)
        data, unsafe = box
    if unsafe is not None:
        result = CacheLoad(CacheStatus.UNSAFE, f"others could have written it: {unsafe}", path)
    else:
        try:
            with collector_paused():
                result = _use(data, key, path, model, config)
        except Exception as exc:  # a failure installing must never stop the job
            result = CacheLoad(
                CacheStatus.CORRUPT, f"could not install it: {type(exc).__name__}: {exc}", path
            )
    if result.status in (CacheStatus.STALE, CacheStatus.CORRUPT, CacheStatus.UNSAFE):
        # shared mode: every rank judged rank 0's bundle alike, so rank 0 alone warns;
        # local mode: each rank read its own file, so each rank says what it found
        warn = rank_zero_warn if cfg.mode == "shared" else warnings.warn
        then = (
            "this run saves its own after the first step"
            if result.status == CacheStatus.UNSAFE
            else "the bundle is replaced after the first step"
        )
        warn(
            f"aotdist cache: ignoring {path} on rank {rank}: {result.reason}; "
            f"compiling normally ({then}).",
            CacheWarning,
            stacklevel=2,
        )
    _log.info("cache %s on rank %d: %s %s", cfg.mode, rank, result.status, path)
    sharing = None
    if cfg.mode == "shared" and world > 1 and result.status != CacheStatus.LOADED:
        sharing = CompileSharing(rank=rank, timeout_s=cfg.share_timeout_s)
        sharing.start()
    why_not = precompile.unavailable_reason(model, config)
    if result.status != CacheStatus.LOADED:  # this run saves a bundle: with a graph?
        result = replace(result, precompile_reason=why_not or "")
    if (region_state := vars(model).get(REGION_STATE_ATTR)) is not None:
        rec = record(region_state)  # the cache's own record on the compiled model
        if result.status != CacheStatus.LOADED or result.refresh:
            # keep the first call's inputs: the save traces the graph with them
            rec.keep_example = why_not is None
    model.__dict__[STATE_ATTR] = _RunState(
        config=config,
        key=key,
        load=result,
        sharing=sharing,
        saved=False,
        load_s=time.perf_counter() - start,
        entries=None,
    )
    return result


class _RunState(dict):
    """The cache's state on a model: a dict subclass, because torch's guard pickler (a
    saved graph's) leaves out module attributes no guard reads, but never sees a plain
    dict (pickle saves those itself), and this one can hold a process group's store."""


def save(model: nn.Module, *, force: bool = False) -> str | None:
    """Saves the compile artifacts after the first training step (forward and backward).

    Call it on every rank (``shared`` mode: rank 0 writes, the others stop sharing).
    The Lightning and Accelerate callbacks call it after the first optimizer step. When
    the run had not validated before that save, a call after its first eval call (a
    validation loop) saves the bundle again with that call's kernels and saved graph; the
    callbacks do this after the validation loop (Lightning) or the next optimizer step
    (Accelerate).

    Args:
        model: A model parallelized with ``cache.mode`` ``local`` or ``shared``, or a
            module holding one (a LightningModule, a wrapper): its submodules are searched.
        force: Save again even if this model saved already (later recompiles).

    Returns:
        The path written, or ``None`` (not this rank's job, nothing new, or cache off).
    """
    written = [_save_one(m, force=force) for m in holders(model)]
    return next((p for p in written if p is not None), None)


def holders(model: nn.Module) -> list[nn.Module]:
    """``model``'s modules that hold a bundle's state (what :func:`save` saves)."""
    return [m for m in model.modules() if STATE_ATTR in vars(m)]


def pending(holder: nn.Module) -> bool:
    """Whether :func:`save` would write ``holder``'s bundle again: an eval call compiled
    after the first save (see :func:`watching`)."""
    state, regions = vars(holder).get(STATE_ATTR), vars(holder).get(REGION_STATE_ATTR)
    return (
        state is not None
        and regions is not None
        and state["saved"]
        and state["entries"] is not None
        and eval_pending(regions)
    )


def watching(holder: nn.Module) -> bool:
    """Whether a first eval call after the save can still make :func:`pending` true."""
    state, regions = vars(holder).get(STATE_ATTR), vars(holder).get(REGION_STATE_ATTR)
    return (
        state is not None
        and regions is not None
        and state["entries"] is not None
        and watches_eval(regions)
    )


def save_after_first_step(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Calls :func:`save` after ``optimizer``'s first step, and once more after the first
    step that follows the first eval call compiled after that save (an eval loop: its
    kernels and saved graph join the bundle); then the step hook removes itself.

    For training loops that own no callback system (Accelerate's ``prepare`` uses it);
    a no-op save unless ``cache.mode`` is ``local`` or ``shared``.
    """
    saved_by: list[nn.Module] = []

    def hook(*_):
        if not saved_by:  # the first step
            saved_by.extend(holders(model) or [model])
            save(model)
        elif any(pending(h) for h in saved_by):
            save(model)
        if not any(watching(h) for h in saved_by):
            handle.remove()

    handle = optimizer.register_step_post_hook(hook)


def _save_one(model: nn.Module, *, force: bool) -> str | None:
    state = vars(model).get(STATE_ATTR)
    if state is None:
        return None
    again = state["saved"] and not force  # the first eval call after the save, if any
    if again and not pending(model):
        return None
    state["saved"] = True
    if state["sharing"] is not None:
        state["sharing"].stop()  # (once: a second stop does nothing)
    cfg: CacheConfig = state["config"].cache
    rank, world = _rank_world()
    if (cfg.mode == "shared" and rank != 0) or (
        state["load"].status == CacheStatus.LOADED and not (force or state["load"].refresh)
    ):
        if (regions := vars(model).get(REGION_STATE_ATTR)) is not None:
            release_examples(regions)  # rank 0's job; or the bundle it started from has it
        return None
    path = _bundle_path(cfg, rank, world)
    try:
        if again:
            entries = precompile.add_eval(model, state["entries"])
        else:
            entries = precompile.build(model, state["config"])
        # kept while a later eval call can add to them (the bundle is written whole)
        regions = vars(model).get(REGION_STATE_ATTR)
        state["entries"] = entries if regions is not None and watches_eval(regions) else None
        data = pack(state["key"], entries)
        if data is None:
            return None
        os.makedirs(cfg.dir, mode=0o755, exist_ok=True)  # not group-writable under umask 002
        write_atomic(path, data)
    except Exception as exc:  # a full disk must not stop training
        warnings.warn(
            f"aotdist cache: could not save {path} on rank {rank}: "
            f"{type(exc).__name__}: {exc}; the next run compiles again.",
            CacheWarning,
            stacklevel=2,
        )
        return None
    _log.info("cache %s on rank %d: saved %s (%d bytes)", cfg.mode, rank, path, len(data))
    return path
