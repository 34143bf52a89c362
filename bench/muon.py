"""`python -m bench.muon`: Muon's collective traffic (gather vs a2a) and step time, side by side.

1. `laplace-3b` on a 64-device mesh (simulated CPU devices, abstract arrays: nothing of 3B size
   is allocated): the whole optimizer update (Muon + AdamW) is lowered with explicit shardings
   and compiled in both modes; the bytes each device sends and receives are read off the
   compiled HLO's collectives and checked against the analytic count of `laplace_jax.muon`.
   XLA's CPU backend widens bf16 collectives to f32 when it compiles them, so the HLO's element
   counts are converted at the program's own dtype (bf16, what a Trainium or GPU run sends); the
   f32 bytes of the CPU program are kept in the raw data.
2. Newton-Schulz FLOPs as a share of a training step's (6 x parameters x 524,288 tokens, the
   write-up's count), and what one device executes in each mode.
3. `small` on 8 devices: optimizer-step time of `gather` and `a2a`, alternated in one run.
4. One arithmetic for every layout: 20 training steps of `small` on fsdp=8 in each mode
   (`single`, `gather`, `a2a`) from one initialisation on one stream of random token batches;
   every logged loss and every final parameter compared bit for bit. And what the fixed order
   costs: one device's Newton-Schulz over `small`'s matrices in the tiled arithmetic every mode
   runs against the whole-matrix definition, alternated.

Writes bench/results/muon.json.
"""

from __future__ import annotations

import os
import re

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64"
    ).strip()

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import write_result  # noqa: E402
from laplace_jax import hlo, muon_accounting  # noqa: E402
from laplace_jax.accounting import parameter_counts, training_flops_per_token  # noqa: E402
from laplace_jax.model import LaplaceLM, abstract_params, init_params  # noqa: E402
from laplace_jax.muon_tiles import ns_grouped  # noqa: E402
from laplace_jax.newton_schulz import newton_schulz  # noqa: E402
from laplace_jax.optim import (  # noqa: E402
    OPTIMIZER_PRESETS,
    make_optimizer,
    muon_plan,
    opt_state_shardings,
)
from laplace_jax.sharding import abstract_with_shardings, make_mesh, param_shardings  # noqa: E402
from laplace_spec.config import PRESETS  # noqa: E402
from train.config import build_optimizer, optimizer_config  # noqa: E402
from train.step import make_train_step  # noqa: E402

TOKENS_PER_STEP = 524_288  # 256 x 2,048 (docs/design.md s4)


