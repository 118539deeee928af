"""What a bundle holds: PyTorch's Mega-Cache bytes and the compiled kernel files.

On CPU the Mega-Cache (``torch.compiler.save_cache_artifacts``) holds the kernels'
source only; without the binaries a warm start would still run the C++ compiler, so the
kernel files and Inductor's CPU vector-ISA probe builds travel with it.
"""

from __future__ import annotations

import os

import torch

from aotdist import _compat
from aotdist.cache.bundle import encode, write_atomic

__all__ = ["install", "isa_probe_files", "kernel_files", "mega_bytes", "pack"]


def kernel_files() -> dict[str, bytes]:
    """Files of the C++ kernels this process compiled or loaded, by path in the cache dir
    (none when this torch does not expose them: a warm start then compiles C++ again)."""
    root, keys = _compat.inductor_cache_dir(), _compat.cpp_code_cache_keys() or set()
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
    root, out = _compat.inductor_cache_dir(), {}
    for key, input_path in _compat.isa_probes():  # none on a torch without them
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
    records are merged by kind and serialized once (found on torch 2.15;
    :func:`aotdist._compat.merge_mega_cache`).
    """
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    return _compat.merge_mega_cache(saved[0])


def pack(key: dict) -> bytes | None:
    mega = mega_bytes()
    if mega is None:
        return None
    return encode(key, mega, {**isa_probe_files(), **kernel_files()})


def install(mega: bytes, kernels: dict[str, bytes]) -> dict:
    root = _compat.inductor_cache_dir()
    for path, data in kernels.items():
        dest = os.path.join(root, path)
        if os.path.exists(dest):
            continue
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        write_atomic(dest, data, mode=0o755 if path.endswith(".so") else 0o644)
    info = torch.compiler.load_cache_artifacts(mega)
    return {k: len(v) for k, v in info.artifacts.items()} if info is not None else {}
