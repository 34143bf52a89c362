"""`python -m bench.long_context`: a tiny Laplace trained on long passkey contexts with each
sequence split over 4 simulated devices, beside the same runs without the context axis and the
same model trained at 64 tokens.

    python -m bench.long_context [--seq-len 4096] [--context 4] [--steps N] [--extend-steps N]
                                 [--queries Q] [--dense-steps N]

All models are the retrieval benchmark's earlier passkey Laplace (bench/retrieval.py's model: 2
layers, 4 heads, d_model 64, where bench.passkey's is 128; vocabulary 256, T_max 2,048, the tiny
optimizer preset at lr 1e-2), trained by `python -m train.main --task passkey:...` in a
subprocess that simulates `--context` CPU devices:

- short: one device, 64-token sequences, 32 per step, `--steps` steps, the needle anywhere (the
  retrieval benchmark's run);
- long, from scratch: `--mesh fsdp=1,context=4`, sequences of `--seq-len` tokens, each cut into
  4 slices, one per device (the GLA state and the conv window cross the slices,
  laplace_jax/context_parallel.py), `--sequences` per step, `--steps` steps;
- long, control: the same run on one device, no context axis: whether the task or the path
  decides what the long run learns;
- long, extended: the short model's parameters (`--init-from`) trained `--extend-steps` more
  steps as the long one is (a fresh optimizer): how a model is taken to a longer context;
- dense, from scratch, and its control: the same model, `--dense-steps` steps, on a denser
  task, `--queries` keys a sequence (`passkey:queries=Q`, train/tasks.py: the sequence cut into
  Q segments, each its own passkey problem, its needle anywhere in it and its query at its end),
  with `context=4` and on one device. The one-query task trains on 4 keys a step (the
  sequences' one key each), too few for the tiny model to leave chance in 1,000 steps at 4,096
  tokens (the `long` run); this one on 4 Q. Q = 31 (segments of about 132 tokens) does not
  divide the slices: the segments around the slice edges at 1,024, 2,048 and 3,072 straddle two
  slices, so their answers need the state the context axis passes on.

Each is scored by `python -m train.eval --task passkey --mesh fsdp=1,context=4` (the eval's
sharded forward, the same slices) at 1x, 2x and 4x the long training length, needle depths 0,
0.5 and 1, 256 fresh sequences per cell: `accuracy` a hit when every digit is right (of every
query), `digit_accuracy` per digit. Everything ran on this CPU; the runs are short, so the
accuracies are what such runs reach. Writes bench/results/long_context.json (headline: passkey
accuracy, mean over the depths, of each one-query model at 1x and 4x the long training length;
`dense_task_acc_scratch_cp4` and `dense_task_acc_scratch_control`: the dense models' digit
accuracy at their training length, mean over the depths).
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
from bench.passkey import DEPTHS, LR
from bench.retrieval import train_args

REPO = Path(__file__).resolve().parent.parent


def passkey_spec(seq_len: int, queries: int = 1) -> dict:
    """The retrieval benchmark's passkey Laplace (bench/retrieval.py), at `seq_len` tokens,
    `queries` keys asked a sequence."""
    task = "passkey:depth=-1" + (f",queries={queries}" if queries > 1 else "")
    return {
        "mixer": "gla",
        "d_model": 64,
        "heads": 4,
        "t_max": 2048.0,
        "seq_len": seq_len,
        "seed": 0,
        "lr": LR,
        "task": task,
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
    name,
    run_dir,
    seq_len,
    sequences,
    mesh,
    steps,
    eval_flags,
    devices,
    say,
    init_from=None,
    queries=1,
) -> dict:
    """Train one model and score it; its losses, cells and timings."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    spec = passkey_spec(seq_len, queries)
    command = train_args(run_dir, spec, steps, mesh, sequences * seq_len, 25, init_from)
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
        {
            "context": r["seq_len"],
            "depth": r["depth"],
            "accuracy": r["accuracy"],
            "digit_accuracy": r["digit_accuracy"],
        }
        for r in report["results"]
    ]
    say(
        f"{name}: {train_s:.0f} s training, "
        + ", ".join(f"{c['context']}@{c['depth']:g} {c['accuracy']:.0%}" for c in cells)
    )
    return {
        "task": spec["task"],
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


def mean_accuracy(result: dict, context: int, key: str = "accuracy") -> float:
    """The mean over the depths of a model's `key` at `context` tokens."""
    accs = [c[key] for c in result["cells"] if c["context"] == context]
    return sum(accs) / len(accs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.long_context", description=__doc__)
    ap.add_argument("--seq-len", type=int, default=4096, help="long training length")
    ap.add_argument("--context", type=int, default=4, help="devices each sequence is split over")
    ap.add_argument("--sequences", type=int, default=4, help="long sequences per step")
    ap.add_argument("--steps", type=int, default=1000, help="steps of the short and long runs")
    ap.add_argument("--extend-steps", type=int, default=300, help="steps of the extended run")
    ap.add_argument("--queries", type=int, default=31, help="keys a sequence, dense task")
    ap.add_argument("--dense-steps", type=int, default=1500, help="steps of the dense runs")
    ap.add_argument("--work-dir", default="runs/bench-long-context", help="training runs")
    args = ap.parse_args(argv)
    T, S, work = args.seq_len, args.context, Path(args.work_dir)
    contexts = (T, 2 * T, 4 * T)
    mesh, one = f"fsdp=1,context={S}", "fsdp=1"
    eval_flags = ["--task", "passkey", "--mesh", mesh, "--n", "256"]
    eval_flags += ["--context-lens", ",".join(map(str, contexts))]
    eval_flags += ["--depths", ",".join(map(str, DEPTHS))]
    t0 = time.perf_counter()
    common = (eval_flags, S, print)
    long = (T, args.sequences)
    models = {}  # the dense runs first: the task the target is on
    for name, on in (("dense", mesh), ("dense_control", one)):
        run_dir = work / (f"passkey-{T}-q{args.queries}" + ("" if on == mesh else "-control"))
        steps = args.dense_steps
        models[name] = study(name, run_dir, *long, on, steps, *common, queries=args.queries)
    models |= {
        "short": study("short", work / "passkey-64", 64, 32, one, args.steps, *common),
        "long": study("long", work / f"passkey-{T}", *long, mesh, args.steps, *common),
        "long_control": study(
            "long, control", work / f"passkey-{T}-control", *long, one, args.steps, *common
        ),
        "extended": study(
            "extended",
            work / f"passkey-64-to-{T}",
            *long,
            mesh,
            args.extend_steps,
            *common,
            init_from=work / "passkey-64",
        ),
    }
    headline = {}
    names = {"short": "64", "long": str(T), "long_control": f"{T}_control"}
    names["extended"] = f"64_to_{T}"
    for key, name in names.items():
        for at in (T, 4 * T):
            headline[f"passkey_acc_trained_{name}_at_{at}"] = round(
                mean_accuracy(models[key], at), 4
            )
    for key, name in (("dense", "cp4"), ("dense_control", "control")):
        headline[f"dense_task_acc_scratch_{name}"] = round(
            mean_accuracy(models[key], T, "digit_accuracy"), 4
        )
    path = write_result(
        "long_context",
        headline,
        context=S,
        contexts=list(contexts),
        depths=list(DEPTHS),
        queries=args.queries,
        elapsed_s=round(time.perf_counter() - t0, 1),
        models=models,
        notes=(
            "tiny Laplace (2 layers, d_model 64, vocab 256, T_max 2,048), passkey with the needle "
            "anywhere; accuracy per sequence (all 5 digits of every query right) and per digit "
            "on 256 fresh sequences per (context, depth) cell, scored with each sequence split "
            "over the context axis; the control runs trained on one device, without the context "
            "axis; the dense task asks the key `queries` times a sequence and is headlined by "
            "its digit accuracy; simulated CPU devices on this machine"
        ),
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
