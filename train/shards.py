"""Token shards: the file format, its two token widths, and a writer that streams to disk.

A shard is a header of 256 little-endian int32 -- magic, version, token count -- followed by that
many tokens, in one of two widths (llm.c's two formats, which nanoGPT / modded-nanogpt share):

    width    magic      version   token ids          written by
    uint16   20240520   1         < 65,536           nanoGPT, modded-nanogpt, llm.c (GPT-2)
    uint32   20240801   7         < 4,294,967,296    llm.c (Llama 3)

so the published FineWeb GPT-2 shards load as they are, and a tokenizer of more than 65,536 ids
(Llama 3's 128,256, Qwen's 151,646, Gemma's 262,144) gets uint32 shards. The magic says which
width a shard holds: every shard is validated when opened (errors name the file), and a set that
mixes widths is refused. `train.prepare` picks the width from the tokenizer's size
(`width_for_vocab`).
"""

from __future__ import annotations

import dataclasses
import glob
import os
from pathlib import Path

import numpy as np

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAX_SHARD_TOKENS = 2**31 - 1  # the header's count is an int32


@dataclasses.dataclass(frozen=True)
class TokenWidth:
    name: str
    dtype: np.dtype
    magic: int
    version: int

    @property
    def max_id(self) -> int:
        return int(np.iinfo(self.dtype).max)


UINT16 = TokenWidth("uint16", np.dtype("<u2"), 20240520, 1)
UINT32 = TokenWidth("uint32", np.dtype("<u4"), 20240801, 7)
WIDTHS = {w.magic: w for w in (UINT16, UINT32)}


class ShardError(ValueError):
    """A token shard is malformed, or a set of shards does not belong together; the message
    names the file."""


def width_for_vocab(vocab_size: int) -> TokenWidth:
    """uint16 while every id fits (byte-compatible with nanoGPT's shards), else uint32."""
    return UINT16 if vocab_size <= UINT16.max_id + 1 else UINT32


def _header(width: TokenWidth, count: int) -> bytes:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = width.magic, width.version, count
    return header.tobytes()


def _checked(path, tokens: np.ndarray, width: TokenWidth) -> np.ndarray:
    if tokens.size and (tokens.min() < 0 or tokens.max() > width.max_id):
        raise ShardError(
            f"{path}: token ids must lie in [0, {width.max_id}] to fit {width.name} shards"
        )
    return tokens.astype(width.dtype, copy=False)


def write_shard(path: str | os.PathLike, tokens: np.ndarray, width: TokenWidth = UINT16) -> None:
    """Write `tokens` (any integer array) as one shard of `width`, atomically."""
    path = Path(path)
    tokens = _checked(path, np.asarray(tokens), width)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(_header(width, tokens.size))
        f.write(tokens.tobytes())
    os.replace(tmp, path)


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    count: int  # tokens in the shard
    width: TokenWidth


def read_header(path: str | os.PathLike) -> ShardInfo:
    """Validate a shard's header against its size; return its token count and width."""
    path = Path(path)
    if not path.is_file():
        raise ShardError(f"{path}: shard not found")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    width = WIDTHS.get(int(header[0]))
    if width is None:
        known = ", ".join(f"{w.magic} ({w.name})" for w in WIDTHS.values())
        raise ShardError(f"{path}: bad magic {header[0]} (expected {known}); not a token shard")
    if header[1] != width.version:
        raise ShardError(
            f"{path}: unsupported version {header[1]} for {width.name} shards (expected "
            f"{width.version})"
        )
    count = int(header[2])
    expected = HEADER_BYTES + count * width.dtype.itemsize
    if count < 0 or size != expected:
        raise ShardError(
            f"{path}: header says {count} {width.name} tokens ({expected} bytes) but the file "
            f"has {size} bytes"
        )
    return ShardInfo(count, width)


def common_width(paths: list[str], infos: list[ShardInfo]) -> TokenWidth:
    """The one width of a set of shards; ShardError naming one shard of each width if mixed."""
    first = {}
    for path, info in zip(paths, infos, strict=True):
        first.setdefault(info.width.name, path)
    if len(first) > 1:
        named = "; ".join(f"{p} is {w}" for w, p in first.items())
        raise ShardError(
            f"the shards mix token widths ({named}): a run reads one corpus, tokenised once; "
            "prepare them again with one tokenizer"
        )
    return infos[0].width


def load_tokens(path: str | os.PathLike) -> np.ndarray:
    """A validated shard's tokens as a read-only memmap of its width."""
    info = read_header(path)
    return np.memmap(
        path, dtype=info.width.dtype, mode="r", offset=HEADER_BYTES, shape=(info.count,)
    )


def expand_shards(pattern: str | list[str]) -> list[str]:
    """Shard paths from a glob (or list of globs), sorted; an empty match is an error."""
    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    paths: list[str] = []
    for p in patterns:
        matched = sorted(glob.glob(os.path.expanduser(p)))
        if not matched:
            raise ShardError(f"no token shards match {p!r}")
        paths.extend(matched)
    return paths


class ShardWriter:
    """Writes `prefix_000000.bin`, `prefix_000001.bin`, ... of `shard_tokens` tokens each,
    streaming: tokens go to the open shard's file as they come, and its header is written when
    it is full (or at `close`), so memory does not grow with the shard. Each shard is written
    beside its name and renamed into place whole."""

    def __init__(self, out_dir: Path, prefix: str, shard_tokens: int, width: TokenWidth):
        if not 0 < shard_tokens <= MAX_SHARD_TOKENS:
            raise ValueError(f"shard_tokens must be in [1, {MAX_SHARD_TOKENS}]: {shard_tokens}")
        self.out_dir, self.prefix = Path(out_dir), prefix
        self.shard_tokens, self.width = shard_tokens, width
        self.total = 0  # tokens written, all shards
        self.paths: list[str] = []
        self._file = None  # the open shard
        self._count = 0  # tokens in it

    def name(self, index: int) -> str:
        return f"{self.prefix}_{index:06d}.bin"

    def add(self, tokens: np.ndarray) -> None:
        tokens = _checked(self.out_dir / self.name(len(self.paths)), np.asarray(tokens), self.width)
        while tokens.size:
            if self._file is None:
                self._open()
            take = tokens[: self.shard_tokens - self._count]
            self._file.write(take.tobytes())
            self._count += take.size
            self.total += take.size
            tokens = tokens[take.size :]
            if self._count == self.shard_tokens:
                self._finish()

    def close(self) -> None:
        if self._file is not None:
            self._finish()

    def abandon(self) -> None:
        """Remove the shard being written (the run that fed it failed)."""
        if self._file is not None:
            self._file.close()
            self._tmp.unlink(missing_ok=True)
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        self.abandon() if kind else self.close()

    def _open(self) -> None:
        path = self.out_dir / self.name(len(self.paths))
        self._tmp = path.with_name(path.name + ".tmp")
        self._file = open(self._tmp, "wb")
        self._file.write(_header(self.width, 0))  # the count is written when the shard is done
        self._count = 0

    def _finish(self) -> None:
        self._file.seek(0)
        self._file.write(_header(self.width, self._count))
        self._file.close()
        self._file = None
        path = self.out_dir / self.name(len(self.paths))
        os.replace(self._tmp, path)
        self.paths.append(str(path))
