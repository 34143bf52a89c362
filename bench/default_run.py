"""`python -m bench.default_run`: the README's first command, timed as a new user meets it.

Runs `python -m train.main` with no arguments but a fresh run directory and a fresh corpus cache
(`LAPLACE_CACHE_DIR`), so the time includes building the embedded corpus and its tokenizer, as in
a fresh clone. Writes bench/results/default_run.json: the wall time, the training loss of the
first and last logged steps and every validation loss, read from the run's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import write_result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.default_run", description=__doc__)
    ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "default"
        env = {**os.environ, "LAPLACE_CACHE_DIR": str(Path(tmp) / "cache")}
        command = [sys.executable, "-m", "train.main", "--run-dir", str(run_dir), "--no-progress"]
        t0 = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
            raise SystemExit(f"error: the default run exited {done.returncode}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        model = json.loads((run_dir / "config.json").read_text())["model"]
    losses = [r for r in records if "loss" in r]
    validation = [
        {"step": r["step"], "val_loss": r["val_loss"]} for r in records if "val_loss" in r
    ]
    headline = {
        "wall_s": round(seconds, 1),
        "first_loss": losses[0]["loss"],
        "last_loss": losses[-1]["loss"],
        "steps": losses[-1]["step"],
    }
    path = write_result(
        "default_run",
        headline,
        command="python -m train.main",
        first_step=losses[0]["step"],
        validation=validation,
        model=model,
        notes="a fresh run directory and corpus cache: the time includes the corpus build",
    )
    print(json.dumps(headline), validation, path, sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
