"""`python -m bench.quality`: language-modelling quality of pure Laplace, the hybrid and attention.

    python -m bench.quality [--models laplace,hybrid,...] [--seeds 0,1,2]

The README's default run (`python -m train.main`: the `small` preset on the embedded corpus, 120
steps of 4,096 tokens, validation at steps 40, 80 and 120), the same data and optimizer, once per
model and seed (`seed=N`: parameter initialisation and data order), differing only in the model:

    laplace          every layer GLA (the default)
    hybrid           attention_every=4: the last of the four layers softmax attention, its
                     embedding scaled by sqrt(D) and its GLA layers' mixer branches by 0.1
                     (embed_scale=auto, gla_branch_scale=auto: docs/design.md s13.5)
    hybrid_sqrt_d    the same hybrid with gla_branch_scale=1: the embedding scaled only
    hybrid_unscaled  embed_scale=one gla_branch_scale=1: the hybrid before either
    hybrid_FORM      the hybrid with one of BRANCH_FORMS below (s13.5's second study)
    hybrid2          attention_every=2 (two GLA layers, two attention), today's defaults
    hybrid2_FORM     that layout with one of BRANCH_FORMS
    attention        token_mixer=attention: every layer softmax attention (the baseline)
    laplace_sqrt_d   pure Laplace with embed_scale=sqrt_d_model (not its default)

Each run is added to bench/results/quality.json under "model/seedN", replacing only a run of the
same model and seed, so the grid can be filled a few runs at a time; the headline is each
model's mean final validation loss over the seeds it has, with their spread (max - min). A short
run on a small corpus: it says whether the hybrid trains as well as pure Laplace at this size
and length, not how the models compare at scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import RESULTS, chosen, write_result

# The second study's forms of a hybrid's branch (docs/design.md s13.5), each a configuration,
# trained here and by bench.hybrid_init on MQAR: the GLA branch post-normed (s (1 + w) RMSNorm(y),
# s the embedding's size at initialisation, times gla_branch_scale), the attention layers reading
# the embedding beside the stream (GLA branches unscaled), both, and a learned LayerScale from 0.1
BRANCH_FORMS = {
    "post_norm": ["gla_branch=post_norm"],
    "post_norm_0.25": ["gla_branch=post_norm", "gla_branch_scale=0.25"],
    "post_norm_0.1": ["gla_branch=post_norm", "gla_branch_scale=0.1"],
    "reads_embedding": ["attention_input=stream_and_embedding", "gla_branch_scale=1"],
    "post_norm_reads_embedding": ["gla_branch=post_norm", "attention_input=stream_and_embedding"],
    "layer_scale": ["gla_branch=layer_scale"],
}
RUNS = {
    "laplace": [],
    "hybrid": ["attention_every=4"],
    "hybrid_sqrt_d": ["attention_every=4", "gla_branch_scale=1"],
    "hybrid_unscaled": ["attention_every=4", "embed_scale=one", "gla_branch_scale=1"],
    **{f"hybrid_{form}": ["attention_every=4", *c] for form, c in BRANCH_FORMS.items()},
    "hybrid2": ["attention_every=2"],
    **{f"hybrid2_{form}": ["attention_every=2", *c] for form, c in BRANCH_FORMS.items()},
    "attention": ["token_mixer=attention"],
    "laplace_sqrt_d": ["embed_scale=sqrt_d_model"],
}


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
        "model": json.loads((run_dir / "config.json").read_text())["model"],
    }


def headline(runs: dict) -> dict:
    """Per model: the mean final validation loss over its seeds, their spread and count."""
    out = {}
    for name in RUNS:
        finals = [
            r["validation"][-1]["val_loss"] for k, r in runs.items() if k.split("/")[0] == name
        ]
        if finals:
            out[f"val_loss_{name}"] = round(statistics.mean(finals), 4)
            # the key this headline had before seeds (the runs train the `small` preset): the
            # same mean, kept for whoever reads it
            out[f"val_loss_{name}_small"] = out[f"val_loss_{name}"]
            out[f"val_loss_{name}_spread"] = round(max(finals) - min(finals), 4)
            out[f"val_loss_{name}_seeds"] = len(finals)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__)
    ap.add_argument("--models", default=",".join(RUNS), help="comma list of " + ", ".join(RUNS))
    ap.add_argument("--seeds", default="0,1,2", help="comma list of seeds (default 0,1,2)")
    args = ap.parse_args(argv)
    models = chosen(ap, args.models, RUNS, "model")
    seeds = [int(s) for s in args.seeds.split(",")]
    path = RESULTS / "quality.json"
    runs = json.loads(path.read_text())["runs"] if path.is_file() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            for seed in seeds:
                key = f"{name}/seed{seed}"
                overrides = [*RUNS[name], *([f"seed={seed}"] if seed else [])]
                runs[key] = run(key, overrides, Path(tmp) / name / str(seed))
                print(key, json.dumps(runs[key]["validation"]), flush=True)
                write_result(
                    "quality", headline(runs), runs=dict(sorted(runs.items())), preset="small"
                )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
