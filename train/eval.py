"""Evaluate a run's checkpoint in JAX: `python -m train.eval --checkpoint DIR --task TASK`.

`DIR` is a run directory (holding `checkpoints/` and `config.json`), its checkpoint directory, or
one step's directory (`RUN/checkpoints/40`); the newest step unless `--step N`. Only the
parameters are read (no optimizer state); the model config comes from the checkpoint's meta.

Tasks (docs/design.md s9; generators in train/tasks.py):

- `mqar`: accuracy per (sequence length `--seq-lens`, pairs `--pairs`): the greedy argmax of the
  logits at each answer position against its value (`accuracy`, per answer token, zoology's
  measure) and whole sequences with every answer right (`sequence_accuracy`). Lengths beyond the
  training seq_len are allowed (the GLA state is recurrent); every length must be a multiple of
  the model's chunk_size. A (length, pairs) cell with 4 * pairs > length is skipped and listed.
- `passkey`: accuracy per (context length `--context-lens`, depth `--depths`): a hit when the
  greedy argmax gets every digit of the pass key right (`accuracy`; teacher-forced, which is the
  same as greedy decoding when all digits are right); `digit_accuracy` per digit.
- `ppl`: perplexity exp(mean next-token cross-entropy) on the first `--n` windows of validation
  shards (`--data GLOB`, default the run's validation shards), at `--seq-len` (default the
  model's), with the loss by position in the window.

The task's vocabulary (and num_pairs, num_digits, power_a defaults) are the run's when it was
trained on that task (`config.json` data.task / task_params), else the model's vocabulary.
Batches are deterministic: batch i of an MQAR cell comes from seed (SEED, 1, T, P, i), of a
passkey cell from (SEED, 2, T, round(depth * 1e6), i) (`cell_seed`), never a training batch's
(seed, step, process).

Scoring runs through the training step's sharded forward (laplace_jax/fsdp.py): parameters split
over `--mesh` (default every device, fsdp) and gathered layer by layer, and with `context=S` each
sequence split into S slices, so a long-context checkpoint is scored at its length on many
devices; every length must then divide into S slices.

Prints a table, writes `OUT/TASK-stepN.json` and `OUT/TASK-stepN.png` (a heat map; for ppl the
loss by position); `--out` defaults to `RUN/eval/`. A missing or corrupt checkpoint, an unknown
task or a length that is not a multiple of chunk_size exits with status 2 and a message naming it.
"""

from __future__ import annotations

from absl import logging as absl_logging

absl_logging.set_verbosity(absl_logging.ERROR)  # orbax is chatty at import

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from laplace_spec.config import ConfigError, LaplaceConfig  # noqa: E402
from train import tasks  # noqa: E402

TASK_NAMES = ("mqar", "passkey", "ppl")
TASK_IDS = {"mqar": 1, "passkey": 2}  # the second element of a cell's seed
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
LOGIT_BYTES = 1 << 30  # auto batch size: logits of one batch stay under this


class EvalError(ValueError):
    """Bad input to the evaluation (checkpoint, task, lengths); the message names it."""


# ---- command line ---------------------------------------------------------------------------


def _numbers(kind, what: str):
    """An argparse type: comma-separated numbers of `kind` (int or float), at least one."""

    def parse(text: str) -> list:
        try:
            out = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {what}s, got {text!r}"
            ) from e
        if not out:
            raise argparse.ArgumentTypeError(f"expected at least one {what}")
        return out

    return parse


