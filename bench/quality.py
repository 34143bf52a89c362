"""`python -m bench.quality`: language-modelling quality of pure Laplace, the hybrid and attention.

Three runs of the README's default run (`python -m train.main`: the `small` preset on the
embedded corpus, 120 steps of 4,096 tokens, validation at steps 40, 80 and 120), the same data,
seed and optimizer, differing only in step 4 of the layers:

    laplace    every layer GLA (the default)
    hybrid     attention_every=4: the last of the four layers is softmax attention
    attention  token_mixer=attention: every layer softmax attention (the retrieval baseline)

Writes bench/results/quality.json: each run's training losses at its first and last step and its
validation losses. A short run on a small corpus: it says whether the hybrid trains as well as
pure Laplace at this size and length, not how the three compare at scale.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import write_result

RUNS = {"laplace": [], "hybrid": ["attention_every=4"], "attention": ["token_mixer=attention"]}


def run(name: str, overrides: list[str], run_dir: Path) -> dict:
    command = [sys.executable, "-m", "train.main", "--run-dir", str(run_dir), "--no-progress"]
    done = subprocess.run([*command, *overrides], capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"error: the {name} run exited {done.returncode}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    losses = [r for r in records if "loss" in r]
    return {
        "command": " ".join(["python -m train.main", *overrides]),
        "first_loss": losses[0]["loss"],
        "last_loss": losses[-1]["loss"],
        "steps": losses[-1]["step"],
        "validation": [
            {"step": r["step"], "val_loss": r["val_loss"]} for r in records if "val_loss" in r
        ],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__)
    ap.parse_args(argv)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in RUNS.items():
            runs[name] = run(name, overrides, Path(tmp) / name)
            print(name, json.dumps(runs[name]), flush=True)
    headline = {
        f"val_loss_{name}_small": r["validation"][-1]["val_loss"] for name, r in runs.items()
    }
    print(write_result("quality", headline, runs=runs, preset="small"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
