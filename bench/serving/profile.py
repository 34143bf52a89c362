"""`python -m bench.serve --profile`: where a decode step's time goes (the write-up's profile).

Decode step time is fitted against the layer count, t(L) = intercept + slope L, for Laplace and
the same-size Llama, eager and in vLLM's compile mode: the intercept is the engine's fixed cost
per step (scheduler, input preparation, embedding, final norm, LM head, sampler), the slope one
layer's. Inside a layer, torch's profiler splits the slope into the weight GEMMs (vLLM's CPU
linear kernels: oneDNN's `onednn_mm`, the sgl `weight_packed_linear`, aten's `mm`/`addmm`) and
everything else, by fitting each one's profiled time per step against L the same way.

Models: the `small` width (d_model, heads, FFN width, vocabulary) at `--profile-layers` depths
(2, 4, 8), random weights. All engines of one (model, mode) are alive together and timed in
alternating rounds (as the side-by-side run); each round times a window of pure decode steps of
`--profile-seqs` sequences (1 and 8) after a 16-token prompt. Step times are medians of rounds.
The profiled windows are separate from the timed ones (the profiler's own cost per op would
otherwise enter the fit).
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from pathlib import Path

import numpy as np

from bench.serving.measure import decode_window, rotated

GEMM = re.compile(r"onednn_mm|weight_packed_linear|^aten::(mm|addmm)$")
PROMPT, WINDOW = 16, 96  # prompt tokens; decode steps per timed window
PROFILE_BUDGET = 2**26  # bytes of state pages / KV cache per engine (64 MiB: short sequences)


def _window(llm, vocab: int, seqs: int, seed: int, steps: int = WINDOW) -> float:
    """Seconds per engine step over `steps` pure decode steps of `seqs` sequences after a
    `PROMPT`-token prompt each (`decode_window`: seconds per output token, one token per
    sequence and step)."""
    return decode_window(llm, vocab, PROMPT, seqs, steps, seed)[0] * seqs


def _profiled_gemm_seconds(llm, vocab: int, seqs: int) -> tuple[float, float]:
    """(weight-GEMM seconds, all op seconds) per step, from torch's profiler over one window:
    the self CPU time of the GEMM kernels, and of every op."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _window(llm, vocab, seqs, seed=7)
    gemm = total = 0.0
    for e in prof.key_averages():
        total += e.self_cpu_time_total
        if GEMM.search(e.key):
            gemm += e.self_cpu_time_total
    return gemm * 1e-6 / WINDOW, total * 1e-6 / WINDOW


def _fit(layers: list[int], seconds: list[float]) -> dict:
    slope, intercept = np.polyfit(layers, seconds, 1)
    return {"intercept_s": float(intercept), "per_layer_s": float(slope)}


def profile_engines(model_dirs: dict[int, Path], compile_mode: bool, sz) -> dict:
    """One (model, mode): an engine per depth, alive together; the fit for each concurrency."""
    from bench.serving.models import make_budget_llm

    engines = {
        n: make_budget_llm(d, 512, max(sz.profile_seqs), PROFILE_BUDGET, compile=compile_mode)
        for n, d in model_dirs.items()
    }
    vocab = engines[next(iter(engines))].llm_engine.model_config.get_vocab_size()
    layers = list(engines)
    out = {}
    for seqs in sz.profile_seqs:
        for n in layers:  # warm-up
            _window(engines[n], vocab, seqs, seed=0, steps=4)
        samples: dict[int, list[float]] = {n: [] for n in layers}
        for r in range(sz.profile_rounds):
            for n in rotated(layers, r):
                samples[n].append(_window(engines[n], vocab, seqs, seed=r + 1))
        step = [statistics.median(samples[n]) for n in layers]
        prof = [_profiled_gemm_seconds(engines[n], vocab, seqs) for n in layers]
        fit = _fit(layers, step)
        gemm_fit = _fit(layers, [g for g, _ in prof])
        mid = layers[len(layers) // 2]
        out[f"s{seqs}"] = {
            **fit,
            "step_s": dict(zip(map(str, layers), step, strict=True)),
            "samples_step_s": {str(n): samples[n] for n in layers},
            "gemm_per_layer_s": gemm_fit["per_layer_s"],
            "gemm_share_of_layer": gemm_fit["per_layer_s"] / fit["per_layer_s"],
            f"layers_share_of_step_at_{mid}": fit["per_layer_s"] * mid / step[layers.index(mid)],
            "profiled_gemm_s": dict(zip(map(str, layers), (g for g, _ in prof), strict=True)),
            "profiled_ops_s": dict(zip(map(str, layers), (t for _, t in prof), strict=True)),
        }
        share = out[f"s{seqs}"]["gemm_share_of_layer"]
        print(
            f"  {seqs} seqs: intercept {1e3 * fit['intercept_s']:.3f} ms, per layer "
            f"{1e3 * fit['per_layer_s']:.3f} ms (GEMMs {share:.0%})",
            flush=True,
        )
    del engines
    return out


def run_profile(cfg, sz, tmp: Path) -> dict:
    """The fit for Laplace and Llama, eager and compiled, at `sz.profile_layers` depths."""
    import gc

    from bench.serving.models import export_laplace, make_llama

    dirs = {"laplace": {}, "llama": {}}
    for n in sz.profile_layers:
        deep = dataclasses.replace(cfg, n_layers=n)
        dirs["laplace"][n] = export_laplace(deep, tmp / f"laplace_{n}", 512)
        dirs["llama"][n] = make_llama(tmp / f"llama_{n}", deep, 512)
    result = {
        "layers": list(sz.profile_layers),
        "prompt": PROMPT,
        "window_steps": WINDOW,
        "rounds": sz.profile_rounds,
    }
    for who, model_dirs in dirs.items():
        for compile_mode in (False, True):
            name = who + ("_compiled" if compile_mode else "_eager")
            print(f"profile: {name} at {list(model_dirs)} layers", flush=True)
            result[name] = profile_engines(model_dirs, compile_mode, sz)
            gc.collect()
    return result
