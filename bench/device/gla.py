"""The GLA kernel part: our `gla_chunked` (jitted XLA) beside fla's Triton `chunk_simple_gla`.

Forward + backward (o, then dq, dk, dv for the cotangent w: loss = sum(o * w)) on the same bf16
inputs, fp32 state inside both kernels, each at its own chunk size (ours: the config's, 128 for
3B; fla's default, 64), fla on the fixed per-head decay path (`g_gamma` = the config's log-decays,
[H] fp32), the scale d_k ** -0.5 in both. Every length keeps the tokens per call fixed
(batch = TOKENS / T), so the per-token work of the two kernels is compared at equal work.

Parity: outputs and gradients of ours against fla Triton's, ||a - b|| / ||b|| per tensor (L2,
float64) within `TOLERANCE`; at the first length also both against an fp32 reference on the same
bf16-rounded inputs: flash-linear-attention's naive chunked PyTorch form
(`bench.fla_reference`), or `laplace_jax.gla.gla_recurrent` without fla. In the dry run (CPU, no
Triton) the reference comparison is the parity check, at every length.

Timing: after a warm-up call (compiles / autotunes), rounds of `reps` calls of each kernel,
interleaved (`bench.gla.interleaved_times`), the order alternating round by round; the time ratio
of a round is ours / fla's, and the headline `gla_over_fla_triton_T8192` is its median over rounds
(> 1: ours is slower), with min and max beside it.
"""

from __future__ import annotations

import math
import time

import numpy as np

from bench.device.part import Part, rel_error, spread

TOLERANCE = 2e-2  # max over o, dq, dk, dv of ||a - b|| / ||b||, bf16 against bf16 or fp32
SIZES = {
    # preset (head shapes, chunk, decays), lengths, tokens per call, rounds, seconds per round
    "real": {
        "preset": "laplace-3b",
        "lengths": (2048, 8192, 32768),
        "tokens": 32768,
        "max_rounds": 15,
        "min_rounds": 3,
        "round_s": 0.05,
    },
    "dry": {
        "preset": "small",
        "lengths": (128, 256),
        "tokens": 256,
        "max_rounds": 3,
        "min_rounds": 2,
        "round_s": 0.0,
    },
}
HEADLINE_T = 8192


def inputs(B, T, H, K, V, seed=0):
    """q, k, v, w in bf16 (JAX) and their exact fp32 values (numpy)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    shapes = {"q": (B, T, H, K), "k": (B, T, H, K), "v": (B, T, H, V), "w": (B, T, H, V)}
    bf16 = {
        n: jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16) for n, s in shapes.items()
    }
    exact = {n: np.asarray(x.astype(jnp.float32)) for n, x in bf16.items()}
    return bf16, exact


def ours(log_decay, chunk):
    """jit(q, k, v, w) -> (o, dq, dk, dv): gla_chunked's forward and its VJP of w."""
    import jax

    from laplace_jax.gla import gla_chunked

    @jax.jit
    def fwd_bwd(q, k, v, w):
        o, vjp = jax.vjp(
            lambda q, k, v: gla_chunked(q, k, v, log_decay, chunk_size=chunk)[0], q, k, v
        )
        return (o, *vjp(w))

    return fwd_bwd


def torch_fwd_bwd(kernel, exact, dtype, device):
    """(run() -> (o, dq, dk, dv), sync) of a PyTorch kernel(q, k, v) -> o on `exact`'s values."""
    import torch

    t = {n: torch.from_numpy(x.copy()).to(device=device, dtype=dtype) for n, x in exact.items()}
    q, k, v = (t[n].requires_grad_(True) for n in "qkv")

    def run():
        o = kernel(q, k, v)
        return (o, *torch.autograd.grad(o, (q, k, v), t["w"]))

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return run, sync


def fla_triton(log_decay, exact, scale):
    import torch
    from fla.ops.simple_gla import chunk_simple_gla

    g_gamma = torch.tensor(log_decay, dtype=torch.float32, device="cuda")
    return torch_fwd_bwd(
        lambda q, k, v: chunk_simple_gla(q, k, v, g_gamma=g_gamma, scale=scale)[0],
        exact,
        torch.bfloat16,
        "cuda",
    )


