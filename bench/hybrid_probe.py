"""Probe a trained hybrid (docs/design.md s13.5): which layer does its recall.

    python -m bench.hybrid_probe RUN_DIR [RUN_DIR ...]

For each run directory of bench.retrieval or bench.passkey (`runs/bench-retrieval/<run>`, its
checkpoint at the last step), on fresh sequences of the task it was trained on: the accuracy as
trained, and with each layer's mixer output projection zeroed (that layer's whole mixer
contribution removed, as tests/test_hybrid_recall.py does for the attention layer). MQAR: at
(64, 4) and (128, 8), then, at the first attention layer's input, the RMS of the scaled
embedding and of what each layer before it adds, and the identity cosine of bench.hybrid_init (a
key's pair position against where the key comes back as a query), here after training. Passkey:
at 64 and 256 tokens, the needle at depth 0 and 1 (256 sequences a cell). Prints one block per
run; writes nothing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import numpy as np

from bench.hybrid_init import key_query_cosine, residual_parts
from train import eval as train_eval
from train.cli import mesh_from_flag
from train.tasks import mqar

VOCAB = 256  # bench.retrieval's task vocabulary


def accuracy(score_tokens, params, seq_len: int, pairs: int) -> float:
    """MQAR accuracy per answer token on fresh sequences, scored as train.eval scores them."""
    tokens, mask = mqar(128, seq_len, pairs, VOCAB, seed=(7, seq_len, pairs))
    _, greedy = score_tokens(params, tokens)
    counts = train_eval.score(greedy, tokens, mask)
    return counts["correct"] / counts["answers"]


def passkey_accuracies(cfg, params, mesh) -> str:
    """Passkey accuracy per sequence at (64 and 256 tokens, depth 0 and 1), as train.eval scores."""

    def quiet(line: str) -> None:
        pass

    settings = {"vocab_size": VOCAB, "num_digits": 5, "queries": 1}
    cells, _ = train_eval.eval_grid(
        "passkey", cfg, params, settings, [64, 256], [0.0, 1.0], 256, None, 64, 0, quiet, mesh
    )
    return ", ".join(f"{c['accuracy']:.1%} at ({c['seq_len']}, {c['depth']:g})" for c in cells)


def without_mixer(params, layer: str):
    """`params` with `layer`'s mixer output projection zeroed."""
    out = {**params[layer]["out"], "kernel": np.zeros_like(params[layer]["out"]["kernel"])}
    return {**params, layer: {**params[layer], "out": out}}


def probe(run: Path) -> None:
    ckpt = run / "checkpoints"
    step = max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    mesh = mesh_from_flag("fsdp=1")
    cfg, params, _ = train_eval.load_checkpoint(ckpt, step, mesh)
    params = jax.device_get(params)
    score_tokens = train_eval.make_scorer(cfg, mesh)
    task = (train_eval.read_run_config(run).get("data") or {}).get("task", "mqar")
    print(f"{run.name}: layers {cfg.layer_mixers}, embedding x {cfg.embed_multiplier:.3g}")

    def accuracies(p) -> str:
        if task == "passkey":
            return passkey_accuracies(cfg, p, mesh)
        return ", ".join(f"{accuracy(score_tokens, p, *s):.1%} at {s}" for s in ((64, 4), (128, 8)))

    print("  as trained:", accuracies(params))
    for i, mixer in enumerate(cfg.layer_mixers):
        print(
            f"  layer {i} ({mixer}) output zeroed:", accuracies(without_mixer(params, f"layer_{i}"))
        )
    if task != "mqar":
        return
    tokens, _ = mqar(64, 64, 4, VOCAB, seed=(0, 64, 4))
    tokens = tokens[:, :-1]
    xs = residual_parts(cfg, params, tokens)
    rms = [float(np.sqrt(np.mean(x**2))) for x in (xs[0], *np.diff(xs, axis=0))]
    adds = ", ".join(f"{r:.3g}" for r in rms[1:])
    print(f"  at the attention layer's input: embedding RMS {rms[0]:.3g}; each layer adds {adds}")
    print(f"  identity cosine there: {key_query_cosine(xs[-1], tokens):.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hybrid_probe", description=__doc__)
    ap.add_argument("runs", nargs="+", type=Path, help="run directories")
    for run in ap.parse_args(argv).runs:
        probe(run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
