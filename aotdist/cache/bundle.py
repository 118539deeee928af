"""The bundle file format: a JSON header (format, key, SHA-256) and a checked payload.

``MAGIC``, an 8-byte header length, the header, then the payload: Mega-Cache bytes
followed by kernel files, whose paths and sizes the header lists. :func:`decode` checks
magic, checksum and paths and raises ``ValueError`` on any problem.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile

__all__ = ["FORMAT", "MAGIC", "decode", "encode", "write_atomic"]

MAGIC = b"AOTDIST-CACHE\n"
FORMAT = 1


def encode(key: dict, mega: bytes, kernels: dict[str, bytes]) -> bytes:
    payload = mega + b"".join(kernels.values())
    header = {"key": key, "sha256": hashlib.sha256(payload).hexdigest(), "mega_len": len(mega),
              "kernels": [[path, len(data)] for path, data in kernels.items()]}
    head = json.dumps(header).encode()
    return MAGIC + struct.pack(">Q", len(head)) + head + payload


def decode(data: bytes) -> tuple[dict, bytes, dict[str, bytes]]:
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