def reference(log_decay, exact, scale, chunk):
    """(name, [o, dq, dk, dv] fp32 numpy) of the first sequence of `exact`: the fp32 reference on
    the bf16-rounded inputs (sequences are independent, so one is enough and stays small)."""
    exact = {n: x[:1] for n, x in exact.items()}
    try:
        import torch

        from bench.fla_reference import load_fla_naive

        naive = load_fla_naive()
    except ImportError:
        naive = None
    if naive is not None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        _, T, H = exact["q"].shape[:3]
        g = torch.tensor(log_decay, dtype=torch.float32, device=device).expand(1, T, H)
        run, _ = torch_fwd_bwd(
            lambda q, k, v: naive.naive_chunk_simple_gla(q, k, v, g, chunk_size=chunk, scale=scale)[
                0
            ],
            exact,
            torch.float32,
            device,
        )
        return "fla_naive_chunk_simple_gla_fp32", to_numpy(run())
    import jax
    import jax.numpy as jnp

    from laplace_jax.gla import gla_recurrent

    f32 = {n: jnp.asarray(x) for n, x in exact.items()}
    o, vjp = jax.vjp(
        lambda q, k, v: gla_recurrent(q, k, v, jnp.asarray(log_decay))[0],
        f32["q"],
        f32["k"],
        f32["v"],
    )
    return "laplace_jax_gla_recurrent_fp32", to_numpy((o, *vjp(f32["w"])))


def compare(got, want) -> dict:
    """Per tensor (o, dq, dk, dv) errors of `got` against `want`, and the verdict."""
    out = {n: rel_error(g, w) for n, g, w in zip(("o", "dq", "dk", "dv"), got, want, strict=True)}
    worst = max(e["rel_l2"] for e in out.values())
    finite = all(e["finite"] for e in out.values())
    return {**out, "worst_rel_l2": worst, "passed": bool(finite and worst <= TOLERANCE)}


def to_numpy(xs):
    """JAX arrays or torch tensors -> fp32 numpy."""
    return [
        x.detach().float().cpu().numpy()
        if hasattr(x, "detach")
        else np.asarray(x.astype("float32"))
        for x in xs
    ]


