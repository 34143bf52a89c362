"""The state store's files: a small header, the key, what the entry needs, then raw bytes
(docs/design.md s10.1). Two kinds share the format:

    <hash hex>.state   a bundle: the pages of every state group at one block boundary, the
                       groups in order (pure Laplace has one); its key is vLLM's block hash of
                       the prefix, and for a hybrid it lists the attention blocks it needs
    <key hex>.kv       one attention block of one attention group; its key is vLLM's offload
                       key (the block hash, then the group index); it needs nothing

    offset      size  field
    0           8     magic b"LPSTATE\\x00"
    8           4     format version (2), little-endian u32
    12          4     key length K, u32
    16          4     needs length M (bytes: the needed keys back to back), u32
    20          8     payload length N, u64
    28          32    store fingerprint (sha256: the model and the state layout, `fingerprint.py`)
    60          4     CRC-32 of the needs and the payload, u32
    64          K     the key
    64 + K      M     the needed keys back to back (attention blocks' offload keys, each K + 4)
    64 + K + M  N     the payload, as the engine holds it (raw bytes, never a pickle)

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
VERSION = 2
_HEADER = struct.Struct("<8sIIIQ32sI")  # magic, version, key len, needs len, payload len, fp, crc
SUFFIX = ".state"  # a bundle of state pages
BLOCK_SUFFIX = ".kv"  # an attention block


class StateFileError(Exception):
    """A stored entry that must not be loaded (truncated, corrupt, foreign, wrong size)."""


def _path(root: Path, key: bytes, suffix: str) -> Path:
    name = key.hex()  # root/<first 2 hex digits>/: 256 subdirectories keep each one small
    return root / name[:2] / f"{name}{suffix}"


def state_path(root: Path, block_hash: bytes) -> Path:
    """A bundle: root/<first 2 hex digits>/<block hash hex>.state."""
    return _path(root, block_hash, SUFFIX)


def block_path(root: Path, key: bytes) -> Path:
    """An attention block: root/<first 2 hex digits>/<offload key hex>.kv."""
    return _path(root, key, BLOCK_SUFFIX)


def encode(fingerprint: bytes, key: bytes, payload, needs: bytes = b"") -> list:
    """The file's bytes as [header, key, needs, payload] (payload: any buffer, not copied)."""
    view = memoryview(payload).cast("B")
    crc = zlib.crc32(view, zlib.crc32(needs)) & 0xFFFFFFFF
    header = _HEADER.pack(MAGIC, VERSION, len(key), len(needs), view.nbytes, fingerprint, crc)
    return [header, key, needs, view]


def write_state(path: Path, fingerprint: bytes, key: bytes, payload, needs: bytes = b"") -> int:
    """Write the file atomically (a unique temporary name in the same folder, fsync, rename);
    returns the bytes written. An OSError (a full disk, a read-only folder) leaves no file."""
    path.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    parts = encode(fingerprint, key, payload, needs)
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


def _read_head(f, fingerprint: bytes, key: bytes | None):
    """The header checked (and the key, unless None): (needs length, payload length, crc)."""
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise StateFileError(f"truncated header ({len(head)} of {_HEADER.size} bytes)")
    magic, version, key_len, needs_len, n, fp, crc = _HEADER.unpack(head)
    if magic != MAGIC:
        raise StateFileError("not a Laplace state file (bad magic)")
    if version != VERSION:
        raise StateFileError(f"format version {version}, this reader knows {VERSION}")
    if fp != fingerprint:
        raise StateFileError(f"written by another model or state layout ({fp.hex()[:16]})")
    got = f.read(key_len)
    if key is not None and got != key:
        raise StateFileError("its key is not the one its name says")
    return needs_len, n, crc


def read_state(path: Path, fingerprint: bytes, key: bytes, out) -> bytes:
    """Fill `out` (a writable buffer of the payload's exact size) from the file and return the
    keys it needs, or raise StateFileError saying what is wrong. `out` may be partly written
    when it raises."""
    dest = memoryview(out).cast("B")
    with open(path, "rb") as f:
        needs_len, n, crc = _read_head(f, fingerprint, key)
        needs = f.read(needs_len)
        if len(needs) != needs_len:
            raise StateFileError(f"truncated list of needed blocks ({len(needs)} of {needs_len})")
        if n != dest.nbytes:
            raise StateFileError(f"payload of {n} bytes, the engine's state is {dest.nbytes}")
        got = f.readinto(dest)
        if got != n:
            raise StateFileError(f"truncated payload ({got} of {n} bytes)")
        if f.read(1):
            raise StateFileError("bytes after the payload")
    if zlib.crc32(dest, zlib.crc32(needs)) & 0xFFFFFFFF != crc:
        raise StateFileError("checksum mismatch (corrupted payload)")
    return needs


def read_needs(path: Path, fingerprint: bytes) -> bytes:
    """The keys a file says it needs (not checked against its CRC: eviction's reference counts
    read this; a damaged file is found and removed when it is loaded)."""
    with open(path, "rb") as f:
        needs_len, _, _ = _read_head(f, fingerprint, None)
        return f.read(needs_len)
