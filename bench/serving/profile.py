"""`python -m bench.serve --profile`: where a decode step's time goes (the write-up's profile).

Decode step time is fitted against the layer count, t(L) = intercept + slope L, for Laplace and
the same-size Llama, eager and in vLLM's compile mode: the intercept is the engine's fixed cost
per step (scheduler, input preparation, embedding, final norm, LM head, sampler), the slope one
layer's. Beside it, each round times one layer's weight GEMMs alone: inside the engine's own
worker (its threads, its packed weights), every linear layer of its first decoder layer is
called on its own at the step's rows, and the medians of those calls are summed.

Models: the `small` width (d_model, heads, FFN width, vocabulary) at `--profile-layers` depths
(2, 4, 8), random weights. For one mode, the engines of both models at every depth are alive
together and timed in alternating rounds (the order rotated each round, as the side-by-side
run); each round times one window of pure decode steps of `--profile-seqs` sequences (1 and 8)
after a 16-token prompt per engine (prefill and drain outside the window: `decode_window`),
then the two models' GEMMs. Each round gives each model a fit, so every ratio is paired within
a round and headlined as the median over rounds with its spread.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import numpy as np

from bench.serving.headlines import paired
from bench.serving.measure import decode_window, rotated

PROMPT, WINDOW = 16, 96  # prompt tokens; decode steps per timed window
GEMM_CALLS = 50  # calls per linear layer per round, for its median
PROFILE_BUDGET = 2**26  # bytes of state pages / KV cache per engine (64 MiB: short sequences)
MODELS = ("laplace", "llama")


def _window(llm, vocab: int, seqs: int, seed: int, steps: int = WINDOW) -> float:
    """Seconds per engine step over `steps` pure decode steps of `seqs` sequences after a
    `PROMPT`-token prompt each (`decode_window`: seconds per output token, one token per
    sequence and step)."""
    return decode_window(llm, vocab, PROMPT, seqs, steps, seed)[0] * seqs


def layer_gemm_seconds(worker, rows: int, calls: int = GEMM_CALLS) -> float:
    """Run inside an engine's worker (`collective_rpc`): one decoder layer's weight GEMMs at
    `rows` rows, in seconds. Each linear layer of the first decoder layer (vLLM's own modules,
    their weights as the loader packed them) is called alone `calls` times on random inputs;
    the result is the sum over the layer's linear layers of each one's median call."""
    import torch
    from vllm.model_executor.layers.linear import LinearBase

    layer = worker.model_runner.model.model.layers[0]
    total = 0.0
    with torch.inference_mode():
        for m in layer.modules():
            if not isinstance(m, LinearBase):
                continue
            x = torch.randn(rows, m.input_size, dtype=m.params_dtype)
            m(x)  # warm-up
            calls_s = []
            for _ in range(calls):
                t0 = time.perf_counter()
                m(x)
                calls_s.append(time.perf_counter() - t0)
            total += statistics.median(calls_s)
    return total


def fit(layers: list[int], seconds: list[float]) -> dict:
    """t(L) = intercept + per_layer L by least squares, with the residual at each depth."""
    slope, intercept = np.polyfit(layers, seconds, 1)
    residual = [s - (intercept + slope * n) for n, s in zip(layers, seconds, strict=True)]
    return {
        "intercept_s": float(intercept),
        "per_layer_s": float(slope),
        "residual_s": dict(zip(map(str, layers), map(float, residual), strict=True)),
    }


def spread(samples: list[float]) -> dict:
    """{median, min, max, samples} of one figure's per-round samples (ratios: `paired`)."""
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "samples": samples,
    }


def profile_mode(dirs: dict[str, dict[int, Path]], compile_mode: bool, sz) -> dict:
    """One mode: an engine per model and depth, all alive together; per concurrency, the
    alternating rounds, each model's fit (of the median step times, and round by round) and
    the paired ratios."""
    from bench.serving.models import make_budget_llm

    engines = {
        (who, n): make_budget_llm(d, 512, max(sz.profile_seqs), PROFILE_BUDGET, compile_mode)
        for who, by_depth in dirs.items()
        for n, d in by_depth.items()
    }
    layers = sorted({n for _, n in engines})
    mid = layers[len(layers) // 2]
    vocab = next(iter(engines.values())).llm_engine.model_config.get_vocab_size()
    out = {}
    for seqs in sz.profile_seqs:
        for llm in engines.values():  # warm-up
            _window(llm, vocab, seqs, seed=0, steps=4)
        steps = {key: [] for key in engines}
        gemm = {who: [] for who in MODELS}
        for r in range(sz.profile_rounds):
            for key in rotated(list(engines), r):
                steps[key].append(_window(engines[key], vocab, seqs, seed=r + 1))
            for who in rotated(list(MODELS), r):
                rpc = engines[(who, mid)].collective_rpc
                gemm[who].append(rpc(layer_gemm_seconds, args=(seqs,))[0])
        row = {}
        for who in MODELS:
            by_depth = [steps[(who, n)] for n in layers]  # [depth][round]
            median_steps = [statistics.median(s) for s in by_depth]
            per_round = [fit(layers, list(rs))["per_layer_s"] for rs in zip(*by_depth, strict=True)]
            row[who] = {
                **(median_fit := fit(layers, median_steps)),
                "step_s": dict(zip(map(str, layers), median_steps, strict=True)),
                "samples_step_s": {str(n): steps[(who, n)] for n in layers},
                "per_layer_s_by_round": per_round,
                "gemm_per_layer_s": spread(gemm[who]),
                f"layers_share_of_step_at_{mid}": (
                    median_fit["per_layer_s"] * mid / median_steps[layers.index(mid)]
                ),
            }
            row[f"{who}_layer_over_gemm"] = paired(per_round, gemm[who])
        lap, lla = row["laplace"], row["llama"]
        row["laplace_over_llama_per_layer"] = paired(
            lap["per_layer_s_by_round"], lla["per_layer_s_by_round"]
        )
        out[f"s{seqs}"] = row
        print(
            f"  {seqs} seqs: per layer Laplace {1e3 * lap['per_layer_s']:.3f} ms, Llama "
            f"{1e3 * lla['per_layer_s']:.3f} ms (paired ratio "
            f"{row['laplace_over_llama_per_layer']['median']:.2f}); Laplace's GEMMs "
            f"{1e3 * lap['gemm_per_layer_s']['median']:.3f} ms",
            flush=True,
        )
    del engines
    return out


def run_profile(cfg, sz, tmp: Path) -> dict:
    """The fits for Laplace and Llama, eager and compiled, at `sz.profile_layers` depths."""
    import gc

    from bench.serving.models import export_laplace, make_llama

    dirs: dict[str, dict[int, Path]] = {who: {} for who in MODELS}
    for n in sz.profile_layers:
        deep = dataclasses.replace(cfg, n_layers=n)
        dirs["laplace"][n] = export_laplace(deep, tmp / f"laplace_{n}", 512)
        dirs["llama"][n] = make_llama(tmp / f"llama_{n}", deep, 512)
    result = {
        "layers": list(sz.profile_layers),
        "prompt": PROMPT,
        "window_steps": WINDOW,
        "gemm_calls": GEMM_CALLS,
        "rounds": sz.profile_rounds,
    }
    for mode, compile_mode in (("eager", False), ("compiled", True)):
        print(f"profile: {mode}, Laplace and Llama at {list(sz.profile_layers)} layers", flush=True)
        result[mode] = profile_mode(dirs, compile_mode, sz)
        gc.collect()
    return result
