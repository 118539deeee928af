"""Compile artifacts shared across ranks and across runs (``cache`` config section).

A *bundle* is one file: a JSON header (format, invalidation key, SHA-256 of the payload)
and a payload of PyTorch's Mega-Cache bytes (``torch.compiler.save_cache_artifacts``:
FX graph and AOTAutograd cache entries) plus the compiled C++ kernel files those
entries load (on CPU the Mega-Cache holds the kernels' source only; without the
binaries a warm start would still run the C++ compiler).

* :func:`load` (``parallelize`` calls it, before the first compile) reads the bundle,
  checks key and checksum, writes its kernel files into Inductor's cache directory and
  hot-loads the Mega-Cache. Any problem is a :class:`CacheWarning` and a normal compile.
* :func:`save` (after the first training step, when the backward is compiled too; the
  callbacks call it) writes the bundle atomically.
* ``shared`` mode: rank 0 reads the bundle and broadcasts it over the process group;
  rank 0 alone saves. In a cold run, :class:`_CompileSharing` lets the other ranks wait
  for rank 0's artifacts of each graph (through the process group's store) and load
  them instead of compiling; the graph's own FX cache key decides, so a graph whose key
  differs on this rank is compiled here, with a warning that says so.

Inductor's own cache keys (content hashes of graph, inputs, config and compiler) still
guard every entry, so a bundle can never serve a stale kernel: at worst it misses.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import tempfile
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from aotdist.config import AOTDistConfig, CacheConfig

__all__ = ["CacheLoad", "CacheWarning", "cache_key", "load", "save"]

MAGIC = b"AOTDIST-CACHE\n"
FORMAT = 1
STATE_ATTR = "_aotdist_cache"


class CacheWarning(UserWarning):
    """A compile artifact bundle was not used (stale, corrupt, mismatched); the run compiles."""


@dataclass(frozen=True)
class CacheLoad:
    """What :func:`load` did.

    Attributes:
        status: ``off``, ``missing`` (no bundle yet), ``loaded``, ``stale`` (key
            mismatch) or ``corrupt``.
        reason: Why it was not loaded, empty when it was.
        path: The bundle file.
        artifacts: Mega-Cache entries loaded, by kind (``inductor``, ``aot_autograd``).
        kernel_files: Compiled kernel files written into Inductor's cache directory.
    """

    status: str
    reason: str = ""
    path: str = ""
    artifacts: dict | None = None
    kernel_files: int = 0


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _bundle_path(cfg: CacheConfig, rank: int, world: int) -> str:
    name = "artifacts.aotc" if cfg.mode == "shared" or world == 1 else f"artifacts.rank{rank}.aotc"
    return os.path.join(cfg.dir, name)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_key(model: nn.Module, config: AOTDistConfig, *, device: str | None = None) -> dict:
    """The invalidation key stored with a bundle: versions, model structure, config, device.

    Args:
        model: The parallelized model (region plan signatures, parameter shapes and dtypes).
        config: Its config; the ``cache`` section itself is left out.
        device: Device type; default: that of the model's first parameter.
    """
    import aotdist
    from aotdist.parallelize import parallelize_info

    info = parallelize_info(model)
    plan = [(r.name, r.signature, len(r.fqns)) for r in info.plan] if info else []
    params = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    first = next(model.parameters(), None)
    cfg = {k: v for k, v in config.to_dict().items() if k != "cache"}
    return {
        "format": FORMAT, "torch": torch.__version__, "aotdist": aotdist.__version__,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "device": device or (first.device.type if first is not None else "cpu"),
        "model": _digest([type(model).__qualname__, plan, params]), "config": _digest(cfg),
    }


# ---------------------------------------------------------------- bundle bytes


def _kernel_files() -> dict[str, bytes]:
    """Files of the C++ kernels this process compiled or loaded, by path in the cache dir."""
    from torch._inductor.codecache import CppCodeCache
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root, keys, todo = cache_dir(), set(), [CppCodeCache]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        keys.update(vars(cls).get("cache", {}))
    out = {}
    for key in keys:
        sub = os.path.join(root, key[1:3])
        for name in os.listdir(sub) if os.path.isdir(sub) else ():
            if name.startswith(key) and not name.endswith(".lock"):
                with open(os.path.join(sub, name), "rb") as fh:
                    out[f"{key[1:3]}/{name}"] = fh.read()
    return out


def _isa_probe_files() -> dict[str, bytes]:
    """Inductor's CPU vector-ISA probes, by path in the cache dir.

    Before its first CPU kernel, Inductor compiles a few small C++ programs to learn which
    vector ISA this CPU runs (7-8 s of gcc on a 2-core machine), once per cache dir. Their
    ``.so`` files travel with the bundle; the ``.load_ok`` markers do not, so the loading
    machine still runs each probe and a CPU without that ISA still says no.
    """
    try:
        from torch._inductor import cpu_vec_isa
        from torch._inductor.codecache import write
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        fingerprint = cpu_vec_isa._get_isa_dry_compile_fingerprint
        isas = list(cpu_vec_isa.supported_vec_isa_list)
    except (ImportError, AttributeError):  # other torch versions: no probes bundled
        return {}
    root, out = cache_dir(), {}
    for isa in isas:
        codes = {getattr(isa, n) for n in dir(type(isa))
                 if n.endswith("_code") and isinstance(getattr(isa, n, None), str)}
        for code in codes:
            try:
                key, input_path = write(code, "cpp", extra=fingerprint(isa.build_arch_flags()))
            except Exception:  # noqa: BLE001 - best effort: a probe not bundled is rebuilt
                continue
            folder = os.path.dirname(input_path)
            for name in os.listdir(folder):
                if name.startswith(key) and not name.endswith((".lock", ".load_ok")):
                    with open(os.path.join(folder, name), "rb") as fh:
                        out[os.path.relpath(os.path.join(folder, name), root)] = fh.read()
    return out


def _mega_bytes() -> bytes | None:
    """``torch.compiler.save_cache_artifacts()``, every artifact of this process.

    Its bytes append one ``(kind, artifacts)`` record per call since the process began,
    and ``load_cache_artifacts`` keeps only the *last* record of each kind (``dict()`` of
    the records): after a second call, the first call's FX graphs would be lost. The
    records are merged by kind and serialized once here (found on torch 2.15).
    """
    from torch.compiler._cache import (
        AppendingByteSerializer,
        CacheArtifactManager,
        _deserialize_single_cache,
        _serialize_single_cache,
    )

    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    CacheArtifactManager._ensure_cache_artifacts_registered()
    merged: dict[str, list] = {}
    for kind, artifacts in AppendingByteSerializer.to_list(
            saved[0], deserialize_fn=_deserialize_single_cache):
        seen = merged.setdefault(kind, [])
        seen.extend(a for a in artifacts if a not in seen)
    out = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    out.extend(merged.items())
    return out.to_bytes()


def _pack(key: dict) -> bytes | None:
    mega = _mega_bytes()
    if mega is None:
        return None
    return _encode(key, mega, {**_isa_probe_files(), **_kernel_files()})


def _encode(key: dict, mega: bytes, kernels: dict[str, bytes]) -> bytes:
    payload = mega + b"".join(kernels.values())
    header = {"key": key, "sha256": hashlib.sha256(payload).hexdigest(), "mega_len": len(mega),
              "kernels": [[path, len(data)] for path, data in kernels.items()]}
    head = json.dumps(header).encode()
    return MAGIC + struct.pack(">Q", len(head)) + head + payload


def _unpack(data: bytes) -> tuple[dict, bytes, dict[str, bytes]]:
    """Header, Mega-Cache bytes and kernel files of a bundle; ``ValueError`` if corrupt."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise ValueError("not an aotdist artifact bundle (bad magic bytes)")
    (n,) = struct.unpack(">Q", data[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    try:
        header = json.loads(data[start:start + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"unreadable header ({exc})") from None
    payload = data[start + n:]
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError(f"checksum mismatch ({len(payload)} payload bytes; truncated or "
                         "overwritten)")
    mega, pos, kernels = payload[:header["mega_len"]], header["mega_len"], {}
    for path, size in header["kernels"]:
        parts = path.split("/")
        if len(parts) != 2 or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"bad kernel path {path!r}")
        kernels[path] = payload[pos:pos + size]
        pos += size
    return header, mega, kernels


def _install(mega: bytes, kernels: dict[str, bytes]) -> dict:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = cache_dir()
    for path, data in kernels.items():
        dest = os.path.join(root, path)
        if os.path.exists(dest):
            continue
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        _write_atomic(dest, data, mode=0o755 if path.endswith(".so") else 0o644)
    info = torch.compiler.load_cache_artifacts(mega)
    return {k: len(v) for k, v in info.artifacts.items()} if info is not None else {}


def _write_atomic(path: str, data: bytes, *, mode: int = 0o644) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".aotdist-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _diff(stored: dict, key: dict) -> str:
    return ", ".join(f"{k} {stored.get(k)!r} -> {v!r}" for k, v in key.items()
                     if stored.get(k) != v)


def _use(data: bytes | None, key: dict, path: str) -> CacheLoad:
    if data is None:
        return CacheLoad("missing", "no bundle yet; this run compiles and saves one", path)
    try:
        header, mega, kernels = _unpack(data)
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        return CacheLoad("corrupt", f"corrupt bundle: {exc}", path)
    if header.get("key") != key:
        return CacheLoad("stale", f"made for another setup ({_diff(header.get('key', {}), key)})",
                         path)
    return CacheLoad("loaded", "", path, _install(mega, kernels), len(kernels))


# ---------------------------------------------------------------- public API


def load(model: nn.Module, config: AOTDistConfig, *, device: str | None = None) -> CacheLoad:
    """Loads the bundle for ``model`` before its first compile (``parallelize`` calls this).

    In ``shared`` mode every rank must call it (rank 0 broadcasts the bundle); there it
    also starts sharing rank 0's compiles with the other ranks until :func:`save`.

    Args:
        model: The parallelized, not yet run model.
        config: Its config; ``config.cache`` says where and how.
        device: Device type for the key; default: the model's.

    Returns:
        What happened; a bundle not used was reported with a :class:`CacheWarning`
        (``missing`` is not warned about: the first run has none).
    """
    cfg = config.cache
    if cfg.mode == "off":
        return CacheLoad("off")
    rank, world = _rank_world()
    key = cache_key(model, config, device=device)
    path = _bundle_path(cfg, rank, world)
    data = None
    if cfg.mode == "local" or rank == 0:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            pass
        except OSError as exc:
            warnings.warn(f"aotdist cache: cannot read {path} on rank {rank} ({exc}); "
                          "compiling normally.", CacheWarning, stacklevel=2)
    if cfg.mode == "shared" and world > 1:
        import torch.distributed as dist

        box = [data]
        dist.broadcast_object_list(box, src=0)
        data = box[0]
    try:
        result = _use(data, key, path)
    except Exception as exc:  # a failure installing must never stop the job
        result = CacheLoad("corrupt", f"could not install it: {type(exc).__name__}: {exc}", path)
    if result.status in ("stale", "corrupt"):
        warnings.warn(f"aotdist cache: ignoring {path} on rank {rank}: {result.reason}; "
                      "compiling normally (the bundle is replaced after the first step).",
                      CacheWarning, stacklevel=2)
    sharing = None
    if cfg.mode == "shared" and world > 1 and result.status != "loaded":
        from aotdist.cache_share import CompileSharing

        sharing = CompileSharing(rank=rank, timeout_s=cfg.share_timeout_s)
        sharing.start()
    model.__dict__[STATE_ATTR] = {"config": config, "key": key, "load": result,
                                  "sharing": sharing, "saved": False}
    return result


def save(model: nn.Module, *, force: bool = False) -> str | None:
    """Saves the compile artifacts after the first training step (forward and backward).

    Call it on every rank (``shared`` mode: rank 0 writes, the others stop sharing).
    The Lightning and Accelerate callbacks call it after the first optimizer step.

    Args:
        model: A model parallelized with ``cache.mode`` ``local`` or ``shared``, or a
            module holding one (a LightningModule, a wrapper): its submodules are searched.
        force: Save again even if this model saved already (later recompiles).

    Returns:
        The path written, or ``None`` (not this rank's job, nothing new, or cache off).
    """
    written = [_save_one(m, force=force) for m in model.modules() if STATE_ATTR in vars(m)]
    return next((p for p in written if p is not None), None)


def _save_one(model: nn.Module, *, force: bool) -> str | None:
    state = vars(model).get(STATE_ATTR)
    if state is None or (state["saved"] and not force):
        return None
    state["saved"] = True
    if state["sharing"] is not None:
        state["sharing"].stop()
    cfg: CacheConfig = state["config"].cache
    rank, world = _rank_world()
    if cfg.mode == "shared" and rank != 0:
        return None
    if state["load"].status == "loaded" and not force:
        return None  # the bundle it started from holds everything this run compiled
    path = _bundle_path(cfg, rank, world)
    try:
        data = _pack(state["key"])
        if data is None:
            return None
        os.makedirs(cfg.dir, exist_ok=True)
        _write_atomic(path, data)
    except Exception as exc:  # a full disk must not stop training
        warnings.warn(f"aotdist cache: could not save {path} on rank {rank}: "
                      f"{type(exc).__name__}: {exc}; the next run compiles again.",
                      CacheWarning, stacklevel=2)
        return None
    return path