_ints = _numbers(int, "integer")
_floats = _numbers(float, "number")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m train.eval",
        description="Evaluate a training run's checkpoint: MQAR or passkey accuracy, perplexity.",
    )
    ap.add_argument(
        "--checkpoint", required=True, metavar="DIR", help="run, checkpoints or step dir"
    )
    ap.add_argument("--task", required=True, choices=TASK_NAMES, help="what to evaluate")
    ap.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    ap.add_argument("--seq-lens", type=_ints, help="mqar: sequence lengths (default: training's)")
    ap.add_argument("--pairs", type=_ints, help="mqar: key-value pairs (default: training's or 4)")
    ap.add_argument("--power-a", type=float, help="mqar: gap power law (default: training's)")
    ap.add_argument("--context-lens", type=_ints, help="passkey: lengths (default: training's)")
    ap.add_argument("--depths", type=_floats, help="passkey: needle depths in [0, 1]")
    ap.add_argument("--num-digits", type=int, help="passkey: digits (default: training's or 5)")
    ap.add_argument("--vocab", type=int, help="task vocabulary (default: training's or model's)")
    ap.add_argument("--data", help="ppl: glob of validation shards (default: the run's)")
    ap.add_argument("--seq-len", type=int, help="ppl: window length (default: the model's)")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--n", type=int, help="sequences per cell / ppl windows (default 256)")
    size.add_argument("--batches", type=int, help="batches per cell / for ppl (N = batches x B)")
    ap.add_argument("--batch-size", type=int, default=0, help="sequences per batch (0: auto)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the generated batches")
    ap.add_argument(
        "--mesh",
        help="fsdp=F[,data=D][,context=S]: the devices, as train.main's flag; context=S splits "
        "each sequence into S slices (default: every device, fsdp)",
    )
    ap.add_argument("--out", help="output directory (default: RUN/eval)")
    return ap.parse_args(argv)


# ---- the checkpoint -------------------------------------------------------------------------


def locate(path: str | Path, step: int | None) -> tuple[Path, int, Path]:
    """(checkpoint directory, step, run directory) of `--checkpoint PATH [--step N]`."""
    p = Path(path).absolute()
    if not p.exists():
        raise EvalError(f"--checkpoint {path}: no such directory")
    if not p.is_dir():
        raise EvalError(f"--checkpoint {path}: not a directory")
    if p.name.isdigit() and any(
        (p / n).exists() for n in ("params", "meta", "_CHECKPOINT_METADATA")
    ):
        if step is not None and step != int(p.name):
            raise EvalError(f"--checkpoint {path} is step {p.name}, but --step {step} was given")
        ckpt_dir, step = p.parent, int(p.name)
    elif (p / "checkpoints").is_dir():
        ckpt_dir = p / "checkpoints"
    else:
        ckpt_dir = p
    run_dir = ckpt_dir.parent  # holds config.json when the trainer wrote it
    steps = sorted(int(c.name) for c in ckpt_dir.iterdir() if c.is_dir() and c.name.isdigit())
    if not steps:
        raise EvalError(
            f"--checkpoint {path}: no checkpoints in {ckpt_dir} (expected a run directory, its "
            "checkpoints/ directory, or one step's directory such as RUN/checkpoints/40)"
        )
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise EvalError(f"no checkpoint step {step} in {ckpt_dir} (steps: {steps})")
    return ckpt_dir, step, run_dir


def load_checkpoint(ckpt_dir: Path, step: int, mesh) -> tuple[LaplaceConfig, dict, dict]:
    """(model config, params, meta) of one checkpoint, the params sharded over `mesh` as in
    training (the rules table of laplace_jax/sharding.py: a model too large for one device is
    evaluated across them); EvalError naming the checkpoint when it is missing, corrupt or holds
    other arrays than its config builds (train/checkpoint.py's reader)."""
    from laplace_jax.model import abstract_params
    from laplace_jax.sharding import abstract_with_shardings, param_shardings
    from train.checkpoint import CheckpointReader, ReadError

    where = ckpt_dir / str(step)
    try:
        with CheckpointReader(ckpt_dir) as reader:
            step = reader.step(step)
            meta = reader.meta(step)
            if not isinstance(meta, dict) or not isinstance(meta.get("model"), dict):
                raise EvalError(f"checkpoint {where} is corrupt: its meta holds no model config")
            try:
                cfg = LaplaceConfig.from_saved(meta["model"])
            except (ConfigError, TypeError, ValueError) as e:
                raise EvalError(f"checkpoint {where}: its model config is invalid ({e})") from e
            shardings = param_shardings(cfg, mesh)
            target = abstract_with_shardings(abstract_params(cfg), shardings)
            params = reader.params(step, target)
    except ReadError as e:
        raise EvalError(str(e)) from e
    return cfg, params, meta


