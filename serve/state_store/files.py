"""One stored state on disk: a small header, then the state's raw bytes (docs/design.md s10.1).

    offset  size  field
    0       8     magic b"LPSTATE\\x00"
    8       4     format version (1), little-endian u32
    12      4     key length K, u32
    16      8     payload length N, u64
    24      32    store fingerprint (sha256: the model and the state layout, `fingerprint.py`)
    56      4     CRC-32 of the payload, u32
    60      K     the offload key (vLLM's block hash of the prefix, then the group index)
    60 + K  N     the payload: the state pages of every layer for one sequence, as the engine
                  holds them (raw bytes, never a pickle)

A file is written under a temporary name and renamed into place (`write_state`): a reader sees a
whole file or none, and two processes writing the same key leave one whole file. `read_state`
checks every field against what the reader expects, so a truncated, corrupted, renamed or
foreign file raises `StateFileError` naming what is wrong, and is never loaded.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

MAGIC = b"LPSTATE\x00"
VERSION = 1
_HEADER = struct.Struct("<8sIIQ32sI")  # magic, version, key length, payload length, fp, crc
SUFFIX = ".state"


class StateFileError(Exception):
    """A stored state that must not be loaded (truncated, corrupt, foreign, wrong size)."""


def state_path(root: Path, key: bytes) -> Path:
    """root/<first 2 hex digits>/<key hex>.state: 256 subdirectories keep each one small."""
    name = key.hex()
    return root / name[:2] / f"{name}{SUFFIX}"


def encode(fingerprint: bytes, key: bytes, payload) -> list:
    """The file's bytes as [header, key, payload] (payload: any buffer, not copied)."""
    view = memoryview(payload).cast("B")
    header = _HEADER.pack(
        MAGIC, VERSION, len(key), view.nbytes, fingerprint, zlib.crc32(view) & 0xFFFFFFFF
    )
    return [header, key, view]


def write_state(path: Path, fingerprint: bytes, key: bytes, payload) -> int:
    """Write the file atomically (a unique temporary name in the same folder, fsync, rename);
    returns the bytes written. An OSError (a full disk, a read-only folder) leaves no file."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    parts = encode(fingerprint, key, payload)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for part in parts:
                view = memoryview(part)
                while view.nbytes:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return sum(memoryview(p).nbytes for p in parts)


def read_state(path: Path, fingerprint: bytes, key: bytes, out) -> None:
    """Fill `out` (a writable buffer of the payload's exact size) from the file, or raise
    StateFileError saying what is wrong. `out` may be partly written when it raises."""
    dest = memoryview(out).cast("B")
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise StateFileError(f"truncated header ({len(head)} of {_HEADER.size} bytes)")
        magic, version, key_len, n, fp, crc = _HEADER.unpack(head)
        if magic != MAGIC:
            raise StateFileError("not a Laplace state file (bad magic)")
        if version != VERSION:
            raise StateFileError(f"format version {version}, this reader knows {VERSION}")
        if fp != fingerprint:
            raise StateFileError(f"written by another model or state layout ({fp.hex()[:16]})")
        if f.read(key_len) != key:
            raise StateFileError("its key is not the one its name says")
        if n != dest.nbytes:
            raise StateFileError(f"payload of {n} bytes, the engine's state is {dest.nbytes}")
        got = f.readinto(dest)
        if got != n:
            raise StateFileError(f"truncated payload ({got} of {n} bytes)")
        if f.read(1):
            raise StateFileError("bytes after the payload")
    if zlib.crc32(dest) & 0xFFFFFFFF != crc:
        raise StateFileError("checksum mismatch (corrupted payload)")
