"""Probe a trained hybrid (docs/design.md s13.5): which layer does its recall, and how large
each GLA branch has grown beside the token embedding.

    python -m bench.hybrid_probe RUN_DIR [RUN_DIR ...] [--result NAME]

For each run directory of bench.retrieval, bench.hybrid_init or bench.passkey
(`runs/bench-retrieval/<run>`, its checkpoint at the last step), on fresh sequences of the task
it was trained on: the accuracy as trained, and with each layer's mixer output projection zeroed
(that layer's whole mixer contribution removed, as tests/test_hybrid_recall.py does for the
attention layer). MQAR: at (64, 4) and (128, 8). Passkey: at 64 and 256 tokens, the needle at
depth 0 and 1 (256 sequences a cell). Then, on MQAR (64, 4) sequences (the passkey's own for a
passkey run), the RMS of what each GLA layer's mixer branch writes into the stream (`s y`,
`s (1 + w) y` or `s (1 + w) RMSNorm(y)`, by its `gla_branch`) over the RMS of the scaled
embedding, and for MQAR the identity cosine of bench.hybrid_init at the first attention layer's
input (a key's pair position against where the key comes back as a query), after training.
Prints one block per run; with `--result NAME` also writes bench/results/NAME.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import numpy as np

from bench.common import write_result
from bench.hybrid_init import key_query_cosine, residual_parts
from train import eval as train_eval
from train.cli import mesh_from_flag
from train.tasks import mqar, passkey

VOCAB = 256  # bench.retrieval's task vocabulary


def accuracy(score_tokens, params, seq_len: int, pairs: int) -> float:
    """MQAR accuracy per answer token on fresh sequences, scored as train.eval scores them."""
    tokens, mask = mqar(128, seq_len, pairs, VOCAB, seed=(7, seq_len, pairs))
    _, greedy = score_tokens(params, tokens)
    counts = train_eval.score(greedy, tokens, mask)
    return counts["correct"] / counts["answers"]


def passkey_accuracies(cfg, params, mesh) -> dict[str, float]:
    """Passkey accuracy per sequence at (64 and 256 tokens, depth 0 and 1), as train.eval scores."""

    def quiet(line: str) -> None:
        pass

    settings = {"vocab_size": VOCAB, "num_digits": 5, "queries": 1}
    cells, _ = train_eval.eval_grid(
        "passkey", cfg, params, settings, [64, 256], [0.0, 1.0], 256, None, 64, 0, quiet, mesh
    )
    return {f"{c['seq_len']}_depth{c['depth']:g}": c["accuracy"] for c in cells}


def without_mixer(params, layer: str):
    """`params` with `layer`'s mixer output projection zeroed (every branch form writes 0)."""
    out = {**params[layer]["out"], "kernel": np.zeros_like(params[layer]["out"]["kernel"])}
    return {**params, layer: {**params[layer], "out": out}}


def branch_rms_over_embedding(cfg, params, tokens) -> dict[str, float]:
    """{layer: RMS of what that GLA layer's mixer branch writes / RMS of the scaled embedding}
    on `tokens` [B, T] (the whole model run once, the branches' outputs captured)."""
    import jax.numpy as jnp

    from laplace_jax.model import LaplaceLM

    model = LaplaceLM(cfg)
    embedding = model.apply({"params": params}, jnp.asarray(tokens), method=_scaled_embedding)
    _, captured = model.apply(
        {"params": params},
        jnp.asarray(tokens),
        capture_intermediates=lambda module, _: module.name == "branch",
        mutable=["intermediates"],
    )
    rms = lambda x: float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))  # noqa: E731
    return {
        f"layer_{i}": round(
            rms(captured["intermediates"][f"layer_{i}"]["branch"]["__call__"][0]) / rms(embedding),
            3,
        )
        for i, mixer in enumerate(cfg.layer_mixers)
        if mixer == "gla"
    }


def _scaled_embedding(model, tokens):
    return model.embed(tokens) * model.config.embed_multiplier


def probe(run: Path) -> dict:
    ckpt = run / "checkpoints"
    step = max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    mesh = mesh_from_flag("fsdp=1")
    cfg, params, _ = train_eval.load_checkpoint(ckpt, step, mesh)
    params = jax.device_get(params)
    score_tokens = train_eval.make_scorer(cfg, mesh)
    task = (train_eval.read_run_config(run).get("data") or {}).get("task", "mqar")
    print(f"{run.name}: layers {cfg.layer_mixers}, embedding x {cfg.embed_multiplier:.3g}")

    def accuracies(p) -> dict[str, float]:
        if task.startswith("passkey"):
            return passkey_accuracies(cfg, p, mesh)
        return {f"{T}_{P}": accuracy(score_tokens, p, T, P) for T, P in ((64, 4), (128, 8))}

    out = {"run": run.name, "task": task, "layers": list(cfg.layer_mixers)}
    out["as_trained"] = accuracies(params)
    out["zeroed"] = {
        f"layer_{i}": accuracies(without_mixer(params, f"layer_{i}")) for i in range(cfg.n_layers)
    }
    print("  as trained:", _cells(out["as_trained"]))
    for i, mixer in enumerate(cfg.layer_mixers):
        print(f"  layer {i} ({mixer}) output zeroed:", _cells(out["zeroed"][f"layer_{i}"]))
    if task.startswith("passkey"):
        tokens, _ = passkey(64, 64, -1, VOCAB, seed=(0, 64))  # needles at random depths
    else:
        tokens, _ = mqar(64, 64, 4, VOCAB, seed=(0, 64, 4))
    tokens = tokens[:, :-1]
    out["gla_branch_rms_over_embedding"] = branch_rms_over_embedding(cfg, params, tokens)
    print("  each GLA branch's RMS over the embedding's:", out["gla_branch_rms_over_embedding"])
    if not task.startswith("passkey"):
        xs = residual_parts(cfg, params, tokens)
        out["identity_cosine"] = round(key_query_cosine(xs[-1], tokens), 3)
        print(f"  identity cosine at the attention layer's input: {out['identity_cosine']:.2f}")
    return out


def _cells(accs: dict[str, float]) -> str:
    return ", ".join(f"{a:.1%} at {cell}" for cell, a in accs.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hybrid_probe", description=__doc__)
    ap.add_argument("runs", nargs="+", type=Path, help="run directories")
    ap.add_argument("--result", help="also write bench/results/<RESULT>.json")
    args = ap.parse_args(argv)
    probes = [probe(run) for run in args.runs]
    if args.result:
        print(write_result(args.result, {}, probes=probes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