def read_run_config(run_dir: Path) -> dict:
    path = run_dir / "config.json"
    if not path.is_file():
        return {}
    try:
        out = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EvalError(f"{path} is not valid JSON ({e})") from e
    return out if isinstance(out, dict) else {}


# ---- scoring --------------------------------------------------------------------------------


def score(preds: np.ndarray, tokens: np.ndarray, mask: np.ndarray) -> dict[str, int]:
    """Counts of one batch: greedy predictions [B, T] against targets tokens[:, 1:] at the
    answer positions mask [B, T]: answers, correct answers, sequences, sequences all right."""
    hit = (np.asarray(preds) == np.asarray(tokens)[:, 1:]) & mask
    per_seq = mask.sum(1)
    return {
        "answers": int(per_seq.sum()),
        "correct": int(hit.sum()),
        "sequences": int(mask.shape[0]),
        "sequences_correct": int((hit.sum(1) == per_seq).sum()),
    }


def cell_seed(seed: int, task: str, length: int, setting: float) -> tuple[int, ...]:
    """The seed prefix of a cell's batches (batch i adds i): setting is the pairs for MQAR, the
    depth for passkey."""
    key = int(setting) if task == "mqar" else int(round(setting * 1e6))
    return (seed, TASK_IDS[task], length, key)


def auto_batch(length: int, vocab: int, requested: int) -> int:
    if requested:
        return requested
    b = 32
    while b > 1 and b * length * vocab * 4 > LOGIT_BYTES:
        b //= 2
    return b


def make_scorer(cfg: LaplaceConfig, mesh):
    """f(params, tokens [B, T + 1] numpy) -> (ce [B, T], greedy next token [B, T]) numpy, from
    the training step's sharded forward on `mesh` (laplace_jax/fsdp.py `make_token_scores`:
    weights gathered layer by layer, each sequence split over a context axis, the head a block
    of tokens at a time). B is padded to a multiple of the mesh's sequence groups."""
    from laplace_jax.fsdp import make_token_scores
    from laplace_jax.model import LaplaceLM
    from laplace_jax.sharding import CONTEXT, logical_sharding, param_specs

    scores = jax.jit(make_token_scores(LaplaceLM(cfg), mesh, param_specs(cfg, mesh)))
    groups = mesh.size // mesh.shape.get(CONTEXT, 1)
    sharding = logical_sharding(mesh, ("batch", "window"))

    def score_tokens(params, tokens):
        B = tokens.shape[0]
        padded = np.concatenate([tokens, np.zeros((-B % groups, tokens.shape[1]), tokens.dtype)])
        ce, greedy = scores(params, jax.device_put(jnp.asarray(padded, jnp.int32), sharding))
        return np.asarray(ce)[:B], np.asarray(greedy)[:B]

    return score_tokens


def check_lengths(flag: str, lengths: list[int], cfg: LaplaceConfig, context: int = 1) -> None:
    for t in lengths:
        if t <= 0 or t % cfg.chunk_size:
            raise EvalError(
                f"{flag}: {t} is not a positive multiple of the model's chunk_size "
                f"({cfg.chunk_size}); the chunked forward needs whole chunks"
            )
        if t % context or t // context < cfg.conv_width:
            raise EvalError(
                f"{flag}: {t} does not split into context={context} slices of at least "
                f"{cfg.conv_width} tokens (the --mesh context axis)"
            )


