"""The decode part: the PyTorch model of `serve/` decoding 1,280 sequences at once.

Laplace 3B with random weights (the model's own initialisation: decode time does not depend on
the values), cast to bf16; the recurrent state fp32 (`init_state`: per layer GLA [B, 16, 96, 192]
and conv window [B, 4, 3072], 29.5 MB a sequence, 37.7 GB for 1,280). `DecodeRunner` at the
fixed width of 1,280: compiled (`torch.compile`, inductor on the GPU; the dry run's CPU uses the
`eager` backend, graph capture without a C++ toolchain) and eager, the same step function.
`row_exact` is off: with every batch exactly the runner's width nothing is padded, so the
row-exact matrix-vector path (which keeps padded rows from changing real rows on CPU BLAS) has
nothing to protect, and a GPU runs the projections as GEMMs.

From the zero state (decode cost does not depend on the context: the state is fixed-size), each
step feeds every sequence's greedy token (argmax of its logits) back. Eager first (its warm-up
and one round, kept should the compile outlast the budget), then the compiled runner's warm-up
(the compile), then rounds of `steps_per_round` steps of each runner, interleaved, the order
alternating; output tokens/s = sequences x steps / seconds. Headline
`decode_tokens_per_s_3b_1280`: the compiled runner's median. This file must not import JAX (it
would take GPU memory).
"""

from __future__ import annotations

import time

from bench.device.part import Part, is_out_of_memory, spread

SIZES = {
    "real": {
        "preset": "laplace-3b",
        "sequences": 1280,
        "warm_steps": 3,
        "steps_per_round": 8,
        "max_rounds": 8,
        "min_rounds": 3,
        "backend": "inductor",
    },
    "dry": {
        "preset": "tiny",
        "sequences": 2,
        "warm_steps": 1,
        "steps_per_round": 2,
        "max_rounds": 2,
        "min_rounds": 2,
        "backend": "eager",
    },
}


def build(size: dict, device: str):
    import torch

    from laplace_spec.config import PRESETS
    from serve.configuration_laplace import LaplaceHFConfig
    from serve.modeling_laplace import LaplaceForCausalLM

    cfg = PRESETS[size["preset"]]
    torch.manual_seed(0)
    with torch.device(device):
        model = LaplaceForCausalLM(LaplaceHFConfig(**cfg.to_dict()))
    return cfg, model.to(torch.bfloat16).eval()


def summarise(part: Part, times: dict, tokens_per_round: int) -> None:
    part.result["rounds_s"] = times
    part.result["tokens_per_s"] = {
        name: spread([tokens_per_round / t for t in ts]) for name, ts in times.items() if ts
    }
    if times.get("compiled") and times.get("eager"):
        part.result["compiled_over_eager"] = spread(
            [e / c for c, e in zip(times["compiled"], times["eager"], strict=True)]
        )
    compiled = part.result["tokens_per_s"].get("compiled")
    part.result["headline"] = {
        "decode_tokens_per_s_3b_1280": None if compiled is None else compiled["median"]
    }


def run(part: Part) -> None:
    import torch

    from serve.generation import DecodeRunner

    size = SIZES["dry" if part.dry_run else "real"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = size["backend"] if device == "cuda" else "eager"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    cfg, model = build(size, device)
    n = size["sequences"]
    part.result["config"] = {
        **size,
        "device": device,
        "backend": backend,
        "params": sum(p.numel() for p in model.parameters()),
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "weights": "random (the model's initialisation), bf16",
        "state_bytes_computed": n * cfg.state_bytes_per_sequence()["total"],
        "torch_threads": torch.get_num_threads(),
    }
    part.result["build_s"] = time.perf_counter() - t0
    try:
        state = model.init_state(n)
    except Exception as e:  # noqa: BLE001
        if not is_out_of_memory(e):
            raise
        part.error(f"state for {n} sequences", e)
        part.result["headline"] = {"decode_tokens_per_s_3b_1280": None}
        part.finish("partial")
        return
    part.result["state_bytes_allocated"] = sum(t.nbytes for t in state.gla + state.conv)
    part.result["state_dtypes"] = sorted({str(t.dtype) for t in state.gla + state.conv})
    gen = torch.Generator(device=device).manual_seed(0)
    live = {
        "tokens": torch.randint(0, cfg.vocab_size, (n,), device=device, generator=gen),
        "state": state,
    }
    del state
    runners = {  # eager first: its figure is kept even if the compile outlasts the budget
        "eager": DecodeRunner(model, widths=(n,), row_exact=False),
        "compiled": DecodeRunner(
            model, compile=True, widths=(n,), row_exact=False, backend=backend
        ),
    }

    def steps(runner, k: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(k):
            logits, live["state"] = runner.step(live["tokens"], live["state"])
            live["tokens"] = logits.argmax(-1)
        sync()
        return time.perf_counter() - t0

    k = size["steps_per_round"]
    for name in list(runners):
        try:
            part.result[f"{name}_warm_s"] = steps(runners[name], size["warm_steps"])
            part.say(
                f"{name}: warm-up of {size['warm_steps']} steps "
                f"{part.result[f'{name}_warm_s']:.1f} s"
            )
            if name == "eager":  # one round before the compile
                part.result["eager_before_compile_tokens_per_s"] = n * k / steps(runners[name], k)
        except Exception as e:  # noqa: BLE001 - e.g. the compile fails: the other still runs
            part.error(f"{name} warm-up", e)
            del runners[name]
            if device == "cuda":
                torch.cuda.empty_cache()
        part.save()
    times = {name: [] for name in runners}
    while runners and len(times[next(iter(runners))]) < size["max_rounds"]:
        r = len(times[next(iter(runners))])
        last = sum(t[-1] for t in times.values()) if r else 0.0
        if r >= size["min_rounds"] and part.remaining() < 2 * last + 5:
            break
        if r and part.remaining() < last + 3:
            break
        order = list(runners) if r % 2 == 0 else list(runners)[::-1]
        for name in order:
            times[name].append(steps(runners[name], k))
        part.say(
            f"round {r + 1}: "
            + ", ".join(f"{name} {n * k / times[name][-1]:,.0f} tokens/s" for name in runners)
        )
        summarise(part, times, n * k)  # after every round: a kill later keeps the figures
        part.save()
    summarise(part, times, n * k)
    if device == "cuda":
        part.result["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    compiled = part.result["tokens_per_s"].get("compiled")
    complete = compiled is not None and compiled["n"] >= size["min_rounds"]
    part.finish("ok" if complete and not part.result["errors"] else "partial")
