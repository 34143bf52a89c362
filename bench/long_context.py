"""`python -m bench.long_context`: a tiny Laplace trained on long passkey contexts with each
sequence split over 4 simulated devices, beside the same model trained at 64 tokens.

    python -m bench.long_context [--seq-len 4096] [--context 4] [--steps N] [--extend-steps N]

All three models are the retrieval benchmark's passkey Laplace (bench/retrieval.py: 2 layers,
4 heads, d_model 64, vocabulary 256, T_max 2,048, the tiny optimizer preset at lr 1e-2), trained by
`python -m train.main --task passkey:depth=-1` (the needle anywhere) in a subprocess that
simulates `--context` CPU devices:

- short: one device, 64-token sequences, 32 per step, `--steps` steps (the retrieval
  benchmark's run);
- long, from scratch: `--mesh fsdp=1,context=4`, sequences of `--seq-len` tokens, each cut into
  4 slices, one per device (the GLA state and the conv window cross the slices,
  laplace_jax/context_parallel.py), `--sequences` per step, `--steps` steps;
- long, extended: the short model's parameters (`--init-from`) trained `--extend-steps` more
  steps as the long one is (a fresh optimizer): how a model is taken to a longer context.

Each is scored by `python -m train.eval --task passkey --mesh fsdp=1,context=4` (the eval's
sharded forward, the same slices) at 1x, 2x and 4x the long training length, needle depths 0,
0.5 and 1, 256 fresh sequences per cell; a hit needs all 5 digits. Everything ran on this CPU;
the runs are short, so the accuracies are what such runs reach. Writes
bench/results/long_context.json (headline: passkey accuracy, mean over the depths, of each model
at 1x and 4x the long training length).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import write_result
from bench.retrieval import PASSKEY_DEPTHS, PASSKEY_LR, train_args

REPO = Path(__file__).resolve().parent.parent


def passkey_spec(seq_len: int) -> dict:
    """The retrieval benchmark's passkey Laplace (bench/retrieval.py), at `seq_len` tokens."""
    return {
        "mixer": "gla",
        "d_model": 64,
        "heads": 4,
        "t_max": 2048.0,
        "seq_len": seq_len,
        "seed": 0,
        "lr": PASSKEY_LR,
        "task": "passkey:depth=-1",
    }


def run(module: str, args: list, devices: int) -> float:
    """`python -m MODULE ARGS` with `devices` simulated CPU devices; the seconds it took."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    env["JAX_PLATFORMS"] = "cpu"
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(f"python -m {module} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return time.perf_counter() - t0


def study(
    name, run_dir, seq_len, sequences, mesh, steps, eval_flags, devices, say, init_from=None
) -> dict:
    """Train one model and score it; its losses, cells and timings."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    command = train_args(
        run_dir, passkey_spec(seq_len), steps, mesh, sequences * seq_len, 25, init_from
    )
    say(f"{name}: python -m train.main {' '.join(command)}")
    train_s = run("train.main", command, devices)
    out = run_dir / "eval"
    eval_args = ["--checkpoint", str(run_dir), *eval_flags, "--out", str(out)]
    say(f"{name}: python -m train.eval {' '.join(eval_args)}")
    eval_s = run("train.eval", eval_args, devices)
    (report_path,) = out.glob("passkey-step*.json")
    report = json.loads(report_path.read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    cells = [
        {"context": r["seq_len"], "depth": r["depth"], "accuracy": r["accuracy"]}
        for r in report["results"]
    ]
    say(
        f"{name}: {train_s:.0f} s training, "
        + ", ".join(f"{c['context']}@{c['depth']:g} {c['accuracy']:.0%}" for c in cells)
    )
    return {
        "trained_seq_len": seq_len,
        "init_from": None if init_from is None else str(init_from),
        "sequences_per_step": sequences,
        "mesh": mesh,
        "steps": steps,
        "train_command": "python -m train.main " + " ".join(command),
        "eval_command": "python -m train.eval " + " ".join(eval_args),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "train_s": round(train_s, 1),
        "eval_s": round(eval_s, 1),
        "eval_mesh": report["mesh"],
        "cells": cells,
    }


def mean_accuracy(result: dict, context: int) -> float:
    accs = [c["accuracy"] for c in result["cells"] if c["context"] == context]
    return sum(accs) / len(accs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.long_context", description=__doc__)
    ap.add_argument("--seq-len", type=int, default=4096, help="long training length")
    ap.add_argument("--context", type=int, default=4, help="devices each sequence is split over")
    ap.add_argument("--sequences", type=int, default=4, help="long sequences per step")
    ap.add_argument("--steps", type=int, default=1000, help="steps of the short and long runs")
    ap.add_argument("--extend-steps", type=int, default=300, help="steps of the extended run")
    ap.add_argument("--work-dir", default="runs/bench-long-context", help="training runs")
    args = ap.parse_args(argv)
    T, S, work = args.seq_len, args.context, Path(args.work_dir)
    contexts = (T, 2 * T, 4 * T)
    mesh = f"fsdp=1,context={S}"
    eval_flags = ["--task", "passkey", "--mesh", mesh, "--n", "256"]
    eval_flags += ["--context-lens", ",".join(map(str, contexts))]
    eval_flags += ["--depths", ",".join(map(str, PASSKEY_DEPTHS))]
    t0 = time.perf_counter()
    common = (eval_flags, S, print)
    short = study("short", work / "passkey-64", 64, 32, "fsdp=1", args.steps, *common)
    long = study("long", work / f"passkey-{T}", T, args.sequences, mesh, args.steps, *common)
    extended = study(
        "extended",
        work / f"passkey-64-to-{T}",
        T,
        args.sequences,
        mesh,
        args.extend_steps,
        *common,
        init_from=work / "passkey-64",
    )
    headline = {}
    for name, result in (("64", short), (str(T), long), (f"64_to_{T}", extended)):
        for at in (T, 4 * T):
            headline[f"passkey_acc_trained_{name}_at_{at}"] = round(mean_accuracy(result, at), 4)
    path = write_result(
        "long_context",
        headline,
        context=S,
        contexts=list(contexts),
        depths=list(PASSKEY_DEPTHS),
        elapsed_s=round(time.perf_counter() - t0, 1),
        models={"short": short, "long": long, "extended": extended},
        notes=(
            "tiny Laplace (2 layers, d_model 64, vocab 256, T_max 2,048), passkey with the needle "
            "anywhere; accuracy per sequence (all 5 digits right) on 256 fresh sequences per "
            "(context, depth) cell, scored with each sequence split over the context axis; "
            "simulated CPU devices on this machine"
        ),
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
