"""Training-step benchmark: the `small` preset at seq_len 2,048 (and 8,192) against a softmax
transformer of the same width, depth and parameter count, side by side on this machine.

    python -m bench.train [--quick]

Each model runs the project's jitted training step (`train.step.make_train_step`: forward,
backward, clipping, the Muon + AdamW update, the NaN guard) on all devices JAX sees.
MFU = model FLOPs per token x tokens/s / the fp32 matmul rate measured in the same run
(`train.step.measure_matmul_flops`, the better of two measurements, before and after).
The four steps run interleaved in rounds; the best round counts (a shared machine is noisy).
Model FLOPs: GLA 6 x parameters + the chunked-GLA terms (`laplace_jax.accounting`); transformer
6 x parameters + 12 x layers x T x d_model (QK^T and AV, forward and backward, full square).

Writes bench/results/train.json (headline: mfu, tokens_per_s, gla_over_transformer_speedup_T8192).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bench.common import write_result
from laplace_jax import optim
from laplace_jax.accounting import parameter_counts, training_flops_per_token
from laplace_jax.model import Dense, LaplaceLM, LayerNorm, init_params
from laplace_jax.sharding import (
    abstract_with_shardings,
    boxed_shardings,
    make_mesh,
    param_shardings,
)
from laplace_spec.config import LaplaceConfig, get_config
from train.step import make_train_step, measure_matmul_flops


def causal_attention(q, k, v):
    """Softmax attention, q, k, v: [B, T, H, dh] -> [B, T, H, dh], one head at a time.

    Each head's scores are recomputed in the backward pass instead of stored, as
    FlashAttention does: at T = 8,192 storing them would take 4 layers x 6 heads x 268 MB.
    """
    T, dh = q.shape[1], q.shape[-1]
    causal = jnp.tril(jnp.ones((T, T), bool))

    @jax.checkpoint
    def one_head(qkv):  # [B, T, dh] each
        qh, kh, vh = qkv
        s = jnp.einsum("btd,bsd->bts", qh, kh) * dh**-0.5
        p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
        return jnp.einsum("bts,bsd->btd", p, vh)

    heads_first = lambda x: x.transpose(2, 0, 1, 3)  # noqa: E731
    o = jax.lax.map(one_head, (heads_first(q), heads_first(k), heads_first(v)))
    return o.transpose(1, 2, 0, 3)


class TransformerLM(nn.Module):
    """Pre-norm softmax-attention transformer with Laplace's widths and parameter names.

    Per layer: fused W_qkv [D, 3D] and W_out [D, D] -- 4 D^2 parameters, the same as Laplace's
    W_qkvg [D, 3D] + W_out -- causal attention over n_heads heads of D / n_heads, then the same
    GLU channel mixer. Its parameter paths (`layer_{i}_qkvg/kernel`) are not Laplace's
    (`layer_{i}/qkvg/kernel`), so the optimizer's path rule sends all of them to AdamW: this
    baseline trains without Muon while Laplace uses it (issue 10 replaces it with a softmax
    baseline on Muon, trained by the same trainer).
    No positional encoding (its cost is negligible next to attention). Attention recomputes
    its scores in the backward pass, like FlashAttention (see `causal_attention`).
    """

    config: LaplaceConfig

    @nn.compact
    def __call__(self, tokens):
        cfg = self.config
        D, H, F = cfg.d_model, cfg.n_heads, cfg.ffn_dim
        dtype = jnp.dtype(cfg.compute_dtype)
        embed_init = nn.with_logical_partitioning(
            nn.initializers.normal(cfg.init_std), ("vocab", "embed")
        )
        x = nn.Embed(cfg.vocab_size, D, embedding_init=embed_init, name="embed")(tokens)
        B, T = tokens.shape
        for i in range(cfg.n_layers):
            h = LayerNorm(cfg.norm_eps, name=f"layer_{i}_ln_1")(x)
            qkv = Dense(3 * D, ("embed", "qkvg"), D**-0.5, dtype, name=f"layer_{i}_qkvg")(h)
            q, k, v = (a.reshape(B, T, H, D // H) for a in jnp.split(qkv, 3, -1))
            o = causal_attention(q, k, v).reshape(B, T, D)
            x = x + Dense(D, ("attn", "embed"), D**-0.5, dtype, name=f"layer_{i}_out")(o)
            h2 = LayerNorm(cfg.norm_eps, name=f"layer_{i}_ln_2")(x)
            gate, up = jnp.split(
                Dense(2 * F, ("embed", "mlp"), D**-0.5, dtype, name=f"layer_{i}_w12")(h2), 2, -1
            )
            x = x + Dense(D, ("mlp", "embed"), F**-0.5, dtype, name=f"layer_{i}_w3")(
                nn.silu(gate) * up
            )
        x = LayerNorm(cfg.norm_eps, name="ln_f")(x)
        logits = Dense(cfg.vocab_size, ("embed", "vocab"), cfg.init_std, dtype, name="lm_head")(x)
        return logits.astype(jnp.float32), None


def _transformer_boxed(cfg, key):
    return TransformerLM(cfg).init(key, jnp.zeros((1, 8), jnp.int32))["params"]


def build_step(kind: str, cfg: LaplaceConfig, batch: int, mesh) -> dict:
    """The compiled training step of one model, its state, a batch and its FLOP count."""
    opt_cfg = optim.OPTIMIZER_PRESETS["small"]
    if kind == "gla":
        model = LaplaceLM(cfg)
        host = init_params(cfg, jax.random.key(0))
        shardings = param_shardings(cfg, mesh)
        n_params = parameter_counts(cfg)["total_params"]
        flops_per_token = training_flops_per_token(cfg)
    else:
        model = TransformerLM(cfg)
        host = nn.unbox(_transformer_boxed(cfg, jax.random.key(0)))
        boxed = jax.eval_shape(lambda k: _transformer_boxed(cfg, k), jax.random.key(0))
        shardings = boxed_shardings(boxed, mesh)
        n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(host))
        flops_per_token = 6 * n_params + 12 * cfg.n_layers * cfg.seq_len * cfg.d_model
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.train", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="2 rounds instead of 3")
    args = ap.parse_args(argv)
    rounds = 2 if args.quick else 3
    mesh = make_mesh()
    n = mesh.size
    peak_before = measure_matmul_flops(mesh)

    base = get_config("small")
    built = []
    # (T, sequences per step): 2 x 2,048 and 1 x 8,192 tokens, rounded up to the device count
    for T, batch in ((2048, max(2, n)), (8192, max(1, n))):
        for kind in ("gla", "transformer"):
            built.append(build_step(kind, base.replace(seq_len=T), batch, mesh))
    # rounds interleave the models, so a busy moment of a shared machine hits all of them
    for i in range(rounds):
        for run, holder in built:
            run["times_s"].append(time_step(holder))
        print(
            f"round {i + 1}/{rounds}: "
            + ", ".join(f"{r['model']} T={r['seq_len']} {r['times_s'][-1]:.2f}s" for r, _ in built)
        )
    runs = [r for r, _ in built]
    for r in runs:  # the best round: the least disturbed by other work on the machine
        r["step_s"] = min(r["times_s"])
        r["step_s_median"] = statistics.median(r["times_s"])
        r["tokens_per_s"] = r["batch"] * r["seq_len"] / r["step_s"]
    peak = max(peak_before, measure_matmul_flops(mesh))
    for r in runs:
        r["mfu"] = r["flops_per_token"] * r["tokens_per_s"] / peak

    def find(kind, T):
        return next(r for r in runs if r["model"] == kind and r["seq_len"] == T)

    g2, t2 = find("gla", 2048), find("transformer", 2048)
    g8, t8 = find("gla", 8192), find("transformer", 8192)
    headline = {
        "mfu": round(g2["mfu"], 4),
        "tokens_per_s": round(g2["tokens_per_s"], 1),
        "gla_over_transformer_speedup_T8192": round(g8["tokens_per_s"] / t8["tokens_per_s"], 3),
    }
    print()
    print(f"{'model':12s} {'T':>6s} {'params':>11s} {'s/step':>8s} {'tok/s':>9s} {'MFU':>7s}")
    for r in runs:
        print(
            f"{r['model']:12s} {r['seq_len']:6d} {r['params']:11,d} {r['step_s']:8.2f} "
            f"{r['tokens_per_s']:9,.0f} {r['mfu']:7.1%}"
        )
    print(f"\nfp32 matmul rate (all {n} devices): {peak / 1e9:.1f} GFLOP/s")
    print(f"GLA over transformer at T=2048: {g2['tokens_per_s'] / t2['tokens_per_s']:.2f}x, "
          f"at T=8192: {headline['gla_over_transformer_speedup_T8192']:.2f}x")  # fmt: skip
    path = write_result(
        "train",
        headline,
        matmul_flops_per_s=peak,
        matmul_flops_per_s_before_after=[peak_before, peak],
        runs=runs,
        gla_over_transformer_speedup_T2048=g2["tokens_per_s"] / t2["tokens_per_s"],
        notes=(
            "small preset (d_model 384, 4 layers, vocab 8192), fp32, one jitted training step "
            "with Muon+AdamW; the transformer has the same widths and parameter count; "
            "steps of the four models interleaved in rounds after a compiling step; step_s is "
            "the best round, step_s_median the median"
        ),
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
