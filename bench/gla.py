"""`python -m bench.gla`: forward+backward time of the GLA forms and softmax attention vs T.

Side by side in one run, 3B head shapes (H=16, d_k=96, d_v=192, batch 1), fp32 on this machine:
- `chunked`: `gla_chunked` (lax.scan over chunks of 128), jitted value-and-grad;
- `recurrent`: `gla_recurrent` (the token-by-token definition), jitted value-and-grad;
- `softmax`: `jax.nn.dot_product_attention` (causal), 16 heads of width 192 (a transformer of
  the same width), jitted value-and-grad;
- `fla_chunk`: flash-linear-attention's PyTorch chunk reference `naive_chunk_simple_gla`
  (torch CPU, autograd), chunk 128.
Writes bench/results/gla.json and gla.png (time per token vs T).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import RESULTS, write_result
from laplace_jax.gla import gla_chunked, gla_recurrent
from laplace_spec.config import PRESETS

H, K, V, C = 16, 96, 192, 128
LOG_DECAY = jnp.asarray(PRESETS["laplace-3b"].log_decay(), jnp.float32)


def inputs(T, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (1, T, H, K))
    k = jax.random.normal(keys[1], (1, T, H, K))
    v = jax.random.normal(keys[2], (1, T, H, V))
    w = jax.random.normal(keys[3], (1, T, H, V))  # cotangent: loss = sum(o * w)
    return q, k, v, w


def jax_fwd_bwd(attn):
    @jax.jit
    def step(q, k, v, w):
        return jax.value_and_grad(lambda q, k, v: jnp.sum(attn(q, k, v) * w), (0, 1, 2))(q, k, v)

    return step


KERNELS = {
    "chunked": jax_fwd_bwd(lambda q, k, v: gla_chunked(q, k, v, LOG_DECAY, chunk_size=C)[0]),
    "recurrent": jax_fwd_bwd(lambda q, k, v: gla_recurrent(q, k, v, LOG_DECAY)[0]),
    # A comparable transformer (D = 3,072, 16 heads) has head width 192 for q, k and v alike,
    # and XLA's attention needs equal widths: q and k are zero-padded from 96 to 192.
    "softmax": jax_fwd_bwd(
        lambda q, k, v: jax.nn.dot_product_attention(
            jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, V - K))),
            jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, V - K))),
            v,
            is_causal=True,
        )
    ),
}


def jax_runner(name, T):
    """A zero-argument call of one kernel's forward+backward at length T, compiled and warm."""
    q, k, v, w = inputs(T)
    step = KERNELS[name]

    def run():
        jax.block_until_ready(step(q, k, v, w))

    run()
    return run


def fla_runner(T):
    import torch

    from bench.fla_reference import load_fla_naive

    naive = load_fla_naive()
    q, k, v, w = (torch.from_numpy(np.asarray(x).copy()) for x in inputs(T))
    g = torch.from_numpy(np.broadcast_to(np.asarray(LOG_DECAY), (1, T, H)).copy())
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def run():
        o, _ = naive.naive_chunk_simple_gla(q, k, v, g, chunk_size=C)
        (o * w).sum().backward()
        q.grad = k.grad = v.grad = None

    run()
    return run


def interleaved_times(runners: dict, repeats: int) -> dict:
    """Each runner once per round, rounds repeated: {name: [seconds, ...]}.

    The machine is shared: interleaving spreads other load over all kernels alike, so the ratio
    of two kernels within one round is the fair comparison; figures are medians over rounds."""
    times = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rows in results.items():
        Ts = [r["T"] for r in rows]
        ax.plot(Ts, [r["seconds"] / r["T"] * 1e6 for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("forward+backward time per token (us)")
    ax.set_title("GLA forms vs softmax attention, H=16, d_k=96, d_v=192, batch 1")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--repeats", type=int, default=5)
    # the recurrent reference's backward keeps every token's state (T x 1.2 MB here: 19 GB at
    # 16k) and softmax keeps T^2 scores per head (4.3 GB at 8k, several copies in the backward)
    ap.add_argument("--max-recurrent", type=int, default=4096)
    ap.add_argument("--max-softmax", type=int, default=4096)
    ap.add_argument("--max-fla", type=int, default=16384)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    limits = {
        "chunked": max(lengths),
        "recurrent": args.max_recurrent,
        "softmax": args.max_softmax,
        "fla_chunk": args.max_fla,
    }

    results = {name: [] for name in limits}
    print(f"{'T':>7} " + " ".join(f"{n:>14}" for n in limits) + "   (ms, fwd+bwd, median)")
    for T in lengths:
        names = [n for n in limits if T <= limits[n]]
        runners = {n: fla_runner(T) if n == "fla_chunk" else jax_runner(n, T) for n in names}
        times = interleaved_times(runners, args.repeats if T <= 4096 else max(2, args.repeats // 2))
        for name, ts in times.items():
            results[name].append(
                {
                    "T": T,
                    "seconds": statistics.median(ts),
                    "min_seconds": min(ts),
                    "max_seconds": max(ts),
                    "all": ts,
                }
            )
        print(
            f"{T:>7} "
            + " ".join(
                f"{statistics.median(times[n]) * 1e3:>14.1f}" if n in times else f"{'-':>14}"
                for n in limits
            )
        )
        del runners

    def row(name, T):
        return next(r for r in results[name] if r["T"] == T)

    def speedup(slow, T):
        """slow over chunked at T: the ratio within each round, its median, min and max."""
        pairs = zip(row(slow, T)["all"], row("chunked", T)["all"], strict=True)
        ratios = [a / b for a, b in pairs]
        return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}

    headline, speedups = {}, {}
    if 2048 in lengths:
        speedups["chunked_over_fla_T2048"] = speedup("fla_chunk", 2048)
        speedups["chunked_over_recurrent_T2048"] = speedup("recurrent", 2048)
        headline["chunked_over_fla_speedup_T2048"] = speedups["chunked_over_fla_T2048"]["median"]
        headline["chunked_over_recurrent_speedup_T2048"] = speedups["chunked_over_recurrent_T2048"][
            "median"
        ]
    if 2048 in lengths and 16384 in lengths:  # measured in different rounds: medians' ratio
        headline["per_token_time_16k_over_2k"] = (row("chunked", 16384)["seconds"] / 16384) / (
            row("chunked", 2048)["seconds"] / 2048
        )
    path = write_result(
        "gla",
        headline,
        shapes={"H": H, "d_k": K, "d_v": V, "chunk": C},
        speedups=speedups,
        results=results,
        notes=(
            "seconds: the median over interleaved rounds (min_seconds, max_seconds beside it); "
            "a speedup is the ratio of two kernels within each round, its median, min and max"
        ),
    )
    plot(results, RESULTS / "gla.png")
    print({k: round(v, 3) for k, v in headline.items()})
    print(f"wrote {path} and {RESULTS / 'gla.png'}")


if __name__ == "__main__":
    main()