def traffic_3b(n: int) -> dict:
    cfg = PRESETS["laplace-3b"]
    mesh = make_mesh(n)
    shard = param_shardings(cfg, mesh)
    abstract = abstract_with_shardings(abstract_params(cfg), shard)
    out = {}
    for mode in ("gather", "a2a"):
        opt = OPTIMIZER_PRESETS["laplace-3b"].replace(muon_mode=mode)
        tx = make_optimizer(opt, abstract, mesh)
        ss = opt_state_shardings(tx, abstract, shard)
        state = abstract_with_shardings(jax.eval_shape(tx.init, abstract), ss)
        step = jax.jit(tx.update, in_shardings=(shard, ss, shard), out_shardings=(shard, ss))
        t0 = time.perf_counter()
        lowered = step.lower(abstract, state, abstract)
        program_dtypes = sorted(
            set(
                re.findall(
                    r"stablehlo\.all_(?:to_all|gather).*-> tensor<[\dx]+x(\w+)>", lowered.as_text()
                )
            )
        )
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t0
        # bytes one device receives (laplace_jax.hlo); it sends as many: traffic = 2 x received
        colls = hlo.collectives(compiled.as_text(), n)
        plan = muon_plan(opt, abstract, mesh)
        item = jnp.dtype(plan.dtype).itemsize
        moved = sum(2 * c["received"] // hlo.ITEMSIZE[c["dtype"]] for c in colls)  # elements
        compiled_bytes = sum(2 * c["received"] * (1 + c["widened_here"]) for c in colls)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        out[mode] = {
            "collectives": {k: sum(c["kind"] == k for c in colls) for k in hlo.COLLECTIVE_KINDS},
            "collective_dtypes_in_program": program_dtypes,
            "collective_dtypes_in_cpu_hlo": sorted(
                {"f32" if c["widened_here"] else c["dtype"] for c in colls}
            ),
            "hlo_bytes_per_device": moved * item,
            "hlo_bytes_per_device_as_compiled_on_cpu": compiled_bytes,
            "analytic_bytes_per_device": muon_accounting.bytes_per_device(plan),
            "ns_flops_per_device_analytic": muon_accounting.ns_flops_per_device(plan),
            "compiled_flops_per_device": float(cost.get("flops", float("nan"))),
            "compile_seconds": compile_s,
            "raw": colls,
        }
        if mode == "a2a":
            pools, rest = plan.pools()
            out["a2a_layout"] = [
                {
                    "s": p.short_side,
                    "w": p.tile_width,
                    "T": p.tile_slots,
                    "M": p.matrix_slots,
                    "min_load_tiles": min(p.loads()),
                    "max_load_tiles": max(p.loads()),
                    "matrices": len(p.matrices),
                }
                for p in pools
            ] + [{"gather_fallback": rest}]
        print(
            f"  {mode:>6}: {out[mode]['collectives']}  bytes/device HLO "
            f"{out[mode]['hlo_bytes_per_device']:,} analytic "
            f"{out[mode]['analytic_bytes_per_device']:,}  (compiled in {compile_s:.0f} s)"
        )
    return out


def ns_share(n: int) -> dict:
    cfg = PRESETS["laplace-3b"]
    plan = muon_plan(OPTIMIZER_PRESETS["laplace-3b"], abstract_params(cfg))
    ns_total = sum(muon_accounting.ns_flops(s, plan.ns_steps) for s in plan.shapes.values())
    step_6nt = 6 * parameter_counts(cfg)["total_params"] * TOKENS_PER_STEP
    step_full = training_flops_per_token(cfg) * TOKENS_PER_STEP
    return {
        "ns_flops_total": ns_total,
        "step_flops_6NT": step_6nt,
        "step_flops_with_gla": step_full,
        "ns_flop_share": ns_total / step_6nt,
        "ns_flop_share_with_gla": ns_total / step_full,
        "ideal_ns_flops_per_device": ns_total / n,
    }


def time_small(repeats: int) -> dict:
    cfg = PRESETS["small"]
    mesh = make_mesh(8)
    shard = param_shardings(cfg, mesh)
    params = jax.device_put(init_params(cfg, jax.random.key(0)), shard)
    rng = np.random.default_rng(0)
    grads = jax.device_put(
        jax.tree.map(lambda p: rng.standard_normal(p.shape, np.float32) * 1e-2, params), shard
    )
    steps = {}
    for mode in ("gather", "a2a"):
        opt = OPTIMIZER_PRESETS["small"].replace(muon_mode=mode)
        tx = make_optimizer(opt, params, mesh)
        ss = opt_state_shardings(tx, params, shard)
        state = jax.jit(tx.init, out_shardings=ss)(params)
        fn = jax.jit(tx.update, in_shardings=(shard, ss, shard), out_shardings=(shard, ss))
        jax.block_until_ready(fn(grads, state, params))  # compile + warm up
        steps[mode] = (fn, state)
    times = {mode: [] for mode in steps}
    for _ in range(repeats):  # alternate, so drifts in machine load hit both alike
        for mode, (fn, state) in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(grads, state, params))
            times[mode].append(time.perf_counter() - t0)
    med = {mode: statistics.median(t) for mode, t in times.items()}
    for mode, t in med.items():
        print(f"  small, 8 devices, {mode:>6}: {t * 1e3:8.1f} ms per optimizer step")
    ratios = [g / a for g, a in zip(times["gather"], times["a2a"], strict=True)]
    return {
        "median_seconds": med,
        "gather_over_a2a": {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        },
        "all_seconds": times,
        "ns_dtype": OPTIMIZER_PRESETS["small"].ns_dtype,
    }


