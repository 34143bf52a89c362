"""The embedded default corpus: the running interpreter's standard-library source.

No download is possible at run time, so the default run trains on text every machine has: the
`.py` files of the Python standard library (about 30 MB for CPython 3.11; real text nobody here
wrote). A byte-level BPE of the model's vocabulary size is trained on it, every 50th file is held
out for validation, and the shards are cached (under `$LAPLACE_CACHE_DIR`, default `.cache/` in the
repository) so only the first run pays for it.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from train.prepare import prepare
from train.shards import expand_shards

REPO_ROOT = Path(__file__).resolve().parent.parent


def stdlib_files() -> list[str]:
    """The standard library's .py files (site-packages excluded), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        str(p) for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()
    )


def cache_root() -> Path:
    env = os.environ.get("LAPLACE_CACHE_DIR")
    return Path(env) if env else REPO_ROOT / ".cache"


def default_corpus_dir(vocab_size: int) -> Path:
    v = sys.version_info
    return cache_root() / f"stdlib-py{v.major}.{v.minor}.{v.micro}-bpe{vocab_size}"


def ensure_default_corpus(vocab_size: int, progress: bool = True) -> Path:
    """Build (once) and return the directory holding train_*.bin, val_*.bin, tokenizer.json."""
    out = default_corpus_dir(vocab_size)
    if (out / "meta.json").is_file():
        return out
    files = stdlib_files()
    if progress:
        print(f"building the default corpus from {len(files)} stdlib files into {out} (once)")
    out.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: a killed or concurrent build never leaves half a corpus
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        # a few of the standard library's test files are Latin-1 or KOI8-R on purpose: their
        # undecodable bytes become U+FFFD
        prepare(
            files,
            tmp,
            vocab_size=vocab_size,
            val_every=50,
            progress=progress,
            encoding_errors="replace",
        )
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished first
            if not (out / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def default_data(vocab_size: int, progress: bool = True) -> tuple[list[str], list[str], Path]:
    """(train shards, val shards, tokenizer.json) of the default corpus."""
    d = ensure_default_corpus(vocab_size, progress)
    return (
        expand_shards(str(d / "train_*.bin")),
        expand_shards(str(d / "val_*.bin")),
        (d / "tokenizer.json"),
    )
