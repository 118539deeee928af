"""What a bundle holds: PyTorch's Mega-Cache bytes and the compiled kernel files.

On CPU the Mega-Cache (``torch.compiler.save_cache_artifacts``) holds the kernels'
source only; without the binaries a warm start would still run the C++ compiler, so the
kernel files and Inductor's CPU vector-ISA probe builds travel with it.
"""

from __future__ import annotations

import os

import torch

from aotdist.cache.bundle import encode, write_atomic

__all__ = ["install", "isa_probe_files", "kernel_files", "mega_bytes", "pack"]


def kernel_files() -> dict[str, bytes]:
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


def isa_probe_files() -> dict[str, bytes]:
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


def mega_bytes() -> bytes | None:
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


def pack(key: dict) -> bytes | None:
    mega = mega_bytes()
    if mega is None:
        return None
    return encode(key, mega, {**isa_probe_files(), **kernel_files()})


def install(mega: bytes, kernels: dict[str, bytes]) -> dict:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = cache_dir()
    for path, data in kernels.items():
        dest = os.path.join(root, path)
        if os.path.exists(dest):
            continue
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        write_atomic(dest, data, mode=0o755 if path.endswith(".so") else 0o644)
    info = torch.compiler.load_cache_artifacts(mega)
    return {k: len(v) for k, v in info.artifacts.items()} if info is not None else {}