def train_small_in_each_mode(steps: int) -> dict:
    """`steps` training steps of `small` on fsdp=8 in every mode: losses and bitwise equality
    of every loss and every final parameter with `single`'s."""
    cfg = PRESETS["small"]
    mesh = make_mesh(8)
    shard = param_shardings(cfg, mesh)
    host = jax.device_get(init_params(cfg, jax.random.key(0)))
    rng = np.random.default_rng(0)
    batches = [
        rng.integers(0, cfg.vocab_size, (1, 8, cfg.seq_len + 1)).astype(np.int32)
        for _ in range(steps)
    ]
    runs = {}
    for mode in ("single", "gather", "a2a"):
        opt, _ = optimizer_config("small", {}, [f"muon_mode={mode}"], steps)
        abstract = abstract_with_shardings(abstract_params(cfg), shard)
        tx, schedule, opt_shard = build_optimizer(opt, abstract, shard, mesh)
        train_step, _ = make_train_step(LaplaceLM(cfg), tx, mesh, shard, opt_shard, 1.0, schedule)
        params = jax.device_put(host, shard)
        state = {
            "params": params,
            "opt_state": jax.jit(tx.init, out_shardings=opt_shard)(params),
            "bad_streak": jnp.zeros((), jnp.int32),
        }
        losses, t0 = [], time.perf_counter()
        for batch in batches:
            state, metrics = train_step(state, batch)
            losses.append(float(metrics["loss"]))
        runs[mode] = (losses, jax.device_get(state["params"]), time.perf_counter() - t0)
        print(f"  small, fsdp=8, {mode:>6}: losses {losses[0]:.6f} .. {losses[-1]:.6f}")
    ref_losses, ref_params, _ = runs["single"]
    out = {"steps": steps, "losses": {m: r[0] for m, r in runs.items()}}
    for mode in ("gather", "a2a"):
        losses, params, _ = runs[mode]
        same = jax.tree.leaves(jax.tree.map(np.array_equal, params, ref_params))
        out[f"{mode}_losses_equal_single"] = losses == ref_losses
        out[f"{mode}_params_equal_single"] = all(same)
        out[f"{mode}_leaves_differing"] = len(same) - sum(same)
    out["seconds"] = {m: r[2] for m, r in runs.items()}
    return out


