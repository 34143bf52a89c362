"""The grain pipeline that feeds the training step from token shards (train/shards.py: the
format, uint16 or uint32 tokens, validated when opened).

The pipeline: all shards are cut into fixed windows of seq_len + 1 tokens (inputs and shifted
targets), the windows are split by process, shuffled by seed (a fresh permutation every epoch),
and batched. The iterator's state is a small dict saved in every checkpoint, so a resumed run
continues on exactly the next batch.
"""

from __future__ import annotations

import grain
import numpy as np

from train.shards import ShardError, common_width, load_tokens, read_header


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
        infos = [read_header(p) for p in self.paths]
        self.width = common_width(self.paths, infos)  # a mixed set is refused
        counts = np.array([info.count for info in infos], dtype=np.int64)
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
