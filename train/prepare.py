"""Tokenise text, JSONL or Parquet into nanoGPT-format token shards.

    python -m train.prepare DATA... --out DIR [--tokenizer tokenizer.json | --vocab-size N]

Every document is preceded by the end-of-text token (GPT-2's convention). With `--tokenizer`
the given Hugging Face `tokenizer.json` is used (for the 3B recipe: GPT-2's, 50,257 tokens,
which the model pads to 50,304); without it a byte-level BPE of `--vocab-size` tokens (a multiple
of 64) is trained on the data first. Every `--val-every`-th document goes to the validation
split. `--min-doc-tokens N` keeps only documents of at least N tokens (the end-of-text token not
counted): data for long-context training, whose sequences should hold long documents
(train/doc_context.py). Output: DIR/train_000000.bin ..., DIR/val_000000.bin ...,
DIR/tokenizer.json, DIR/meta.json (counts, and each split's document lengths: quantiles and the
share of tokens in documents of at least 1k, 8k and 64k tokens).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from train.data import TOKEN_DTYPE, write_shard
from train.doc_context import length_summary

EOT = "<|endoftext|>"
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".text")


# ---- reading documents ----------------------------------------------------------------------


def iter_documents(paths: Iterable[str], text_key: str = "text") -> Iterator[str]:
    """Documents from files: a text file is one document; JSONL and Parquet one per row."""
    for path in paths:
        p = Path(path)
        name = p.name.lower()
        if name.endswith((".jsonl", ".json")):
            with open(p, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    row = json.loads(line)
                    if text_key not in row:
                        raise KeyError(f"{p}:{lineno}: no field {text_key!r}")
                    yield row[text_key]
        elif name.endswith(".parquet"):
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(p)
            if text_key not in pf.schema_arrow.names:
                raise KeyError(f"{p}: no column {text_key!r} (columns: {pf.schema_arrow.names})")
            for batch in pf.iter_batches(columns=[text_key], batch_size=1024):
                yield from (t for t in batch.column(0).to_pylist() if t)
        else:
            yield p.read_text(encoding="utf-8", errors="replace")


def expand_inputs(items: Iterable[str]) -> list[str]:
    """Files, directories (searched recursively for known suffixes) and globs, sorted."""
    import glob

    out: list[str] = []
    for item in items:
        if os.path.isdir(item):
            for suffix in (*TEXT_SUFFIXES, ".jsonl", ".parquet"):
                out.extend(glob.glob(os.path.join(item, "**", "*" + suffix), recursive=True))
        else:
            matched = glob.glob(item, recursive=True)
            if not matched:
                raise FileNotFoundError(f"no input files match {item!r}")
            out.extend(matched)
    return sorted(set(out))


# ---- tokenizer ------------------------------------------------------------------------------


def train_bpe(documents: Iterable[str], vocab_size: int, show_progress: bool = True):
    """A byte-level BPE (GPT-2 style pre-tokenisation) with EOT as its only special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size % 64 or vocab_size > 65_536:
        raise ValueError(f"vocab_size must be a multiple of 64 and at most 65,536: {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return tok


def load_tokenizer(path: str | os.PathLike):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def eot_id(tokenizer, eot_token: str = EOT) -> int:
    i = tokenizer.token_to_id(eot_token)
    if i is None:
        raise ValueError(f"tokenizer has no end-of-text token {eot_token!r}; pass --eot-token")
    return i


# ---- tokenising and writing shards ----------------------------------------------------------

_WORKER_TOK = None


def _worker_init(tokenizer_json: str):
    global _WORKER_TOK
    from tokenizers import Tokenizer

    _WORKER_TOK = Tokenizer.from_str(tokenizer_json)


def _encode_docs(docs: list[str], tokenizer, eot: int) -> list[np.ndarray]:
    encs = tokenizer.encode_batch(docs, add_special_tokens=False)
    return [np.array([eot, *e.ids], dtype=TOKEN_DTYPE) for e in encs]


def _worker_encode(args):
    docs, eot = args
    return _encode_docs(docs, _WORKER_TOK, eot)


class ShardWriter:
    """Accumulates tokens and writes `prefix_000000.bin`, ... of `shard_tokens` each."""

    def __init__(self, out_dir: Path, prefix: str, shard_tokens: int):
        self.out_dir, self.prefix, self.shard_tokens = out_dir, prefix, shard_tokens
        self.buf: list[np.ndarray] = []
        self.n_buf = 0
        self.index = 0
        self.total = 0
        self.paths: list[str] = []

    def add(self, tokens: np.ndarray):
        self.buf.append(tokens)
        self.n_buf += tokens.size
        self.total += tokens.size
        while self.n_buf >= self.shard_tokens:
            flat = np.concatenate(self.buf)
            self._write(flat[: self.shard_tokens])
            rest = flat[self.shard_tokens :]
            self.buf, self.n_buf = [rest], rest.size

    def close(self):
        if self.n_buf:
            self._write(np.concatenate(self.buf))
        self.buf, self.n_buf = [], 0

    def _write(self, tokens):
        path = self.out_dir / f"{self.prefix}_{self.index:06d}.bin"
        write_shard(path, tokens)
        self.paths.append(str(path))
        self.index += 1


def _batched(it: Iterable[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def prepare(
    inputs: list[str],
    out_dir: str | os.PathLike,
    tokenizer_path: str | None = None,
    vocab_size: int = 8_192,
    val_every: int = 50,
    shard_tokens: int = 100_000_000,
    workers: int = 1,
    text_key: str = "text",
    eot_token: str = EOT,
    progress: bool = True,
    min_doc_tokens: int = 0,
) -> dict:
    """Tokenise `inputs` into shards under `out_dir`; return the summary saved as meta.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_path:
        tok = load_tokenizer(tokenizer_path)
    else:
        if progress:
            print(f"training a byte-level BPE of {vocab_size} tokens on {len(inputs)} file(s)")
        tok = train_bpe(iter_documents(inputs, text_key), vocab_size, show_progress=progress)
    if tok.get_vocab_size() > 65_536:
        raise ValueError("tokenizer has more than 65,536 tokens: ids do not fit uint16 shards")
    tok.save(str(out / "tokenizer.json"))
    eot = eot_id(tok, eot_token)

    if min_doc_tokens < 0:
        raise ValueError(f"min_doc_tokens must be >= 0, got {min_doc_tokens}")
    writers = {s: ShardWriter(out, s, shard_tokens) for s in ("train", "val")}
    docs = {"train": 0, "val": 0}
    lengths: dict[str, list[int]] = {"train": [], "val": []}  # tokens of each kept document
    dropped = 0
    batches = _batched(iter_documents(inputs, text_key), 256)
    bar = tqdm(desc="tokenising", unit="tok", unit_scale=True, disable=not progress)
    doc_index = 0

    def consume(arrays):
        nonlocal doc_index, dropped
        for a in arrays:  # a: [eot, the document's tokens]
            bar.update(a.size)
            if a.size - 1 < min_doc_tokens:
                dropped += 1
                continue
            split = "val" if val_every and doc_index % val_every == val_every - 1 else "train"
            writers[split].add(a)
            docs[split] += 1
            lengths[split].append(a.size - 1)
            doc_index += 1

    if workers > 1:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(workers, initializer=_worker_init, initargs=(tok.to_str(),)) as pool:
            for arrays in pool.imap(_worker_encode, ((b, eot) for b in batches)):
                consume(arrays)
    else:
        for b in batches:
            consume(_encode_docs(b, tok, eot))
    bar.close()
    for w in writers.values():
        w.close()
    meta = {
        "inputs": len(inputs),
        "vocab_size": tok.get_vocab_size(),
        "eot_id": eot,
        "tokenizer": str(tokenizer_path) if tokenizer_path else "trained byte-level BPE",
        "train_tokens": writers["train"].total,
        "val_tokens": writers["val"].total,
        "train_docs": docs["train"],
        "val_docs": docs["val"],
        "min_doc_tokens": min_doc_tokens,
        "dropped_docs": dropped,
        "doc_tokens": {split: length_summary(n) for split, n in lengths.items()},
        "train_shards": [Path(p).name for p in writers["train"].paths],
        "val_shards": [Path(p).name for p in writers["val"].paths],
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m train.prepare", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("inputs", nargs="+", help="text/JSONL/Parquet files, directories or globs")
    ap.add_argument("--out", required=True, help="output directory for shards and tokenizer")
    ap.add_argument("--tokenizer", help="HF tokenizer.json (default: train a byte-level BPE)")
    ap.add_argument("--vocab-size", type=int, default=8_192, help="BPE size when training one")
    ap.add_argument("--val-every", type=int, default=50, help="every N-th document -> val")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard")
    ap.add_argument("--workers", type=int, default=1, help="tokenising processes")
    ap.add_argument("--text-key", default="text", help="JSONL field / Parquet column")
    ap.add_argument("--eot-token", default=EOT, help="document separator token")
    ap.add_argument(
        "--min-doc-tokens",
        type=int,
        default=0,
        help="keep only documents of at least N tokens (long-context data)",
    )
    args = ap.parse_args(argv)
    if args.min_doc_tokens < 0:
        ap.error(f"--min-doc-tokens must be >= 0, got {args.min_doc_tokens}")
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
    )
    print(json.dumps(meta, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