def measure_length(part, size, cfg, T, with_triton, with_reference, share_end) -> dict:
    import jax
    import jax.numpy as jnp

    from bench.gla import interleaved_times

    H, K, V, C = cfg.n_heads, cfg.d_k, cfg.d_v, cfg.chunk_size
    B = max(1, size["tokens"] // T)
    log_decay = np.asarray(cfg.log_decay(), np.float32)
    bf16, exact = inputs(B, T, H, K, V)
    row = {"T": T, "batch": B, "heads": H, "d_k": K, "d_v": V, "chunk_ours": C}
    fwd_bwd = ours(jnp.asarray(log_decay), C)
    args = (bf16["q"], bf16["k"], bf16["v"], bf16["w"])
    t0 = time.perf_counter()
    ours_out = jax.block_until_ready(fwd_bwd(*args))
    row["ours_first_call_s"] = time.perf_counter() - t0  # compile included

    def run_ours(reps):
        for _ in range(reps):
            out = fwd_bwd(*args)
        jax.block_until_ready(out)

    runners = {"ours": run_ours}
    parity = {}
    if with_triton:
        fla_run, fla_sync = fla_triton(log_decay, exact, K**-0.5)
        t0 = time.perf_counter()
        fla_out = fla_run()
        fla_sync()
        row["fla_triton_first_call_s"] = time.perf_counter() - t0  # autotuning included
        parity["ours_vs_fla_triton"] = compare(to_numpy(ours_out), to_numpy(fla_out))

        def run_fla(reps):
            for _ in range(reps):
                fla_run()
            fla_sync()

        runners["fla_triton"] = run_fla
    if with_reference:
        try:
            name, want = reference(log_decay, exact, K**-0.5, C)
            row["reference"] = name
            parity["ours_vs_reference"] = compare(to_numpy(x[:1] for x in ours_out), want)
            if with_triton:
                parity["fla_triton_vs_reference"] = compare(to_numpy(x[:1] for x in fla_out), want)
        except Exception as e:  # noqa: BLE001 - the reference is a diagnosis, not the check
            part.error(f"T={T} reference", e)
    row["parity"] = parity
    part.say(
        f"T={T} B={B}: parity "
        + ", ".join(
            f"{k} worst {v['worst_rel_l2']:.2e} ({'ok' if v['passed'] else 'FAIL'})"
            for k, v in parity.items()
        )
    )

    # reps per round: enough calls that a round of the slower kernel takes `round_s`
    one = {}
    for name, run in runners.items():
        t0 = time.perf_counter()
        run(1)
        one[name] = time.perf_counter() - t0
    reps = max(1, min(200, math.ceil(size["round_s"] / max(max(one.values()), 1e-6))))
    row["reps_per_round"] = reps
    names = list(runners)
    times = {n: [] for n in names}
    while len(times["ours"]) < size["max_rounds"]:
        r = len(times["ours"])
        if r >= size["min_rounds"] and time.time() > share_end:
            break
        if r >= 1 and part.remaining() < 3 * sum(t[-1] for t in times.values()) + 5:
            break
        order = names if r % 2 == 0 else names[::-1]
        got = interleaved_times({n: (lambda run=runners[n]: run(reps)) for n in order}, 1)
        for n in names:
            times[n].append(got[n][0] / reps)
    row["rounds"] = len(times["ours"])
    row["seconds_per_call"] = {n: spread(ts) for n, ts in times.items()}
    row["seconds_per_call_rounds"] = times
    if with_triton:
        row["ours_over_fla_triton"] = spread(
            [a / b for a, b in zip(times["ours"], times["fla_triton"], strict=True)]
        )
    return row


def run(part: Part) -> None:
    from laplace_spec.config import PRESETS

    size = SIZES["dry" if part.dry_run else "real"]
    cfg = PRESETS[size["preset"]]
    part.result["config"] = {
        **size,
        "lengths": list(size["lengths"]),
        "tolerance_rel_l2": TOLERANCE,
    }
    with_triton = fla_triton_available(part)
    rows = part.result.setdefault("rows", [])
    lengths = size["lengths"]
    complete = True
    for i, T in enumerate(lengths):
        left = part.remaining()
        if left < (5 if part.dry_run else 15):
            part.skip(f"T={T}", f"budget: {left:.0f} s left of the part's budget")
            complete = False
            continue
        share_end = time.time() + left / (len(lengths) - i)
        try:
            rows.append(
                measure_length(part, size, cfg, T, with_triton, i == 0 or part.dry_run, share_end)
            )
        except Exception as e:  # noqa: BLE001 - e.g. out of memory at one length: go on
            part.error(f"T={T}", e)
            complete = False
        summarise(part, rows)  # after every length: a kill later keeps the headline
        part.save()
        if with_triton:
            import torch

            torch.cuda.empty_cache()
    part.finish("ok" if complete and not part.result["errors"] else "partial")


def summarise(part: Part, rows: list) -> None:
    checks = [c for r in rows for c in r["parity"].values()]
    part.result["parity_passed"] = bool(checks) and all(c["passed"] for c in checks)
    at = next((r for r in rows if r["T"] == HEADLINE_T and "ours_over_fla_triton" in r), None)
    part.result["headline"] = {
        "gla_over_fla_triton_T8192": None if at is None else at["ours_over_fla_triton"]["median"]
    }


def fla_triton_available(part: Part) -> bool:
    """fla's Triton kernel needs CUDA, triton and fla-core; a missing one is a recorded skip."""
    import importlib.util

    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        part.skip(
            "fla_triton",
            "no CUDA device for PyTorch: fla's Triton kernels need a GPU; "
            "ours is checked against the fp32 reference instead",
        )
        return False
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("fla") is None:
        part.skip("fla_triton", "triton or fla-core is not installed (bring the fla-core wheel)")
        return False
    try:
        from fla.ops.simple_gla import chunk_simple_gla  # noqa: F401
    except Exception as e:  # noqa: BLE001
        part.skip("fla_triton", f"import fla.ops.simple_gla failed: {type(e).__name__}: {e}")
        return False
    return True
