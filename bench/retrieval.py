"""Retrieval benchmark: tiny Laplace, softmax-attention and hybrid models trained on MQAR on this
CPU, side by side (docs/design.md s9, s13); the passkey study is bench.passkey's.

    python -m bench.retrieval [--quick] [--seeds N] [--steps N] [--work-dir DIR]

Every model is trained by the project's trainer (`python -m train.main --task ...`, in-process)
and scored by its evaluator (`python -m train.eval`) on fresh batches, never training ones. The
baseline is the same model with `token_mixer=attention` (laplace_jax/attention.py): the same
parameters, Muon on the same matrices, the same optimizer settings. The hybrid is Laplace with
`attention_every=2`: its first layer GLA, its second that attention layer; hybrid4 has 4 layers
with `attention_every=4`, three GLA layers then attention (Qwen3-Next's and Kimi Linear's 3:1).

Models: 2 layers, 4 heads (d_v = d_model / 4, d_k = d_v / 2, as Laplace), FFN 2 x d_model,
vocabulary 256 (MQAR: 127 keys, 128 values, so chance is 1/128), the tiny optimizer preset
(Muon, cosine to 10%), 2,048 tokens per step, 1,000 steps. Two studies:

- mqar: each mixer, d_model 128, trained on MQAR (64, 4) and scored on zoology's small settings
  (seq_len, pairs) = (64, 4), (128, 8), (256, 16): the recall mechanism is learnt on the easy
  setting (1,000 steps do not teach it from scratch on the harder ones, to either mixer:
  measured), and the harder settings ask it to hold 2x and 4x the pairs for 2x and 4x as long.
  As zoology does, every mixer is trained at each learning rate of a small sweep (`--lrs`, seed
  0); the rate with the best mean accuracy over the three settings is that mixer's, and
  `--seeds` seeds are trained there, whose accuracies (each, mean, spread) the table reports.
  The whole sweep is kept, so the band of learning rates in which a mixer learns is visible;
- state: seed 0, each mixer at its best learning rate: Laplace at (d_model, heads) = (128, 2),
  a GLA state per layer H x d_k x d_v of 4,096 values beside the 2,048 of (128, 4) (one more
  state size, not more, so that the sweep and its three seeds fit about an hour here).

The vocabulary is 256, not zoology's 8,192, and runs are short (1,000 steps, 2M tokens), so that
the whole benchmark fits in about an hour on a 2-core CPU; accuracies are what such short runs
reach, a lower bound on what longer training gives either mixer.
Finished runs are kept in `--work-dir` (default runs/bench-retrieval) and reused only when every
argument of the training run, the evaluation flags and the code (a hash of the laplace_spec,
laplace_jax and train sources) are the same; each row of the JSON says whether it was reused and
from which run directory. `--fresh` retrains everything.

Writes bench/results/retrieval.json (headline: mqar_acc_{laplace,attention,hybrid,hybrid4}_{64_4,
128_8,256_16}, mqar_min_seed_{hybrid,hybrid4}_64_4 (the worst seed)) and
bench/results/retrieval.png (`--quick`: retrieval_quick.json and .png).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import io
import json
import shutil
import statistics
import time
from pathlib import Path

from bench.common import save_figure, write_result
from laplace_spec.config import LaplaceConfig
from train import eval as train_eval
from train import main as train_main

MQAR_SETTINGS = ((64, 4), (128, 8), (256, 16))
MIXERS = ("gla", "attention", "hybrid", "hybrid4")
LABEL = {"gla": "laplace", "attention": "attention", "hybrid": "hybrid", "hybrid4": "hybrid4"}
# how each mixer is set: the hybrid is Laplace with its second layer softmax attention, hybrid4
# four layers, the last attention
MIXER_SETTINGS = {
    "gla": ["token_mixer=gla"],
    "attention": ["token_mixer=attention"],
    "hybrid": ["token_mixer=gla", "attention_every=2"],
    "hybrid4": ["token_mixer=gla", "n_layers=4", "attention_every=4"],
    "attention4": ["token_mixer=attention", "n_layers=4"],  # bench.hybrid_init's control
}
# The tiny preset's 1e-2 and 3e-2 above it: in a sweep that also had 3e-3 (retrieval.json of
# 2026-12, AMD EPYC), 3e-3 was no mixer's best (Laplace 32.9% at (64, 4) against 64.6% at 1e-2,
# attention 99.8% against 100.0%, the hybrid 68.7% against 69.1%); `--lrs` sweeps others
LEARNING_RATES = (1e-2, 3e-2)
TINY_LR = 1e-2  # the tiny preset's: `--quick`'s, bench.passkey's and bench.long_context's
CODE = ("laplace_spec", "laplace_jax", "train")  # the packages whose sources key a reused run


@functools.cache
def code_version() -> str:
    """A hash of the sources that decide what a training run and its scoring compute, as this
    process loaded them (taken once: edits made while the benchmark runs do not change it)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(p for package in CODE for p in (root / package).rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


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


def train_args(
    run_dir: Path,
    spec: dict,
    steps: int,
    mesh: str = "fsdp=1",
    batch_tokens: int = 2048,
    log_every: int = 50,
    init_from: Path | None = None,
    overrides: list[str] = (),
) -> list[str]:
    """The `python -m train.main` arguments of one model (`init_from`: start from that run's
    parameters, `--init-from`; bench/long_context.py; `overrides`: more config fields)."""
    return [
        "--config",
        "tiny",
        "--task",
        spec["task"],
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--steps",
        str(steps),
        "--mesh",
        mesh,
        "--global-batch-tokens",
        str(batch_tokens),
        "--ckpt-every",
        str(steps),
        "--log-every",
        str(log_every),
        *([] if init_from is None else ["--init-from", str(init_from)]),
        *model_overrides(spec["d_model"], spec["heads"], spec["t_max"]),
        *MIXER_SETTINGS[spec["mixer"]],
        f"seq_len={spec['seq_len']}",
        f"seed={spec['seed']}",
        f"total_steps={steps}",
        "warmup_steps=20",
        "eval_every=0",
        "sample_tokens=0",
        "peak_flops=1e11",
        "async_checkpoints=false",
        f"lr={spec['lr']:g}",
        *overrides,
    ]


def train(args: list[str], run_dir: Path) -> float:
    """Train one model with `python -m train.main` (in-process); returns the seconds it took."""
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


def run_one(
    work: Path,
    spec: dict,
    steps: int,
    eval_flags: list[str],
    say,
    fresh=False,
    overrides=(),
    reuse_only=False,
) -> dict | None:
    """Train and score one model, or reuse a finished one's result when its training arguments,
    evaluation flags and code version are all the same (`fresh`: never reuse; `overrides`: more
    config fields, `train_args`; `reuse_only`: None rather than train)."""
    name = "-".join(f"{k}{v:g}" if k == "lr" else f"{k}{v}" for k, v in spec.items() if k != "task")
    name += f"-steps{steps}-" + spec["task"].replace(":", "_").replace("=", "").replace(",", "_")
    run_dir = work / name
    args = train_args(run_dir, spec, steps, overrides=list(overrides))
    key = {"train_args": args, "eval_flags": eval_flags, "code_version": code_version()}
    done = run_dir / "bench_result.json"
    if done.is_file() and not fresh:
        result = json.loads(done.read_text())
        if result.get("key") == key:
            say(f"  {name}: reused")
            return {**result, "reused_from": str(run_dir)}
    if reuse_only:
        return None
    if run_dir.exists():  # another code version or other arguments: train again from scratch
        shutil.rmtree(run_dir)
    seconds = train(args, run_dir)
    t0 = time.perf_counter()
    report = evaluate(run_dir, eval_flags)
    cells = [
        {k: r[k] for k in ("seq_len", "num_pairs", "depth", "accuracy") if k in r}
        for r in report["results"]
    ]
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").open()]
    result = {**spec, "steps": steps, "final_loss": losses[-1], "key": key}
    result["train_s"] = round(seconds, 1)
    result["eval_s"] = round(time.perf_counter() - t0, 1)
    result["cells"] = cells
    done.write_text(json.dumps(result, indent=2))
    say(f"  {name}: {seconds:.0f} s, " + ", ".join(f"{c['accuracy']:.1%}" for c in cells))
    return {**result, "reused_from": None}


def provenance(runs: list[dict], elapsed: float) -> dict:
    """What a result file says of how its runs were made: the code version, the model defaults
    they used (s13.5), this invocation's time, the runs' training and scoring time (each run
    once) and the earlier runs reused."""
    unique = {json.dumps(r, sort_keys=True): r for r in runs}.values()
    return {
        "code_version": code_version(),
        "embed_scale": LaplaceConfig.embed_scale,
        "gla_branch_scale": LaplaceConfig.gla_branch_scale,
        "elapsed_s": round(elapsed, 1),
        "train_and_eval_s": round(sum(r["train_s"] + r.get("eval_s", 0.0) for r in unique), 1),
        "reused_runs": sorted({r["reused_from"] for r in unique if r["reused_from"]}),
    }


def mqar_spec(mixer, seed, lr, d_model=128, heads=4) -> dict:
    """A model trained on MQAR (64, 4)."""
    return {
        "mixer": mixer,
        "d_model": d_model,
        "heads": heads,
        "t_max": 2048.0,
        "seq_len": 64,
        "seed": seed,
        "lr": lr,
        "task": "mqar:num_pairs=4",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.retrieval", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="1 seed, 1 learning rate, no state")
    ap.add_argument("--seeds", type=int, default=3, help="seeds of the MQAR study (default 3)")
    ap.add_argument(
        "--lrs",
        default=",".join(f"{lr:g}" for lr in LEARNING_RATES),
        help="learning rates of the MQAR sweep (comma list)",
    )
    ap.add_argument("--steps", type=int, default=1000, help="steps per run (default 1000)")
    ap.add_argument("--work-dir", default="runs/bench-retrieval", help="training runs")
    ap.add_argument("--fresh", action="store_true", help="retrain every run, reuse none")
    args = ap.parse_args(argv)
    steps = args.steps
    seeds = 1 if args.quick else args.seeds
    lrs = [TINY_LR] if args.quick else [float(x) for x in args.lrs.split(",")]
    work = Path(args.work_dir)
    t_start = time.perf_counter()
    code_version()  # the sources as loaded now

    def run(spec, flags):
        return run_one(work, spec, steps, flags, print, fresh=args.fresh)

    # 1. MQAR: each mixer at each learning rate and seed, trained on (64, 4), scored on
    # zoology's three small settings
    print(f"MQAR: d_model 128, trained on (64, 4), {steps} steps, lr {lrs}, {seeds} seed(s)")
    flags = ["--task", "mqar", "--seq-lens", "64,128,256", "--pairs", "4,8,16"]
    mqar = [run(mqar_spec(mixer, 0, lr), flags) for mixer in MIXERS for lr in lrs]
    best = {mixer: best_lr(mqar, mixer) for mixer in MIXERS}
    print(f"best learning rates (seed 0, mean over the settings): {best}; more seeds there")
    mqar += [
        run(mqar_spec(mixer, seed, best[mixer]), flags)
        for mixer in MIXERS
        for seed in range(1, seeds)
    ]
    sweep = mqar_sweep(mqar, lrs)

    # 2. accuracy against the state size, at the mixer's best learning rate
    state = []
    if not args.quick:
        print("state size: trained on (64, 4), seed 0, each mixer's best learning rate")
        points = (("gla", 128, 2),)  # one more state size: the seeds come first (an hour here)
        for mixer, d_model, heads in points:
            state.append(run(mqar_spec(mixer, 0, best[mixer], d_model, heads), flags))
        state += [r for r in mqar if r["seed"] == 0 and r["lr"] == best[r["mixer"]]]

    summary = summarise(sweep, best, state)
    elapsed = time.perf_counter() - t_start
    runs = {"mqar": mqar, "state": state}
    done = provenance([r for rs in runs.values() for r in rs], elapsed)
    print_tables(summary)
    print(
        f"\n{elapsed / 60:.1f} minutes here; {done['train_and_eval_s'] / 60:.1f} minutes of "
        f"training and scoring ({len(done['reused_runs'])} runs reused from earlier invocations)"
    )
    name = "retrieval_quick" if args.quick else "retrieval"  # quick never overwrites the full
    figure = plot(summary, Path(f"bench/results/{name}.png"))
    path = write_result(
        name,
        summary["headline"],
        quick=args.quick,
        steps=steps,
        seeds=seeds,
        learning_rates=lrs,
        **done,
        mqar=summary["mqar"],
        mqar_sweep=summary["sweep"],
        state=summary["state"],
        runs=runs,
        notes=(
            "2 layers, 4 heads (unless stated), vocab 256, 2,048 tokens per step, tiny optimizer "
            "preset with the learning rate swept, each model trained by train.main and scored by "
            "train.eval on 256 fresh sequences per cell; MQAR accuracy per answer token; mqar: per "
            "setting, the learning rate with the best mean over the seeds; runs[...].reused_from "
            "names the run directory of a row reused from an earlier invocation (null: trained "
            "by this one)"
        ),
    )
    print(path, figure)
    return 0


def mqar_sweep(mqar: list[dict], lrs: list[float]) -> list[dict]:
    """Per mixer, learning rate and setting: every seed's accuracy, their mean, min and max."""
    rows = []
    for mixer in MIXERS:
        for lr in lrs:
            for T, P in MQAR_SETTINGS:
                accs = [
                    cell_accuracy(r, seq_len=T, num_pairs=P)
                    for r in mqar
                    if r["mixer"] == mixer and r["lr"] == lr
                ]
                rows.append(
                    {
                        "mixer": LABEL[mixer],
                        "lr": lr,
                        "seq_len": T,
                        "num_pairs": P,
                        "seeds": accs,
                        "mean": statistics.mean(accs),
                        "min": min(accs),
                        "max": max(accs),
                    }
                )
    return rows


def best_lr(mqar: list[dict], mixer: str) -> float:
    """The learning rate whose seed-0 model has the best mean accuracy over the settings."""

    def mean_accuracy(run):
        return statistics.mean(cell_accuracy(run, seq_len=T, num_pairs=P) for T, P in MQAR_SETTINGS)

    runs = [r for r in mqar if r["mixer"] == mixer and r["seed"] == 0]
    return max(runs, key=mean_accuracy)["lr"]


def cell_accuracy(run: dict, **match) -> float:
    cells = [c for c in run["cells"] if all(c.get(k) == v for k, v in match.items())]
    return cells[0]["accuracy"]


def summarise(sweep, best, state) -> dict:
    """The MQAR grid at each mixer's best learning rate (seeds, mean, spread), the state-size
    points."""
    table = []
    for T, P in MQAR_SETTINGS:
        row = {"seq_len": T, "num_pairs": P}
        for mixer in MIXERS:
            label = LABEL[mixer]
            at_best = next(
                r
                for r in sweep
                if (r["mixer"], r["lr"], r["seq_len"], r["num_pairs"]) == (label, best[mixer], T, P)
            )
            row[label] = at_best["mean"]
            row[f"{label}_seeds"] = at_best["seeds"]
            row[f"{label}_lr"] = best[mixer]
        table.append(row)
    points = sorted(
        (
            {
                "mixer": LABEL[r["mixer"]],
                "d_model": r["d_model"],
                "heads": r["heads"],
                "lr": r["lr"],
                "state_per_layer": state_per_layer(r["d_model"], r["heads"]),
                **{
                    f"accuracy_{T}_{P}": cell_accuracy(r, seq_len=T, num_pairs=P)
                    for T, P in MQAR_SETTINGS
                },
            }
            for r in state
        ),
        key=lambda p: (p["mixer"], p["state_per_layer"], p["d_model"]),
    )
    headline = {}
    for row in table:
        for mixer in LABEL.values():
            headline[f"mqar_acc_{mixer}_{row['seq_len']}_{row['num_pairs']}"] = round(row[mixer], 4)
    easiest = next(r for r in table if (r["seq_len"], r["num_pairs"]) == MQAR_SETTINGS[0])
    for name in ("hybrid", "hybrid4"):
        headline[f"mqar_min_seed_{name}_64_4"] = min(easiest[f"{name}_seeds"])  # the worst seed
    return {"headline": headline, "mqar": table, "sweep": sweep, "state": points}


def print_tables(summary: dict) -> None:
    print("\nMQAR accuracy at each setting's best learning rate (mean over seeds; per seed)")
    print(
        f"{'seq_len':>8s} {'pairs':>6s} {'Laplace':>9s} {'attention':>10s} {'hybrid':>9s}"
        f" {'hybrid4':>9s}"
    )
    for r in summary["mqar"]:
        seeds = lambda m, r=r: "/".join(f"{a:.0%}" for a in r[f"{m}_seeds"])  # noqa: E731
        print(
            f"{r['seq_len']:8d} {r['num_pairs']:6d} {r['laplace']:9.1%} {r['attention']:10.1%}"
            f" {r['hybrid']:9.1%} {r['hybrid4']:9.1%}   "
            + " | ".join(f"{m} lr {r[f'{m}_lr']:g}: {seeds(m)}" for m in LABEL.values())
        )
    print("\nMQAR sweep: mean (min to max) over seeds")
    for r in summary["sweep"]:
        print(
            f"  {r['mixer']:9s} lr {r['lr']:<6g} ({r['seq_len']}, {r['num_pairs']}): "
            f"{r['mean']:6.1%} ({r['min']:.1%} to {r['max']:.1%})"
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


def plot(summary: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    ax = axes[0]
    labels = [f"({r['seq_len']}, {r['num_pairs']})" for r in summary["mqar"]]
    x = range(len(labels))
    for off, mixer in zip((-0.3, -0.1, 0.1, 0.3), LABEL.values(), strict=True):
        ax.bar([i + off for i in x], [r[mixer] for r in summary["mqar"]], 0.2, label=mixer)
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
        ax.plot(
            [p["state_per_layer"] for p in laplace],
            [p[f"accuracy_{T}_{P}"] for p in laplace],
            marker + "-",
            label=f"Laplace ({T}, {P})",
        )
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
    return save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
