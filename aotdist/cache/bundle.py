"""The bundle file format: a JSON header (format, key, SHA-256) and a checked payload.

``MAGIC``, an 8-byte header length, the header, then the payload: Mega-Cache bytes
followed by kernel files, whose paths and sizes the header lists. :func:`decode` checks
magic, checksum and paths and raises ``ValueError`` on any problem. A bundle is code
(pickles, shared libraries): :func:`check_safe` says whether a file may be loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import tempfile

MAGIC = b"AOTDIST-CACHE\n"
FORMAT = 1


def encode(key: dict, mega: bytes, kernels: dict[str, bytes]) -> bytes:
    payload = mega + b"".join(kernels.values())
    header = {
        "key": key,
        "sha256": hashlib.sha256(payload).hexdigest(),
        "mega_len": len(mega),
        "kernels": [[path, len(data)] for path, data in kernels.items()],
    }
    head = json.dumps(header).encode()
    return MAGIC + struct.pack(">Q", len(head)) + head + payload


def decode(data: bytes) -> tuple[dict, bytes, dict[str, bytes]]:
    """Header, Mega-Cache bytes and kernel files of a bundle; ``ValueError`` if corrupt."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise ValueError("not an aotdist artifact bundle (bad magic bytes)")
    (n,) = struct.unpack(">Q", data[len(MAGIC) : len(MAGIC) + 8])
    start = len(MAGIC) + 8
    try:
        header = json.loads(data[start : start + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"unreadable header ({exc})") from None
    payload = data[start + n :]
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError(
            f"checksum mismatch ({len(payload)} payload bytes; truncated or overwritten)"
        )
    mega, pos, kernels = payload[: header["mega_len"]], header["mega_len"], {}
    for path, size in header["kernels"]:
        parts = path.split("/")
        if len(parts) != 2 or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"bad kernel path {path!r}")
        kernels[path] = payload[pos : pos + size]
        pos += size
    return header, mega, kernels


def write_atomic(path: str, data: bytes, *, mode: int = 0o644) -> None:
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


def check_safe(path: str) -> str | None:
    """Why the bundle at ``path`` must not be loaded, or ``None`` if it may (SSH's rule).

    The file and its directory must be owned by this user (or root) and writable by
    neither group nor others, and the file must not be a symbolic link (a link could be
    redirected; the directory is checked where a link to it leads). Skipped where there
    are no user ids (Windows).

    Raises:
        FileNotFoundError: There is no file at ``path``.
    """
    if not hasattr(os, "getuid"):
        return None
    uid = os.getuid()
    folder = os.path.dirname(os.path.abspath(path))
    problems = []
    for what, name, st in [("directory", folder, os.stat(folder)), ("file", path, os.lstat(path))]:
        if stat.S_ISLNK(st.st_mode):
            problems.append(
                f"{name} is a symbolic link (to {os.readlink(name)!r}); fix: put "
                "the bundle file itself there, or set cache.dir to where it lies"
            )
            continue
        if st.st_uid not in (uid, 0):
            problems.append(
                f"{what} {name} is owned by uid {st.st_uid}, not by this user "
                f"(uid {uid}); fix: chown {uid} {name}, or delete it"
            )
        mode = stat.S_IMODE(st.st_mode)
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            problems.append(
                f"{what} {name} is writable by group or others (mode {mode:#o}); "
                f"fix: chmod go-w {name}"
            )
    return "; ".join(problems) or None
