"""What a bundle holds: PyTorch's Mega-Cache bytes and the compiled kernel files.

On CPU the Mega-Cache (``torch.compiler.save_cache_artifacts``) holds the kernels'
source only; without the binaries a warm start would still run the C++ compiler, so the
kernel files and Inductor's CPU vector-ISA probe builds travel with it.
"""

from __future__ import annotations

import hashlib
import os
import platform

import torch

from aotdist import _compat
from aotdist.cache.bundle import encode, write_atomic


def kernel_files() -> dict[str, bytes]:
    """Files of the C++ kernels this process compiled or loaded, by path in the cache dir
    (none when this torch does not expose them: a warm start then compiles C++ again)."""
    root, keys = _compat.inductor_cache_dir(), _compat.cpp_code_cache_keys() or set()
    out = {}
    for key in keys:
        sub = os.path.join(root, key[1:3])
        for name in os.listdir(sub) if os.path.isdir(sub) else ():
            path = os.path.join(sub, name)
            # files only: torch's C++ builder may leave a <key>_CxxBuild folder beside them
            if name.startswith(key) and not name.endswith(".lock") and os.path.isfile(path):
                with open(path, "rb") as fh:
                    out[f"{key[1:3]}/{name}"] = fh.read()
    return out


ENTRY_PREFIX = "aotdist/"  # bundle entries that are not cache-dir files
CPU_ENTRY = "aotdist/isa-cpu"  # who made the ISA load markers


def cpu_signature() -> str:
    """What decides whether an ISA probe's ``.so`` loads on this machine: architecture,
    CPU vendor, model and feature flags (``/proc/cpuinfo``), and torch's version; ``""``
    where the CPU cannot be read (then no load marker travels)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return ""
    fields = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if (
            name
            in (
                "vendor_id",
                "cpu family",
                "model",
                "model name",
                "flags",
                "Features",
                "CPU implementer",
                "CPU part",
            )
            and name not in fields
        ):
            fields[name] = (
                " ".join(sorted(value.split())) if name in ("flags", "Features") else value.strip()
            )
    if "flags" not in fields and "Features" not in fields:
        return ""
    parts = [platform.machine(), torch.__version__, *map(str, sorted(fields.items()))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def isa_probe_files() -> dict[str, bytes]:
    """Inductor's CPU vector-ISA probes, by path in the cache dir.

    Before its first CPU kernel, Inductor compiles a few small C++ programs to learn which
    vector ISA this CPU runs, once per cache dir, and then loads each in a child Python
    (a success is remembered in a ``<key>.so.load_ok`` marker: by torch 2.14+ itself, on
    2.11 by :func:`aotdist._compat.remembered_isa_loads` while aotdist compiles; costs:
    docs/internals.md). The probes' ``.so`` files travel with the
    bundle. Their markers travel too, with this machine's
    :func:`cpu_signature` (entry :data:`CPU_ENTRY`): :func:`install` writes them only on
    a machine with the same signature, so a CPU without that ISA still runs the probe and
    still says no.
    """
    root, out = _compat.inductor_cache_dir(), {}
    keys = _compat.isa_probe_keys(root)
    signature = cpu_signature()
    for key in keys:
        folder = os.path.join(root, key[1:3])
        for name in os.listdir(folder) if os.path.isdir(folder) else ():
            if not name.startswith(key) or name.endswith(".lock"):
                continue
            if not os.path.isfile(os.path.join(folder, name)):  # a <key>_CxxBuild folder
                continue
            if name.endswith(".load_ok") and not signature:
                continue
            with open(os.path.join(folder, name), "rb") as fh:
                out[f"{key[1:3]}/{name}"] = fh.read()
    if any(path.endswith(".load_ok") for path in out):
        out[CPU_ENTRY] = signature.encode()
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


def pack(key: dict, extra: dict[str, bytes] | None = None) -> bytes | None:
    """The bundle: the Mega-Cache, kernel and ISA probe files, and ``extra`` entries
    (named ``aotdist/...``: not cache-dir files)."""
    mega = mega_bytes()
    if mega is None:
        return None
    return encode(key, mega, {**isa_probe_files(), **kernel_files(), **(extra or {})})


def install(mega: bytes, kernels: dict[str, bytes]) -> dict:
    root = _compat.inductor_cache_dir()
    same_cpu = kernels.get(CPU_ENTRY, b"").decode(errors="replace") == cpu_signature() != ""
    for path, data in kernels.items():
        if path.startswith(ENTRY_PREFIX) or (path.endswith(".load_ok") and not same_cpu):
            continue
        dest = os.path.join(root, path)
        if os.path.exists(dest):
            continue
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        write_atomic(dest, data, mode=0o755 if path.endswith(".so") else 0o644)
    info = torch.compiler.load_cache_artifacts(mega)
    return {k: len(v) for k, v in info.artifacts.items()} if info is not None else {}