def eval_grid(
    task, cfg, params, settings: dict, lengths, values, n, batches, batch_size, seed, say, mesh
):
    """Results of each (length, value) cell of a task (value: pairs for MQAR, depth for
    passkey), and the cells skipped as invalid."""
    score_tokens = make_scorer(cfg, mesh)
    results, skipped = [], []
    value_key = "num_pairs" if task == "mqar" else "depth"
    for T in lengths:
        B = auto_batch(T, cfg.vocab_size, batch_size)
        n_batches = batches or max(1, math.ceil(n / B))
        for v in values:
            kw = {**settings, value_key: v}
            try:
                tasks.generate(task, kw, 1, T, 0)
            except tasks.TaskError as e:
                skipped.append({"seq_len": T, value_key: v, "reason": str(e)})
                continue
            t0 = time.perf_counter()
            total = {"answers": 0, "correct": 0, "sequences": 0, "sequences_correct": 0}
            prefix = cell_seed(seed, task, T, v)
            for i in range(n_batches):
                tokens, mask = tasks.generate(task, kw, B, T, (*prefix, i))
                _, preds = score_tokens(params, tokens)  # [B, T] greedy next tokens
                for k, c in score(preds, tokens, mask).items():
                    total[k] += c
            token_acc = total["correct"] / total["answers"]
            seq_acc = total["sequences_correct"] / total["sequences"]
            row = {"seq_len": T, value_key: v}
            if task == "mqar":
                row |= {"accuracy": token_acc, "sequence_accuracy": seq_acc}
            else:
                row |= {"accuracy": seq_acc, "digit_accuracy": token_acc}
            row |= total | {
                "beyond_training_length": T > cfg.seq_len,
                "seconds": round(time.perf_counter() - t0, 3),
            }
            results.append(row)
            say(f"  {task} seq_len {T} {value_key} {v}: accuracy {row['accuracy']:.1%}")
    if not results:
        raise EvalError(
            f"{task}: no valid (length, {value_key}) cell: "
            + "; ".join(f"({s['seq_len']}, {s[value_key]}): {s['reason']}" for s in skipped)
        )
    return results, skipped


def eval_ppl(cfg, params, paths, seq_len, n, batch_size, say, mesh) -> dict:
    """Perplexity exp(mean token cross-entropy) over the first n windows of the shards."""
    from train.data import TokenWindows

    try:
        source = TokenWindows(paths, seq_len)
    except (OSError, ValueError) as e:  # a ShardError is a ValueError
        raise EvalError(f"--data: {e}") from e
    score_tokens = make_scorer(cfg, mesh)

    windows = min(n, len(source))
    B = auto_batch(seq_len, cfg.vocab_size, batch_size)
    by_pos = np.zeros(seq_len, np.float64)
    total, count, batches = 0.0, 0, 0
    for start in range(0, windows, B):
        batch = np.stack([source[i] for i in range(start, min(start + B, windows))])
        if batch.max() >= cfg.vocab_size:
            raise EvalError(
                f"--data: token id {int(batch.max())} is outside the model's vocabulary "
                f"({cfg.vocab_size})"
            )
        losses = np.asarray(score_tokens(params, batch)[0], np.float64)  # [B, T]
        by_pos += losses.sum(0)
        total += losses.sum()
        count += losses.size
        batches += 1
    loss = total / count
    say(f"  ppl: {windows} windows of {seq_len}: loss {loss:.4f}, perplexity {math.exp(loss):.3f}")
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "windows": windows,
        "tokens": count,
        "batches": batches,
        "batch_size": B,
        "seq_len": seq_len,
        "loss_by_position": (by_pos / windows).tolist(),
        "data": list(paths),
    }


# ---- output ---------------------------------------------------------------------------------


def grid(report: dict) -> tuple[str, str, list, list, dict]:
    """(row label, column label, rows, columns, {(row, col): result}) of a task's report."""
    task, res = report["task"], report["results"]
    if task == "mqar":
        rows, cols = report["settings"]["seq_lens"], report["settings"]["pairs"]
        cells = {(r["seq_len"], r["num_pairs"]): r for r in res}
        return "seq_len", "pairs", rows, cols, cells
    rows, cols = report["settings"]["depths"], report["settings"]["context_lens"]
    cells = {(r["depth"], r["seq_len"]): r for r in res}
    return "depth", "context length", rows, cols, cells


