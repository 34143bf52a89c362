"""`python -m bench.prepare_memory`: the resident memory of `train.prepare` on a large corpus.

Writes a JSON-lines corpus of `--gigabytes` (default 1 GB): the standard library's source files,
one row each, repeated with their row number prepended, so no two rows are equal. Then runs

    python -m train.prepare CORPUS.jsonl --out DIR --tokenizer TOKENIZER --workers 2

as a user would (the embedded corpus's BPE of 8,192 tokens as the tokenizer), sampling the resident
memory (RSS) of the command's whole process tree (the parent, its worker processes, anything they
start) every 0.1 s with psutil. Writes bench/results/prepare_memory.json: the peak of the tree's
total, the parent's and the largest worker's peak, the corpus's bytes and tokens, the wall time.
The corpus and the shards go to a temporary folder (`--tmp`, by default the system's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import write_result


def write_corpus(path: Path, gigabytes: float) -> tuple[int, int]:
    """(bytes, rows) of a JSON-lines corpus of about `gigabytes` GB at `path`."""
    from train.corpus import stdlib_files

    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in stdlib_files()]
    target, written, rows = int(gigabytes * 1e9), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            for text in texts:
                line = json.dumps({"text": f"# {rows}\n{text}"}) + "\n"
                f.write(line)
                written += len(line.encode())
                rows += 1
                if written >= target:
                    break
    return written, rows


def sample_tree(proc, samples: list, stop: threading.Event) -> None:
    """Append (total, parent, largest child) RSS bytes of `proc`'s tree every 0.1 s."""
    import psutil

    root = psutil.Process(proc.pid)
    while not stop.is_set():
        try:
            members = [root, *root.children(recursive=True)]
            rss = []
            for p in members:
                try:
                    rss.append(p.memory_info().rss)
                except psutil.NoSuchProcess:
                    rss.append(0)
            samples.append((sum(rss), rss[0], max(rss[1:], default=0), len(members) - 1))
        except psutil.NoSuchProcess:
            break
        stop.wait(0.1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.prepare_memory", description=__doc__)
    ap.add_argument("--gigabytes", type=float, default=1.0, help="corpus size")
    ap.add_argument("--workers", type=int, default=2, help="train.prepare --workers")
    ap.add_argument("--tmp", default=None, help="folder for the corpus and the shards")
    args = ap.parse_args(argv)
    from train.corpus import ensure_default_corpus

    tokenizer = ensure_default_corpus(8_192, progress=False) / "tokenizer.json"
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        size, rows = write_corpus(corpus, args.gigabytes)
        print(f"corpus: {size / 1e9:.3f} GB, {rows:,} rows")
        command = [
            sys.executable, "-m", "train.prepare", str(corpus), "--out", str(Path(tmp) / "out"),
            "--tokenizer", str(tokenizer), "--workers", str(args.workers),
        ]  # fmt: skip
        samples: list = []
        stop = threading.Event()
        t0 = time.perf_counter()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        watcher = threading.Thread(target=sample_tree, args=(proc, samples, stop))
        watcher.start()
        out, err = proc.communicate()
        seconds = time.perf_counter() - t0
        stop.set()
        watcher.join()
        if proc.returncode:
            raise SystemExit(f"error: train.prepare exited {proc.returncode}:\n{err[-3000:]}")
        meta = json.loads((Path(tmp) / "out" / "meta.json").read_text())
    mib = 1024**2
    headline = {
        "peak_rss_mib_total": round(max(s[0] for s in samples) / mib, 1),
        "peak_rss_mib_parent": round(max(s[1] for s in samples) / mib, 1),
        "peak_rss_mib_largest_worker": round(max(s[2] for s in samples) / mib, 1),
        "corpus_gb": round(size / 1e9, 3),
        "workers": args.workers,
    }
    path = write_result(
        "prepare_memory",
        headline,
        command="python -m train.prepare CORPUS.jsonl --out DIR --tokenizer TOKENIZER "
        f"--workers {args.workers}",
        corpus_rows=rows,
        tokens=meta["train_tokens"] + meta["val_tokens"],
        wall_s=round(seconds, 1),
        samples=len(samples),
        processes_max=max(s[3] for s in samples) + 1,
        notes="RSS of the command's whole process tree, sampled every 0.1 s with psutil; the "
        "tokenizer is the embedded corpus's byte-level BPE of 8,192 tokens",
    )
    print(json.dumps(headline), path, sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