def time_fixed_order(repeats: int) -> dict:
    """One device, `small`'s Muon matrices: Newton-Schulz in the tiled arithmetic every mode
    runs against the whole-matrix definition, alternated; the ratio tiled / whole per round."""
    cfg = PRESETS["small"]
    plan = muon_plan(OPTIMIZER_PRESETS["small"], abstract_params(cfg))
    rng = np.random.default_rng(1)
    grads = {p: jnp.asarray(rng.standard_normal(s), jnp.float32) for p, s in plan.shapes.items()}

    def whole(g):  # batched by shape, as the tiled form is
        by_shape: dict[tuple, list[str]] = {}
        for p in sorted(g):
            by_shape.setdefault(g[p].shape, []).append(p)
        out = {}
        for paths in by_shape.values():
            y = newton_schulz(jnp.stack([g[p] for p in paths]), plan.ns_steps, plan.dtype)
            out.update(zip(paths, y, strict=True))
        return out

    def tiled(g):
        return ns_grouped(g, plan.widths, plan.ns_steps, plan.dtype)

    fns = {"tiled": jax.jit(tiled), "whole": jax.jit(whole)}
    for fn in fns.values():
        jax.block_until_ready(fn(grads))
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(grads))
            times[k].append(time.perf_counter() - t0)
    ratios = [t / w for t, w in zip(times["tiled"], times["whole"], strict=True)]
    med = statistics.median(ratios)
    print(f"  small, 1 device: Newton-Schulz tiled / whole-matrix {med:.3f}")
    return {
        "median_seconds": {k: statistics.median(t) for k, t in times.items()},
        "tiled_over_whole": {"median": med, "min": min(ratios), "max": max(ratios)},
        "all_seconds": times,
        "ns_dtype": plan.ns_dtype,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=64, help="mesh size for laplace-3b")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--train-steps", type=int, default=20, help="steps of the bitwise check")
    args = ap.parse_args(argv)
    if jax.device_count() < args.devices:
        raise SystemExit(f"need {args.devices} devices, have {jax.device_count()} (XLA_FLAGS)")
    n = args.devices
    print(f"laplace-3b, {n} devices, abstract arrays:")
    traffic = traffic_3b(n)
    flops = ns_share(n)
    timing = time_small(args.repeats)
    order = time_fixed_order(max(args.repeats, 11))
    bitwise = train_small_in_each_mode(args.train_steps)
    g, a = traffic["gather"], traffic["a2a"]
    headline = {
        "gather_bytes_per_device": g["hlo_bytes_per_device"],
        "a2a_bytes_per_device": a["hlo_bytes_per_device"],
        "traffic_ratio": g["hlo_bytes_per_device"] / a["hlo_bytes_per_device"],
        "ns_flop_share": flops["ns_flop_share"],
        "step_time_gather_over_a2a": timing["gather_over_a2a"]["median"],
        "a2a_bitwise_equal_single": bitwise["a2a_losses_equal_single"]
        and bitwise["a2a_params_equal_single"],
        "gather_bitwise_equal_single": bitwise["gather_losses_equal_single"]
        and bitwise["gather_params_equal_single"],
        "ns_time_tiled_over_whole": order["tiled_over_whole"]["median"],
    }
    muon_elems = parameter_counts(PRESETS["laplace-3b"])["muon_params"]
    bound = 2 * muon_elems / (4 * max(m for m in (3072 * 16384, 3072 * 9216, 8192 * 3072)))
    print()
    print(f"{'':28}{'gather':>16}{'a2a':>16}")
    print(
        f"{'bytes/device (HLO, bf16)':28}{g['hlo_bytes_per_device']:>16,}"
        f"{a['hlo_bytes_per_device']:>16,}"
    )
    print(
        f"{'bytes/device (analytic)':28}{g['analytic_bytes_per_device']:>16,}"
        f"{a['analytic_bytes_per_device']:>16,}"
    )
    print(
        f"{'NS FLOPs/device executed':28}{g['ns_flops_per_device_analytic']:>16.3e}"
        f"{a['ns_flops_per_device_analytic']:>16.3e}"
    )
    print(
        f"{'small step time, 8 dev (ms)':28}"
        f"{timing['median_seconds']['gather'] * 1e3:>16.1f}"
        f"{timing['median_seconds']['a2a'] * 1e3:>16.1f}"
    )
    print(
        f"traffic ratio {headline['traffic_ratio']:.2f}x (whole-matrix bound {bound:.2f}x), "
        f"NS share {headline['ns_flop_share']:.4f}, "
        f"step time gather/a2a {headline['step_time_gather_over_a2a']:.2f}"
    )
    print(
        f"{bitwise['steps']} steps of small: a2a bit-identical to single: "
        f"{headline['a2a_bitwise_equal_single']}, gather: {headline['gather_bitwise_equal_single']}"
    )
    for mode in ("gather", "a2a"):
        assert traffic[mode]["hlo_bytes_per_device"] == traffic[mode]["analytic_bytes_per_device"]
    path = write_result(
        "muon",
        headline,
        mesh_devices_3b=n,
        traffic_3b={k: v for k, v in traffic.items()},
        whole_matrix_traffic_bound=bound,
        flops=flops,
        small_timing=timing,
        fixed_order_timing=order,
        bitwise_small=bitwise,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
