"""Token shards and the grain pipeline that feeds the training step.

Shard format (nanoGPT / modded-nanogpt, e.g. the published FineWeb-Edu GPT-2 shards):
a header of 256 little-endian int32 -- magic 20240520, version 1, token count -- followed by
that many uint16 tokens. Every shard is validated when opened; errors name the file.

The pipeline: all shards are cut into fixed windows of seq_len + 1 tokens (inputs and shifted
targets), the windows are split by process, shuffled by seed (a fresh permutation every epoch),
and batched. The iterator's state is a small dict saved in every checkpoint, so a resumed run
continues on exactly the next batch.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import grain
import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")  # uint16: vocabularies up to 65,536 tokens


class ShardError(ValueError):
    """A token shard is malformed; the message names the file."""


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write `tokens` (any integer array, values < 65,536) as one shard, atomically."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(TOKEN_DTYPE).max):
        raise ShardError(f"{path}: token ids must lie in [0, 65535] to fit uint16")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, tokens.size
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(TOKEN_DTYPE).tobytes())
    os.replace(tmp, path)


def read_header(path: str | os.PathLike) -> int:
    """Validate a shard's header against its size; return its token count."""
    path = Path(path)
    if not path.is_file():
        raise ShardError(f"{path}: shard not found")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != MAGIC:
        raise ShardError(f"{path}: bad magic {header[0]} (expected {MAGIC}); not a token shard")
    if header[1] != VERSION:
        raise ShardError(f"{path}: unsupported version {header[1]} (expected {VERSION})")
    count = int(header[2])
    expected = HEADER_BYTES + count * TOKEN_DTYPE.itemsize
    if count < 0 or size != expected:
        raise ShardError(
            f"{path}: header says {count} tokens ({expected} bytes) but the file has {size} bytes"
        )
    return count


def load_tokens(path: str | os.PathLike) -> np.ndarray:
    """A validated shard's tokens as a read-only uint16 memmap."""
    count = read_header(path)
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(count,))


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


class TokenWindows:
    """grain random-access source: window i is tokens [i*T, i*T + T + 1) of the shard stream.

    Windows never cross a shard boundary; consecutive windows overlap by one token so that
    every token is a target exactly once.
    """

    def __init__(self, paths: list[str], seq_len: int):
        if not paths:
            raise ShardError("no token shards given")
        self.paths = list(paths)
        self.seq_len = seq_len
        counts = np.array([read_header(p) for p in self.paths], dtype=np.int64)
        self._windows = np.maximum(counts - 1, 0) // seq_len
        self._starts = np.concatenate([[0], np.cumsum(self._windows)])
        if self._starts[-1] == 0:
            raise ShardError(
                f"{len(paths)} shard(s) ({', '.join(self.paths[:3])}...) hold {counts.sum()} "
                f"tokens, fewer than one window of seq_len + 1 = {seq_len + 1}"
            )
        self.num_tokens = int(counts.sum())
        self._tokens: list[np.ndarray | None] = [None] * len(self.paths)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(index)
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        if self._tokens[shard] is None:  # opened lazily: cheap for hundreds of shards
            self._tokens[shard] = load_tokens(self.paths[shard])
        start = (index - int(self._starts[shard])) * self.seq_len
        return np.asarray(self._tokens[shard][start : start + self.seq_len + 1], dtype=np.int32)

    def __repr__(self) -> str:
        return f"TokenWindows({len(self.paths)} shards, {len(self)} windows of {self.seq_len}+1)"


def train_dataset(
    source: TokenWindows,
    batch_size: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.MapDataset:
    """Endless shuffled batches [batch_size, seq_len + 1] of this process's windows."""
    ds = grain.MapDataset.source(source)
    if process_count > 1:
        ds = ds[process_index::process_count]
    if len(ds) < batch_size:
        raise ShardError(
            f"{source!r}: {len(ds)} windows on process {process_index}, fewer than one batch "
            f"of {batch_size}"
        )
    # shuffle before repeat: grain draws a fresh permutation for every epoch
    return ds.shuffle(seed=seed).repeat(None).batch(batch_size, drop_remainder=True)


def eval_batches(
    source: TokenWindows,
    batch_size: int,
    num_batches: int,
    process_index: int = 0,
    process_count: int = 1,
) -> list[np.ndarray]:
    """The first `num_batches` batches of the validation windows, in order (a fixed set)."""
    ds = grain.MapDataset.source(source)
    if process_count > 1:
        ds = ds[process_index::process_count]
    ds = ds.batch(batch_size, drop_remainder=True)
    return [ds[i] for i in range(min(num_batches, len(ds)))]


class BatchIterator:
    """Global-step batches for this process, shaped [accum, micro_local, seq_len + 1].

    Wraps a grain DatasetIterator; `get_state`/`set_state` give the dict stored in checkpoints.
    """

    def __init__(self, dataset: grain.MapDataset, accum_steps: int):
        self._iter = dataset.to_iter_dataset().__iter__()
        self.accum_steps = accum_steps

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        batch = next(self._iter)  # [B_local, T + 1]
        return batch.reshape(self.accum_steps, -1, batch.shape[-1])

    def get_state(self) -> dict:
        return dict(self._iter.get_state())

    def set_state(self, state: dict) -> None:
        if "task" in state:  # train/tasks.py's state: the checkpoint trained on a synthetic task
            raise ValueError(
                f"the checkpoint's data is task {state['task']} {state.get('params', '')}, not "
                "token shards: resume it with the same --task, or start a new run directory"
            )
        self._iter.set_state(dict(state))
