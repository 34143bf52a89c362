"""Training-step benchmark: the `small` preset at seq_len 2,048 (and 8,192) against the softmax
baseline (`token_mixer=attention`: the same layer with step 4 done by causal softmax attention,
the same parameters, Muon on the same matrices), side by side on this machine.

    python -m bench.train [--quick]

Each model runs the project's jitted training step (`train.step.make_train_step`: forward,
backward, clipping, the Muon + AdamW update, the NaN guard) on all devices JAX sees.
MFU = model FLOPs per token x tokens/s / the fp32 matmul rate (`train.step.measure_matmul_flops`)
probed at the start of the same round. The four steps run interleaved in rounds; every figure is
the median over rounds, with its minimum and maximum (a shared machine is noisy).
Model FLOPs (`laplace_jax.accounting.training_flops_per_token`): 6 x parameters + 3 x the token
mixer's forward terms, chunked GLA or attention's full-square q K^T and P V (attention recomputes
each head's scores in the backward, as FlashAttention does: laplace_jax/attention.py).

Writes bench/results/train.json (headline: mfu, tokens_per_s, gla_over_transformer_speedup_T8192).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import write_result
from laplace_jax import optim
from laplace_jax.accounting import parameter_counts, training_flops_per_token
from laplace_jax.model import LaplaceLM, init_params
from laplace_jax.sharding import (
    abstract_with_shardings,
    make_mesh,
    param_shardings,
)
from laplace_spec.config import LaplaceConfig, get_config
from train.step import make_train_step, measure_matmul_flops


def build_step(kind: str, cfg: LaplaceConfig, batch: int, mesh) -> dict:
    """The compiled training step of one model (`kind`: the token mixer, "gla" or "attention"),
    its state, a batch and its FLOP count."""
    opt_cfg = optim.OPTIMIZER_PRESETS["small"]
    cfg = cfg.replace(token_mixer=kind)
    model = LaplaceLM(cfg)
    host = init_params(cfg, jax.random.key(0))
    shardings = param_shardings(cfg, mesh)
    n_params = parameter_counts(cfg)["total_params"]
    flops_per_token = training_flops_per_token(cfg)
    params = jax.device_put(host, shardings)
    abstract = abstract_with_shardings(params, shardings)
    tx = optim.make_optimizer(opt_cfg, abstract, mesh)
    opt_shardings = optim.opt_state_shardings(tx, abstract, shardings)
    step, _ = make_train_step(model, tx, mesh, shardings, opt_shardings, grad_clip=1.0)
    state = {
        "params": params,
        "opt_state": jax.jit(tx.init, out_shardings=opt_shardings)(params),
        "bad_streak": jnp.zeros((), jnp.int32),
    }
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, batch, cfg.seq_len + 1))
    run = {
        "model": kind,
        "seq_len": cfg.seq_len,
        "batch": batch,
        "params": n_params,
        "flops_per_token": flops_per_token,
        "times_s": [],
    }
    holder = {"state": state, "step": step, "tokens": tokens.astype(np.int32)}
    t0 = time.perf_counter()
    time_step(holder)  # compiles
    run["first_step_s"] = time.perf_counter() - t0
    return run, holder


def time_step(holder) -> float:
    t0 = time.perf_counter()
    holder["state"], m = holder["step"](holder["state"], holder["tokens"])
    jax.block_until_ready(m)
    return time.perf_counter() - t0


def spread(values) -> dict:
    """The median of a list of per-round figures, with its minimum and maximum."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__)
    ap.add_argument("--rounds", type=int, default=7, help="interleaved measurement rounds")
    ap.add_argument("--quick", action="store_true", help="3 rounds instead of --rounds")
    args = ap.parse_args(argv)
    rounds = 3 if args.quick else args.rounds
    mesh = make_mesh()
    n = mesh.size

    base = get_config("small")
    built = []
    # (T, sequences per step): 2 x 2,048 and 1 x 8,192 tokens, rounded up to the device count
    for T, batch in ((2048, max(2, n)), (8192, max(1, n))):
        for kind in ("gla", "attention"):
            built.append(build_step(kind, base.replace(seq_len=T), batch, mesh))
    # Each round probes the matmul rate (the MFU denominator) and then runs every model's step
    # once, so a busy moment of a shared machine hits the probe and all models of that round.
    matmul_rates = []
    for i in range(rounds):
        matmul_rates.append(measure_matmul_flops(mesh))
        for run, holder in built:
            run["times_s"].append(time_step(holder))
        print(
            f"round {i + 1}/{rounds}: {matmul_rates[-1] / 1e9:.1f} GFLOP/s, "
            + ", ".join(f"{r['model']} T={r['seq_len']} {r['times_s'][-1]:.2f}s" for r, _ in built)
        )
    runs = [r for r, _ in built]
    for r in runs:
        tokens = r["batch"] * r["seq_len"]
        r["step_s"] = spread(r["times_s"])
        r["tokens_per_s"] = spread([tokens / t for t in r["times_s"]])
        # MFU of each round against the matmul rate probed in that same round
        per_round = zip(r["times_s"], matmul_rates, strict=True)
        r["mfu"] = spread([r["flops_per_token"] * tokens / t / rate for t, rate in per_round])

    def find(kind, T):
        return next(r for r in runs if r["model"] == kind and r["seq_len"] == T)

    # GLA over attention: the ratio of the two steps of the same round, one per round
    speedup = {}
    for T in (2048, 8192):
        pairs = zip(find("gla", T)["times_s"], find("attention", T)["times_s"], strict=True)
        speedup[T] = spread([a / g for g, a in pairs])
    g2 = find("gla", 2048)
    headline = {
        "mfu": round(g2["mfu"]["median"], 4),
        "tokens_per_s": round(g2["tokens_per_s"]["median"], 1),
        "gla_over_transformer_speedup_T8192": round(speedup[8192]["median"], 3),
    }
    print()
    print("medians over the rounds:")
    print(f"{'model':12s} {'T':>6s} {'params':>11s} {'s/step':>8s} {'tok/s':>9s} {'MFU':>7s}")
    for r in runs:
        print(
            f"{r['model']:12s} {r['seq_len']:6d} {r['params']:11,d} {r['step_s']['median']:8.2f} "
            f"{r['tokens_per_s']['median']:9,.0f} {r['mfu']['median']:7.1%}"
        )
    rate = spread(matmul_rates)
    print(
        f"\nfp32 matmul rate (all {n} devices): median {rate['median'] / 1e9:.1f} GFLOP/s "
        f"({rate['min'] / 1e9:.1f} to {rate['max'] / 1e9:.1f})"
    )
    for T, s in speedup.items():
        print(
            f"GLA over attention at T={T}: median {s['median']:.2f}x "
            f"({s['min']:.2f}x to {s['max']:.2f}x over {rounds} rounds)"
        )
    path = write_result(
        "train",
        headline,
        rounds=rounds,
        matmul_flops_per_s=rate,
        matmul_flops_per_s_rounds=matmul_rates,
        gla_over_transformer_speedup={str(T): s for T, s in speedup.items()},
        runs=runs,
        notes=(
            "small preset (d_model 384, 4 layers, vocab 8192), fp32, one jitted training step "
            "with Muon+AdamW; the attention baseline (token_mixer=attention) is the same model "
            "with softmax attention in place of the GLA: same parameters, same Muon matrices; "
            "after a compiling step, each round probes the fp32 matmul rate and then times one "
            "step of each of the four models; every figure is the median over rounds with its "
            "min and max; a speedup is the ratio of the two steps of the same round; MFU divides "
            "by the matmul rate probed in the same round"
        ),
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
