"""Retrieval benchmark: tiny Laplace and softmax-attention models trained on MQAR and passkey on
this CPU, side by side (DESIGN.md s9).

    python -m bench.retrieval [--quick] [--seeds N] [--steps N] [--work-dir DIR]

Every model is trained by the project's trainer (`python -m train.main --task ...`, in-process)
and scored by its evaluator (`python -m train.eval`) on fresh batches, never training ones. The
baseline is the same model with `token_mixer=attention` (laplace_jax/attention.py): the same
parameters, Muon on the same matrices, the same optimizer settings.

Models: 2 layers, 4 heads (d_v = d_model / 4, d_k = d_v / 2, as Laplace), FFN 2 x d_model,
vocabulary 256 (MQAR: 127 keys, 128 values, so chance is 1/128), the tiny optimizer preset
(Muon lr 1e-2, cosine to 10%), 2,048 tokens per step, 1,000 steps. Three studies:

- mqar: each mixer, d_model 128, trained on MQAR (64, 4) (`--seeds` seeds) and scored on
  zoology's small settings (seq_len, pairs) = (64, 4), (128, 8), (256, 16): the recall mechanism
  is learnt on the easy setting (1,000 steps do not teach it from scratch on the harder ones, to
  either mixer: measured), and the harder settings ask it to hold 2x and 4x the pairs for 2x and
  4x as long;
- state: the same, seed 0, Laplace at (d_model, heads) = (64, 4), (128, 8), (128, 2), (256, 4):
  GLA state per layer H x d_k x d_v of 512, 1,024, 4,096 and 8,192 values beside the 2,048 of
  (128, 4); attention at d_model 64;
- passkey: trained on 64-token contexts with the needle at a random depth, scored at contexts
  of 64, 256, 1,024 and 4,096 tokens and depths 0 (the needle furthest from the question), 0.5
  and 1: Laplace with its decay schedule's T_max = 2,048 and T_max = 64 (how far back a fixed
  decay recalls), and attention (no positional encoding: it too meets lengths it never saw).

The vocabulary is 256, not zoology's 8,192, and runs are short (1,000 steps, 2M tokens), so that
the whole benchmark fits in under 45 minutes on a 2-core CPU; accuracies are what such short
runs reach, a lower bound on what longer training gives either mixer.
Finished runs are kept in `--work-dir` (default runs/bench-retrieval) and reused when the
benchmark is run again with the same settings.

Writes bench/results/retrieval.json (headline: mqar_acc_laplace_256_16, mqar_acc_attention_256_16,
mqar_acc_laplace_128_8, mqar_acc_attention_128_8, passkey_acc_laplace_max_depth) and
bench/results/retrieval.png (`--quick`: retrieval_quick.json and .png).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import time
from pathlib import Path

from bench.common import write_result
from train import eval as train_eval
from train import main as train_main

MQAR_SETTINGS = ((64, 4), (128, 8), (256, 16))
PASSKEY_CONTEXTS = (64, 256, 1024, 4096)
PASSKEY_DEPTHS = (0.0, 0.5, 1.0)
MIXERS = ("gla", "attention")
LABEL = {"gla": "laplace", "attention": "attention"}


def model_overrides(d_model: int, heads: int = 4, t_max: float = 2048.0) -> list[str]:
    """The tiny preset reshaped: 2 layers, d_v = d_model / heads, d_k = d_v / 2 (Laplace's)."""
    d_v = d_model // heads
    return [
        f"d_model={d_model}",
        f"n_heads={heads}",
        f"d_v={d_v}",
        f"d_k={d_v // 2}",
        f"ffn_dim={2 * d_model}",
        f"n_tiers={2 if heads % 2 == 0 else 1}",
        "vocab_size=256",
        f"t_max={t_max}",
        "chunk_size=16",
    ]


def state_per_layer(d_model: int, heads: int) -> int:
    d_v = d_model // heads
    return heads * (d_v // 2) * d_v  # H x d_k x d_v


def train(run_dir: Path, spec: dict, steps: int) -> float:
    """Train one model with `python -m train.main` (in-process); returns the seconds it took.
    An already finished run (its last checkpoint at `steps`) returns at once."""
    args = [
        "--config", "tiny", "--task", spec["task"], "--run-dir", str(run_dir), "--no-progress",
        "--steps", str(steps), "--mesh", "fsdp=1", "--global-batch-tokens", "2048",
        "--ckpt-every", str(steps), "--log-every", "50",
        *model_overrides(spec["d_model"], spec["heads"], spec["t_max"]),
        f"token_mixer={spec['mixer']}", f"seq_len={spec['seq_len']}", f"seed={spec['seed']}",
        f"total_steps={steps}", "warmup_steps=20", "eval_every=0", "sample_tokens=0",
        "peak_flops=1e11", "async_checkpoints=false",
    ]  # fmt: skip
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()) as log:
        status = train_main.main(args)
    if status != 0:
        raise RuntimeError(f"training {run_dir} failed ({status}):\n{log.getvalue()[-2000:]}")
    return time.perf_counter() - t0


def evaluate(run_dir: Path, flags: list[str]) -> dict:
    """Score the run's last checkpoint with `python -m train.eval`; returns its report."""
    args = train_eval.parse_args(["--checkpoint", str(run_dir), *flags, "--n", "256"])
    report, out = train_eval.evaluate(args, say=lambda *_: None)
    train_eval.write_outputs(report, out)
    return report


def run_one(work: Path, spec: dict, steps: int, eval_flags: list[str], say) -> dict:
    """Train and score one model, or reuse a finished one's result (scored with the same flags;
    a finished run scored otherwise is scored again, not retrained)."""
    name = "-".join(f"{k}{v}" for k, v in spec.items() if k != "task") + f"-steps{steps}"
    name += "-" + spec["task"].replace(":", "_").replace("=", "").replace(",", "_")
    run_dir = work / name
    done = run_dir / "bench_result.json"
    if done.is_file():
        result = json.loads(done.read_text())
        if result.get("eval_flags") == eval_flags:
            say(f"  {name}: reused")
            return result
    seconds = train(run_dir, spec, steps)  # returns at once when the run is already finished
    t0 = time.perf_counter()
    report = evaluate(run_dir, eval_flags)
    cells = [
        {k: r[k] for k in ("seq_len", "num_pairs", "depth", "accuracy") if k in r}
        for r in report["results"]
    ]
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").open()]
    result = {**spec, "steps": steps, "final_loss": losses[-1], "eval_flags": eval_flags}
    if done.is_file():  # trained by an earlier invocation: keep its training time
        result["train_s"] = json.loads(done.read_text())["train_s"]
    else:
        result["train_s"] = round(seconds, 1)
    result["eval_s"] = round(time.perf_counter() - t0, 1)
    result["cells"] = cells
    done.write_text(json.dumps(result, indent=2))
    say(f"  {name}: {seconds:.0f} s, " + ", ".join(f"{c['accuracy']:.1%}" for c in cells))
    return result


def mqar_spec(mixer, seed, d_model=128, heads=4) -> dict:
    """A model trained on MQAR (64, 4)."""
    return {
        "mixer": mixer,
        "d_model": d_model,
        "heads": heads,
        "t_max": 2048.0,
        "seq_len": 64,
        "seed": seed,
        "task": "mqar:num_pairs=4",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.retrieval", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="MQAR and passkey, 1 seed, no state")
    ap.add_argument("--seeds", type=int, default=3, help="seeds of the MQAR study (default 3)")
    ap.add_argument("--steps", type=int, default=1000, help="steps per run (default 1000)")
    ap.add_argument("--work-dir", default="runs/bench-retrieval", help="training runs")
    args = ap.parse_args(argv)
    steps = args.steps
    seeds = 1 if args.quick else args.seeds
    work = Path(args.work_dir)
    t_start = time.perf_counter()

    # 1. MQAR: each mixer trained on (64, 4), scored on zoology's three small settings
    print(f"MQAR: d_model 128, trained on (64, 4), {steps} steps, {seeds} seed(s)")
    flags = ["--task", "mqar", "--seq-lens", "64,128,256", "--pairs", "4,8,16"]
    mqar = []
    for mixer in MIXERS:
        for seed in range(seeds):
            mqar.append(run_one(work, mqar_spec(mixer, seed), steps, flags, print))

    # 2. accuracy against width and state size
    state = []
    if not args.quick:
        print("state size: trained on (64, 4), seed 0")
        for mixer, d_model, heads in (
            ("gla", 64, 4), ("gla", 128, 8), ("gla", 128, 2), ("gla", 256, 4),
            ("attention", 64, 4),
        ):  # fmt: skip
            state.append(run_one(work, mqar_spec(mixer, 0, d_model, heads), steps, flags, print))
        state += [r for r in mqar if r["seed"] == 0]

    # 3. passkey by depth and context length: how far back the fixed decay recalls
    print("passkey: trained at 64 tokens (random depth)")
    contexts = PASSKEY_CONTEXTS[:3] if args.quick else PASSKEY_CONTEXTS
    flags = ["--task", "passkey", "--context-lens", ",".join(map(str, contexts))]
    flags += ["--depths", ",".join(map(str, PASSKEY_DEPTHS))]
    passkey = []
    for mixer, t_max in (("gla", 2048.0), ("gla", 64.0), ("attention", 2048.0)):
        if args.quick and t_max == 64.0:
            continue
        spec = {"mixer": mixer, "d_model": 64, "heads": 4, "t_max": t_max, "seq_len": 64,
                "seed": 0, "task": "passkey:depth=-1"}  # fmt: skip
        passkey.append(run_one(work, spec, steps, flags, print))

    summary = summarise(mqar, state, passkey, contexts)
    elapsed = time.perf_counter() - t_start
    runs = {"mqar": mqar, "state": state, "passkey": passkey}
    unique = {json.dumps(r, sort_keys=True): r for rs in runs.values() for r in rs}.values()
    compute = sum(r["train_s"] + r.get("eval_s", 0.0) for r in unique)
    print_tables(summary)
    print(f"\n{elapsed / 60:.1f} minutes here; {compute / 60:.1f} minutes of training and scoring")
    name = "retrieval_quick" if args.quick else "retrieval"  # quick never overwrites the full
    figure = plot(summary, Path(f"bench/results/{name}.png"))
    path = write_result(
        name,
        summary["headline"],
        quick=args.quick,
        steps=steps,
        seeds=seeds,
        elapsed_s=round(elapsed, 1),
        train_and_eval_s=round(compute, 1),
        mqar=summary["mqar"],
        state=summary["state"],
        passkey=summary["passkey"],
        runs=runs,
        notes=(
            "2 layers, 4 heads (unless stated), vocab 256, 2,048 tokens per step, tiny optimizer "
            "preset (Muon lr 1e-2), each model trained by train.main and scored by train.eval "
            "on 256 fresh sequences per cell; MQAR accuracy per answer token, passkey accuracy "
            "per sequence (all 5 digits right)"
        ),
    )
    print(path, figure)
    return 0


def _acc(run: dict, **match) -> float:
    cells = [c for c in run["cells"] if all(c.get(k) == v for k, v in match.items())]
    return cells[0]["accuracy"]


def summarise(mqar, state, passkey, contexts) -> dict:
    """Means and per-seed accuracies of the MQAR grid, the state-size points, the passkey grid."""
    table = []
    for T, P in MQAR_SETTINGS:
        row = {"seq_len": T, "num_pairs": P}
        for mixer in MIXERS:
            accs = [_acc(r, seq_len=T, num_pairs=P) for r in mqar if r["mixer"] == mixer]
            row[LABEL[mixer]] = statistics.mean(accs)
            row[f"{LABEL[mixer]}_seeds"] = accs
        table.append(row)
    points = sorted(
        (
            {
                "mixer": LABEL[r["mixer"]],
                "d_model": r["d_model"],
                "heads": r["heads"],
                "state_per_layer": state_per_layer(r["d_model"], r["heads"]),
                **{f"accuracy_{T}_{P}": _acc(r, seq_len=T, num_pairs=P) for T, P in MQAR_SETTINGS},
            }
            for r in state
        ),
        key=lambda p: (p["mixer"], p["state_per_layer"], p["d_model"]),
    )
    pk = [
        {
            "mixer": LABEL[r["mixer"]],
            "t_max": r["t_max"],
            "cells": [
                {"context": c["seq_len"], "depth": c["depth"], "accuracy": c["accuracy"]}
                for c in r["cells"]
            ],
        }  # fmt: skip
        for r in passkey
    ]
    headline = {}
    for row in table:
        for mixer in ("laplace", "attention"):
            headline[f"mqar_acc_{mixer}_{row['seq_len']}_{row['num_pairs']}"] = round(row[mixer], 4)
    laplace = next(p for p in pk if p["mixer"] == "laplace" and p["t_max"] == 2048.0)
    deepest = max(contexts)  # the needle at depth 0 of the longest context: furthest back
    headline["passkey_acc_laplace_max_depth"] = next(
        c["accuracy"] for c in laplace["cells"] if c["context"] == deepest and c["depth"] == 0.0
    )
    return {"headline": headline, "mqar": table, "state": points, "passkey": pk}


def print_tables(summary: dict) -> None:
    print("\nMQAR accuracy (mean over seeds; per seed)")
    print(f"{'seq_len':>8s} {'pairs':>6s} {'Laplace':>9s} {'attention':>10s}")
    for r in summary["mqar"]:
        seeds = lambda m, r=r: "/".join(f"{a:.0%}" for a in r[f"{m}_seeds"])  # noqa: E731
        print(
            f"{r['seq_len']:8d} {r['num_pairs']:6d} {r['laplace']:9.1%} {r['attention']:10.1%}"
            f"   ({seeds('laplace')} | {seeds('attention')})"
        )
    if summary["state"]:
        print("\nMQAR against the GLA state per layer (heads x d_k x d_v), trained on (64, 4)")
        print(
            f"  {'mixer':9s} {'d_model':>7s} {'heads':>5s} {'state':>6s}  (64,4) (128,8) (256,16)"
        )
        for p in summary["state"]:
            accs = "  ".join(f"{p[f'accuracy_{T}_{P}']:6.1%}" for T, P in MQAR_SETTINGS)
            print(
                f"  {p['mixer']:9s} {p['d_model']:7d} {p['heads']:5d} "
                f"{p['state_per_layer'] if p['mixer'] == 'laplace' else '-':>6}  {accs}"
            )
    print("\npasskey accuracy by (context, depth)")
    for p in summary["passkey"]:
        cells = ", ".join(f"{c['context']}@{c['depth']:g}: {c['accuracy']:.0%}" for c in p["cells"])
        print(f"  {p['mixer']:9s} T_max {p['t_max']:6g}: {cells}")


def plot(summary: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    labels = [f"({r['seq_len']}, {r['num_pairs']})" for r in summary["mqar"]]
    x = range(len(labels))
    for off, mixer in ((-0.2, "laplace"), (0.2, "attention")):
        ax.bar([i + off for i in x], [r[mixer] for r in summary["mqar"]], 0.4, label=mixer)
        for i, r in enumerate(summary["mqar"]):
            ax.plot([i + off] * len(r[f"{mixer}_seeds"]), r[f"{mixer}_seeds"], "k.", ms=4)
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("MQAR (seq_len, pairs), trained on (64, 4), d_model 128")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1.05)
    ax.legend()
    ax = axes[1]
    laplace = [p for p in summary["state"] if p["mixer"] == "laplace"]
    for (T, P), marker in zip(MQAR_SETTINGS, "o^s", strict=True):
        ax.plot([p["state_per_layer"] for p in laplace],
                [p[f"accuracy_{T}_{P}"] for p in laplace], marker + "-",
                label=f"Laplace ({T}, {P})")  # fmt: skip
        for p in summary["state"]:
            if p["mixer"] == "attention":
                ax.axhline(
                    p[f"accuracy_{T}_{P}"], ls=":", lw=1, color=f"C{MQAR_SETTINGS.index((T, P))}"
                )
    for p in laplace:
        ax.annotate(f"d{p['d_model']}h{p['heads']}", (p["state_per_layer"], 0.02), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GLA state per layer (H x d_k x d_v); dotted: attention")
    ax.set_ylabel("MQAR accuracy")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    ax = axes[2]
    for p in summary["passkey"]:
        deep = sorted((c for c in p["cells"] if c["depth"] == 0.0), key=lambda c: c["context"])
        ax.plot([c["context"] for c in deep], [c["accuracy"] for c in deep], "o-",
                label=f"{p['mixer']} T_max {p['t_max']:g}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("passkey context (needle at depth 0)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
