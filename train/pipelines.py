"""Where a run's batches come from: token shards (`--data`, or the default corpus) through grain,
or a synthetic task (`--task`, train/tasks.py), each process reading its own share; and the
end-of-text id of packed documents (`doc_reset`)."""

from __future__ import annotations

import json
from pathlib import Path

import jax

from laplace_spec.config import ConfigError
from train.config import RunConfigs


def open_data(args, model_cfg, main_proc: bool, say=print):
    """(training shard paths, validation shard paths, tokenizer.json or None), checked: the
    tokenizer is `--tokenizer` (a tokenizer.json or a tokenizer folder), else the tokenizer.json
    that train.prepare wrote beside the shards (a note says so); its vocabulary, or the shards'
    meta.json's, must fit the model's."""
    from train.shards import expand_shards
    from train.tokenizer_source import tokenizer_folder

    if args.data:
        train_paths = expand_shards(args.data)
        val_paths = expand_shards(args.val_data) if args.val_data else []
        tokenizer_src = None
        if args.tokenizer:
            try:
                tokenizer_src = tokenizer_folder(args.tokenizer)[0]
            except ValueError as e:
                raise ConfigError(f"--tokenizer: {e}") from e
        elif (Path(train_paths[0]).parent / "tokenizer.json").is_file():
            tokenizer_src = Path(train_paths[0]).parent / "tokenizer.json"
            say(f"note: the tokenizer is {tokenizer_src}, beside the shards; set --tokenizer")
    else:
        from train.corpus import default_data

        train_paths, val_paths, tokenizer_src = default_data(model_cfg.vocab_size, main_proc)
    sizes = []  # (what, its vocabulary size)
    if tokenizer_src is not None:
        from tokenizers import Tokenizer

        n = Tokenizer.from_file(str(tokenizer_src)).get_vocab_size()
        sizes.append((f"tokenizer {tokenizer_src}", n))
    meta = shards_meta(train_paths)
    if "vocab_size" in meta:
        where = Path(train_paths[0]).parent / "meta.json"
        sizes.append((f"the shards' tokenizer ({where})", int(meta["vocab_size"])))
    for what, n in sizes:
        if n > model_cfg.vocab_size:
            raise ConfigError(
                f"{what} has {n:,} tokens, more than the model's vocab_size "
                f"{model_cfg.vocab_size:,}: set vocab_size={-(-n // 64) * 64} (a multiple of 64)"
            )
    return train_paths, val_paths, tokenizer_src


def shards_meta(train_paths) -> dict:
    """The meta.json train.prepare wrote beside the first training shard, or {}."""
    if not train_paths:
        return {}
    try:
        return json.loads((Path(train_paths[0]).parent / "meta.json").read_text())
    except (OSError, ValueError):
        return {}


def build_pipeline(cfg: RunConfigs, layout, train_paths, val_paths):
    """(training BatchIterator, validation batches, training tokens) of this process."""
    from train import data as data_lib

    B, A, M = layout
    proc, nproc = jax.process_index(), jax.process_count()
    train_src = data_lib.TokenWindows(train_paths, cfg.model.seq_len)
    dataset = data_lib.train_dataset(train_src, B // nproc, cfg.train.seed, proc, nproc)
    val_batches = []
    if val_paths:
        val_src = data_lib.TokenWindows(val_paths, cfg.model.seq_len)
        n = cfg.train.eval_batches
        val_batches = data_lib.eval_batches(val_src, M // nproc, n, proc, nproc)
    return data_lib.BatchIterator(dataset, A), val_batches, train_src.num_tokens


def task_pipeline(cfg: RunConfigs, layout, task):
    """(TaskBatches, no validation batches, tokens the run trains on) of this process."""
    from train import tasks

    B, A, M = layout
    proc, nproc = jax.process_index(), jax.process_count()
    try:
        batches = tasks.TaskBatches(
            task[0], task[1], cfg.model.seq_len, B // nproc, A, cfg.train.seed, proc
        )
    except tasks.TaskError as e:
        raise ConfigError(f"--task {task[0]}: {e}") from e
    return batches, [], cfg.train.steps * B * cfg.model.seq_len


def doc_reset_eot(train_cfg, train_paths, is_task: bool, say=print) -> int | None:
    """The end-of-text id the model resets its state after (TrainConfig doc_reset, eot_id), or
    None: no resets. An eot_id of -1 is read from meta.json beside the first training shard
    (train/prepare.py writes it; the default corpus has one)."""
    if train_cfg.doc_reset == "off" or is_task:  # task sequences are single documents
        return None
    eot = train_cfg.eot_id if train_cfg.eot_id >= 0 else shards_meta(train_paths).get("eot_id")
    if eot is None:
        if train_cfg.doc_reset == "on":
            raise ConfigError("doc_reset=on needs an EOT id: set eot_id=N (no meta.json eot_id)")
        return None
    say(f"note: document resets on: state zeroed after each end-of-text token (id {eot})")
    return int(eot)
