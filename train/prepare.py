"""Tokenise a corpus into token shards.

    python -m train.prepare DATA... --out DIR [--tokenizer tokenizer.json|FOLDER | --vocab-size N]

DATA: files, folders or globs, in any format train/documents.py reads: text, JSON lines
(`--text-key`), either one gzip- or zstd-compressed; Parquet; Arrow; a `datasets.save_to_disk`
folder (`--split`).
Every document is preceded by the end-of-text token (GPT-2's convention), which the tokenizer names
(laplace_spec/tokenizer_files.py's rule, or `--eot-token`). With `--tokenizer` the given Hugging
Face `tokenizer.json`, or tokenizer folder, is used (for the 3B recipe: GPT-2's, 50,257 tokens,
which the model pads to 50,304); without it a byte-level BPE of `--vocab-size` tokens (a multiple
of 64) is trained on the data first. Shards hold uint16 tokens while the vocabulary fits, uint32
beyond 65,536 ids (train/shards.py). Every `--val-every`-th document goes to the validation
split. `--min-doc-tokens N` keeps only documents of at least N tokens (the end-of-text token not
counted): data for long-context training, whose sequences should hold long documents
(train/doc_context.py). The corpus is streamed: memory does not grow with it. Output:
DIR/train_000000.bin ..., DIR/val_000000.bin ..., DIR/tokenizer.json (and the tokenizer folder's
companion files), DIR/meta.json (counts, the token width, the end-of-text id, and each split's
document lengths: quantiles and the share of tokens in documents of at least 1k, 8k and 64k
tokens).
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import sys
from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from train.doc_context import length_summary
from train.documents import CorpusError, expand_inputs, iter_documents
from train.shards import ShardWriter, TokenWidth, width_for_vocab
from train.tokenizer_source import copy_companions, document_separator, load_tokenizer, train_bpe

BATCH_DOCS = 256  # documents a tokenising task takes at most
BATCH_CHARS = 1_000_000  # and characters (a longer document is a task of its own)
IN_FLIGHT_PER_WORKER = 2  # tasks queued per worker: what bounds the memory of a parallel run


# ---- tokenising and writing shards ----------------------------------------------------------

_WORKER_TOK = None


def _worker_init(tokenizer_json: str):
    global _WORKER_TOK
    from tokenizers import Tokenizer

    _WORKER_TOK = Tokenizer.from_str(tokenizer_json)


def _encode_docs(docs: list[str], tokenizer, eot: int, width: TokenWidth) -> list[np.ndarray]:
    encs = tokenizer.encode_batch_fast(docs, add_special_tokens=False)  # ids only, no offsets
    return [np.array([eot, *e.ids], dtype=width.dtype) for e in encs]


def _worker_encode(args):
    docs, eot, width = args
    return _encode_docs(docs, _WORKER_TOK, eot, width)


def _batched(docs: Iterable[str], max_docs: int, max_chars: int) -> Iterator[list[str]]:
    """Documents in batches of at most `max_docs` documents and (but for a longer document
    alone) `max_chars` characters: what one tokenising task holds."""
    batch: list[str] = []
    chars = 0
    for doc in docs:
        if batch and (len(batch) == max_docs or chars + len(doc) > max_chars):
            yield batch
            batch, chars = [], 0
        batch.append(doc)
        chars += len(doc)
    if batch:
        yield batch


def encoded(batches: Iterator[list[str]], tokenizer, eot: int, width: TokenWidth, workers: int):
    """Each batch of documents as token arrays [eot, the document's tokens], in order: in this
    process, or in `workers` processes with at most IN_FLIGHT_PER_WORKER batches each queued, so
    that reading never runs ahead of tokenising by more than that."""
    if workers <= 1:
        for b in batches:
            yield _encode_docs(b, tokenizer, eot, width)
        return
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_worker_init, initargs=(tokenizer.to_str(),)) as pool:
        pending: collections.deque = collections.deque()
        for b in batches:
            pending.append(pool.apply_async(_worker_encode, ((b, eot, width),)))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def prepare(
    inputs: list[str],
    out_dir: str | os.PathLike,
    tokenizer_path: str | None = None,
    vocab_size: int = 8_192,
    val_every: int = 50,
    shard_tokens: int = 100_000_000,
    workers: int = 1,
    text_key: str = "text",
    eot_token: str | None = None,
    progress: bool = True,
    min_doc_tokens: int = 0,
    split: str = "train",
    encoding_errors: str = "strict",
) -> dict:
    """Tokenise `inputs` into shards under `out_dir`; return the summary saved as meta.json.

    `eot_token`: the document separator (None: the tokenizer's end-of-text token by the rule of
    laplace_spec/tokenizer_files.py). `split`: the split of a saved DatasetDict.
    `encoding_errors`: how undecodable bytes of a text file are handled ("strict": an error naming
    the file; the embedded corpus, whose few non-UTF-8 test files are so on purpose, uses
    "replace"). A failure leaves no shard of this run behind."""
    if min_doc_tokens < 0:
        raise ValueError(f"min_doc_tokens must be >= 0, got {min_doc_tokens}")
    out = Path(out_dir)
    if (out / "meta.json").exists() or any(out.glob("*_000000.bin")):
        raise ValueError(f"{out} already holds prepared shards: choose a new --out, or empty it")
    out.mkdir(parents=True, exist_ok=True)

    def documents():
        return iter_documents(inputs, text_key, split, encoding_errors)

    if tokenizer_path:
        tok = load_tokenizer(tokenizer_path)
    else:
        if progress:
            print(f"training a byte-level BPE of {vocab_size} tokens on {len(inputs)} input(s)")
        tok = train_bpe(documents(), vocab_size, show_progress=progress)
    eot_name, eot = document_separator(tok, tokenizer_path, eot_token)
    width = width_for_vocab(tok.get_vocab_size())

    writers = {s: ShardWriter(out, s, shard_tokens, width) for s in ("train", "val")}
    docs = {"train": 0, "val": 0}
    lengths = {"train": array("q"), "val": array("q")}  # tokens of each kept document
    dropped = 0
    bar = tqdm(desc="tokenising", unit="tok", unit_scale=True, disable=not progress)
    doc_index = 0
    try:
        batches = _batched(documents(), BATCH_DOCS, BATCH_CHARS)
        for arrays in encoded(batches, tok, eot, width, workers):
            for a in arrays:  # a: [eot, the document's tokens]
                bar.update(a.size)
                if a.size - 1 < min_doc_tokens:
                    dropped += 1
                    continue
                held_out = val_every and doc_index % val_every == val_every - 1
                name = "val" if held_out else "train"
                writers[name].add(a)
                docs[name] += 1
                lengths[name].append(a.size - 1)
                doc_index += 1
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():
            w.abandon()
            for path in w.paths:
                Path(path).unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    tok.save(str(out / "tokenizer.json"))
    if tokenizer_path:
        copy_companions(tokenizer_path, out)
    meta = {
        "inputs": len(inputs),
        "vocab_size": tok.get_vocab_size(),
        "token_width": width.name,
        "eot_id": eot,
        "eot_token": eot_name,
        "tokenizer": str(tokenizer_path) if tokenizer_path else "trained byte-level BPE",
        "train_tokens": writers["train"].total,
        "val_tokens": writers["val"].total,
        "train_docs": docs["train"],
        "val_docs": docs["val"],
        "min_doc_tokens": min_doc_tokens,
        "dropped_docs": dropped,
        "doc_tokens": {name: length_summary(n) for name, n in lengths.items()},
        "train_shards": [Path(p).name for p in writers["train"].paths],
        "val_shards": [Path(p).name for p in writers["val"].paths],
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m train.prepare", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "inputs",
        nargs="+",
        help="files, folders or globs: text, JSON lines (either .gz or .zst too), Parquet, Arrow, "
        "a datasets.save_to_disk folder",
    )
    ap.add_argument("--out", required=True, help="output directory for shards and tokenizer")
    ap.add_argument(
        "--tokenizer",
        help="a Hugging Face tokenizer.json, or a local tokenizer folder holding one (default: "
        "train a byte-level BPE)",
    )
    ap.add_argument("--vocab-size", type=int, default=8_192, help="BPE size when training one")
    ap.add_argument("--val-every", type=int, default=50, help="every N-th document -> val")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard")
    ap.add_argument("--workers", type=int, default=1, help="tokenising processes")
    ap.add_argument("--text-key", default="text", help="the text field of a row-format input")
    ap.add_argument("--split", default="train", help="the split of a saved DatasetDict")
    ap.add_argument(
        "--eot-token",
        help="the document separator (default: the tokenizer's end-of-text token: "
        "tokenizer_config.json's eos_token, else <|endoftext|>, <|end_of_text|>, </s>, <eos>)",
    )
    ap.add_argument(
        "--min-doc-tokens",
        type=int,
        default=0,
        help="keep only documents of at least N tokens (long-context data)",
    )
    args = ap.parse_args(argv)
    if args.min_doc_tokens < 0:
        ap.error(f"--min-doc-tokens must be >= 0, got {args.min_doc_tokens}")
    try:
        meta = prepare(
            expand_inputs(args.inputs),
            args.out,
            tokenizer_path=args.tokenizer,
            vocab_size=args.vocab_size,
            val_every=args.val_every,
            shard_tokens=args.shard_tokens,
            workers=args.workers,
            text_key=args.text_key,
            eot_token=args.eot_token,
            min_doc_tokens=args.min_doc_tokens,
            split=args.split,
        )
    except (CorpusError, FileNotFoundError, ValueError) as e:  # what the user can fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(meta, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