def print_table(report: dict) -> None:
    title = f"{report['task']} @ step {report['step']} ({report['checkpoint']})"
    if report["task"] == "ppl":
        r = report["results"]
        lines = [
            ("loss (nats/token)", f"{r['loss']:.4f}"),
            ("perplexity", f"{r['perplexity']:.3f}"),
            ("windows x seq_len", f"{r['windows']} x {r['seq_len']}"),
        ]
        header, body = ["", "value"], [list(x) for x in lines]
        caption = ""
    else:
        rlab, clab, rows, cols, cells = grid(report)
        second = "sequence_accuracy" if report["task"] == "mqar" else "digit_accuracy"
        header = [f"{rlab} \\ {clab}", *map(str, cols)]
        body = []
        for r in rows:
            line = [str(r)]
            for c in cols:
                cell = cells.get((r, c))
                line.append("-" if cell is None else f"{cell['accuracy']:.1%} ({cell[second]:.0%})")
            body.append(line)
        caption = f"accuracy ({second.replace('_', ' ')}); -: skipped (see the JSON)"
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
        for row in [header, *body]:
            print("  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)))
        if caption:
            print(caption)
        return
    console = Console(width=max(100, 14 * len(header)))
    console.print(title)
    table = Table(caption=caption or None)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right")
    for row in body:
        table.add_row(*row)
    console.print(table)


def plot(report: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    title = f"{report['task']} @ step {report['step']}: {report['run_dir']}"
    if report["task"] == "ppl":
        r = report["results"]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(np.arange(1, r["seq_len"] + 1), r["loss_by_position"], color="tab:blue")
        ax.set_xlabel("position in the window")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(f"perplexity {r['perplexity']:.3f} ({r['windows']} windows)", fontsize=10)
        ax.grid(alpha=0.3)
    else:
        rlab, clab, rows, cols, cells = grid(report)
        acc = np.full((len(rows), len(cols)), np.nan)
        for i, r in enumerate(rows):
            for j, c in enumerate(cols):
                if (r, c) in cells:
                    acc[i, j] = cells[(r, c)]["accuracy"]
        fig, ax = plt.subplots(figsize=(1.2 * len(cols) + 3, 0.6 * len(rows) + 2.2))
        im = ax.imshow(acc, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for i in range(len(rows)):
            for j in range(len(cols)):
                skip = np.isnan(acc[i, j])
                text = "skipped" if skip else f"{acc[i, j]:.0%}"
                color = "black" if skip or acc[i, j] > 0.6 else "white"
                ax.text(j, i, text, ha="center", va="center", color=color, fontsize=9)
        ax.set_xticks(range(len(cols)), [str(c) for c in cols])
        ax.set_yticks(range(len(rows)), [str(r) for r in rows])
        ax.set_xlabel(clab)
        ax.set_ylabel(rlab)
        fig.colorbar(im, ax=ax, label="accuracy")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ---- the evaluation -------------------------------------------------------------------------


def task_settings(task: str, args, cfg: LaplaceConfig, run_cfg: dict) -> dict:
    """The generator's fixed parameters: flags, else the run's task parameters, else defaults."""
    data = run_cfg.get("data") or {}
    trained = data.get("task_params") if data.get("task") == task else None
    trained = trained if isinstance(trained, dict) else {}
    vocab = args.vocab or trained.get("vocab_size") or cfg.vocab_size
    if vocab > cfg.vocab_size:
        raise EvalError(f"--vocab {vocab} exceeds the model's vocab_size {cfg.vocab_size}")
    if task == "mqar":
        power_a = args.power_a if args.power_a is not None else trained.get("power_a", 0.01)
        return {"vocab_size": vocab, "power_a": power_a}
    digits = args.num_digits or trained.get("num_digits", 5)
    return {"vocab_size": vocab, "num_digits": digits, "queries": trained.get("queries", 1)}


def evaluate(args, say=print) -> tuple[dict, Path]:
    """The report of `args` (parsed flags) and the output directory; EvalError on bad input."""
    from laplace_jax.sharding import CONTEXT
    from train.cli import mesh_from_flag, mesh_text

    ckpt_dir, step, run_dir = locate(args.checkpoint, args.step)
    run_cfg = read_run_config(run_dir)
    try:
        mesh = mesh_from_flag(args.mesh)
    except ConfigError as e:
        raise EvalError(str(e)) from e
    context = mesh.shape.get(CONTEXT, 1)
    cfg, params, meta = load_checkpoint(ckpt_dir, step, mesh)
    n = args.n if args.n is not None else 256
    if n <= 0 or (args.batches is not None and args.batches <= 0) or args.batch_size < 0:
        raise EvalError("--n, --batches and --batch-size must be positive")
    data = run_cfg.get("data") or {}
    report: dict[str, Any] = {
        "task": args.task,
        "checkpoint": str(ckpt_dir / str(step)),
        "run_dir": str(run_dir),
        "step": step,
        "model": cfg.to_dict(),
        "trained_on": {k: data[k] for k in ("task", "task_params") if k in data} or "token shards",
        "seed": args.seed,
        "mesh": dict(mesh.shape),
    }
    say(f"evaluating {args.task} on {ckpt_dir / str(step)} (mesh {mesh_text(mesh)})")
    if args.task == "ppl":
        from train.shards import expand_shards

        seq_len = args.seq_len or cfg.seq_len
        check_lengths("--seq-len", [seq_len], cfg, context)
        if args.data:
            try:
                paths = expand_shards(args.data)
            except (OSError, ValueError) as e:  # a ShardError is a ValueError
                raise EvalError(f"--data {args.data}: {e}") from e
        else:
            paths = data.get("val") or []
            if not paths:
                raise EvalError(
                    "ppl: the run has no validation shards in its config.json: pass --data GLOB"
                )
        if args.batches is not None:
            n = args.batches * auto_batch(seq_len, cfg.vocab_size, args.batch_size)
        report["results"] = eval_ppl(cfg, params, paths, seq_len, n, args.batch_size, say, mesh)
    else:
        settings = task_settings(args.task, args, cfg, run_cfg)
        data_params = data.get("task_params") if data.get("task") == args.task else {}
        if args.task == "mqar":
            lengths = args.seq_lens or [cfg.seq_len]
            values = args.pairs or [(data_params or {}).get("num_pairs", 4)]
            flag = "--seq-lens"
        else:
            lengths = args.context_lens or [cfg.seq_len]
            values = args.depths or list(DEFAULT_DEPTHS)
            flag = "--context-lens"
            bad = [d for d in values if not 0 <= d <= 1]
            if bad:
                raise EvalError(f"--depths: {bad[0]} is outside [0, 1]")
        check_lengths(flag, lengths, cfg, context)
        lengths, values = sorted(set(lengths)), sorted(set(values))
        results, skipped = eval_grid(
            args.task,
            cfg,
            params,
            settings,
            lengths,
            values,
            n,
            args.batches,
            args.batch_size,
            args.seed,
            say,
            mesh,
        )
        key = "seq_lens" if args.task == "mqar" else "context_lens"
        vkey = "pairs" if args.task == "mqar" else "depths"
        report["settings"] = {
            **settings,
            key: lengths,
            vkey: values,
            "sequences_per_cell": None if args.batches else n,
            "batches_per_cell": args.batches,
        }
        report["training_seq_len"] = cfg.seq_len
        report["results"], report["skipped"] = results, skipped
    out = Path(args.out) if args.out else run_dir / "eval"
    return report, out


def write_outputs(report: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{report['task']}-step{report['step']}"
    json_path = out / f"{stem}.json"
    json_path.write_text(json.dumps(report, indent=2))
    return json_path, plot(report, out / f"{stem}.png")


def main(argv=None) -> int:
    args = parse_args(argv)  # argparse exits 2 on an unknown task or a malformed flag
    try:
        report, out = evaluate(args)
    except (EvalError, tasks.TaskError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_table(report)
    json_path, png = write_outputs(report, out)
    print(f"wrote {json_path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
