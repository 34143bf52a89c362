"""The phases of a `bench.serve` run, their figures written into `results`: the side-by-side
engines (Laplace and Llama, eager and compiled, alive together, measured in alternating rounds),
Laplace with prefix caching, the shared budget (one engine at a time: each holds the budget)."""

from __future__ import annotations

import gc
import math
import time
from pathlib import Path

from bench.serving.measure import (
    conversation_ttft,
    greedy_tokens,
    interleaved_cost,
    interleaved_prefill,
    interleaved_throughput,
    measured_state_bytes,
    pool_bytes,
    random_prompts,
    run_batch,
    staggered_vs_fixed,
)
from bench.serving.models import make_budget_llm
from bench.serving.sizes import COST_PROMPTS, MID_SHAPE, Sizes
from laplace_spec.config import LaplaceConfig


def side_by_side_engines(lap_dir, llama_dir, sz: Sizes, max_len: int) -> dict:
    """The engines measured side by side, all alive at once in this process: Laplace and
    Llama (64 sequences, the 2 GiB default budget each), eager, and in vLLM's compile mode
    (the adapter's `--compile`) when `sz.compiled`."""
    from serve.vllm_adapter import make_llm

    dirs = {"laplace": lap_dir, "llama": llama_dir}
    engines = {}
    for compile_mode in (False, True)[: 1 + bool(sz.compiled)]:
        for who, model_dir in dirs.items():
            if model_dir is None:
                continue
            name = who + ("_compiled" if compile_mode else "")
            print(f"engine {name}", flush=True)
            engines[name] = make_llm(
                str(model_dir), max_model_len=max_len, max_num_seqs=64, compile=compile_mode
            )
    return engines


def run_side_by_side(lap_dir, llama_dir, cfg: LaplaceConfig, sz: Sizes, max_len, results):
    """Every figure that compares engines, in alternating rounds on engines alive together:
    the throughput tables (64- and 128-token prompts at `levels`, `long_seqs` x `long_prompt`),
    the prefill rate, the cost per output token at 2k and 8k, the greedy continuations of
    each mode; then, on the eager Laplace engine, its state pages, staggered arrivals and the
    uncached conversation. Returns the conversation's replies."""
    engines = side_by_side_engines(lap_dir, llama_dir, sz, max_len)
    eager = {k: v for k, v in engines.items() if not k.endswith("_compiled")}
    lap, vocab = engines["laplace"], cfg.vocab_size
    results["laplace_state"] = measured = measured_state_bytes(lap)
    print(
        f"  state per sequence: measured {measured['bytes_per_seq']:,} B on vLLM's pages, "
        f"computed {cfg.page_bytes_per_sequence():,} B",
        flush=True,
    )

    def store(suffix: str, by_engine: dict) -> None:
        for name, value in by_engine.items():
            results[f"{name}_{suffix}"] = value

    store(
        "throughput", interleaved_throughput(eager, vocab, sz.levels, 64, sz.new_tokens, sz.rounds)
    )
    store(
        "throughput_p128",
        interleaved_throughput(engines, vocab, sz.levels, 128, sz.p128_new_tokens, sz.rounds),
    )
    store(
        "throughput_p2048",
        interleaved_throughput(
            eager, vocab, (sz.long_seqs,), sz.long_prompt, sz.long_new_tokens, sz.rounds
        ),
    )
    store(  # the agent row: a long history at low concurrency, every engine (both modes)
        "throughput_agent",
        interleaved_throughput(
            engines, vocab, sz.agent_levels, sz.agent_prompt, sz.agent_new_tokens, sz.rounds
        ),
    )
    store("prefill", interleaved_prefill(engines, vocab, 32, sz.budget_prompt, sz.rounds))
    costs = interleaved_cost(
        eager, vocab, COST_PROMPTS, sz.cost_seqs, sz.cost_tokens, sz.cost_repeats
    )
    store("cost", costs)
    for c in costs["laplace"]:
        print(
            f"  Laplace, prompt {c['prompt_len']}: {1e3 * c['median_seconds_per_output_token']:.3f}"
            f" ms per output token ({1e3 * c['model_forward_seconds_per_output_token']:.3f} ms in "
            "the model's forward)",
            flush=True,
        )
    for name, llm in engines.items():
        results[f"{name}_greedy_tokens"] = greedy_tokens(llm, vocab, sz)
    for who in ("laplace", "llama"):
        if f"{who}_compiled" in engines:
            compiled, eager_tokens = (results[f"{who}{m}_greedy_tokens"] for m in ("_compiled", ""))
            same = sum(a == b for a, b in zip(compiled, eager_tokens, strict=True))
            results[f"{who}_compiled_greedy_equal_eager"] = same / len(eager_tokens)
            print(f"  {who}: compiled greedy equal to eager's: {same} of {len(compiled)}")
    results["staggered"] = staggered_vs_fixed(lap, vocab, 32, 64, sz.new_tokens, 2)
    print("  conversation without prefix caching", flush=True)
    rows, replies = conversation_ttft(lap, vocab, sz)
    results["prefix_cache"] = {
        "turns": sz.turns,
        "first_tokens": sz.turn_first,
        "message_tokens": sz.turn_message,
        "reply_tokens": sz.turn_reply,
        "repeats": sz.turn_repeats,
        "uncached": rows,
    }
    del engines, eager, lap  # their pages go with the engine cores
    gc.collect()
    return replies


def run_laplace_prefix(lap_dir: Path, cfg: LaplaceConfig, sz: Sizes, max_len, results, replies):
    """The conversation again on an engine with prefix caching (the adapter's align mode);
    its greedy replies must be those of the uncached engine."""
    from serve.vllm_adapter import make_llm

    print("Laplace with --enable-prefix-caching: the same conversation", flush=True)
    llm = make_llm(str(lap_dir), max_model_len=max_len, max_num_seqs=64, prefix_caching=True)
    rows, cached_replies = conversation_ttft(llm, cfg.vocab_size, sz)
    del llm  # its pages go with the engine core
    gc.collect()
    results["prefix_cache"]["cached"] = rows
    results["prefix_cache"]["replies_equal"] = cached_replies == replies


def shared_budget_run(model_dir: Path, vocab: int, sz: Sizes, max_num_seqs: int) -> dict:
    """`budget_requests` requests (`budget_prompt` tokens, `budget_new_tokens` new each) given at
    once to an engine whose state pages / KV cache hold exactly `budget_bytes`
    (`kv_cache_memory_bytes`); `max_num_seqs` is the same for both models (the Laplace adapter's
    default for that budget), so only the cache limits how many run at once. Returns
    `run_batch`'s figures and the engine's pages: blocks, block size, bytes allocated and vLLM's
    own maximum concurrency for a sequence of max_model_len = prompt + new tokens."""
    max_len = sz.budget_prompt + sz.budget_new_tokens
    llm = make_budget_llm(model_dir, max_len, max_num_seqs, sz.budget_bytes)
    cc = llm.llm_engine.vllm_config.cache_config
    kv = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    engine = {
        "max_num_seqs": max_num_seqs,
        "kv_cache_memory_bytes": cc.kv_cache_memory_bytes,
        "num_blocks": kv.num_blocks,
        "block_size": cc.block_size,
        "allocated_bytes": pool_bytes(llm),
        "vllm_max_concurrency": cc.kv_cache_max_concurrency,
    }
    run_batch(llm, random_prompts(2, 16, vocab, 0), 4)  # warm-up
    prompts = random_prompts(sz.budget_requests, sz.budget_prompt, vocab, 1280)
    run = run_batch(llm, prompts, sz.budget_new_tokens)
    del llm  # its pages go with the engine core
    gc.collect()
    print(
        f"  {sz.budget_requests} requests: {run['tokens_per_s']:9.1f} output tokens/s end to "
        f"end, decode phase {run['decode_tokens_per_s']:9.1f}, at most {run['max_running']} "
        f"sequences at once ({engine['num_blocks']} blocks of {engine['block_size']}, "
        f"{engine['allocated_bytes']:,} B)",
        flush=True,
    )
    return {**run, "engine": engine}


def run_shared_budget(lap_dir, llama_dir, cfg: LaplaceConfig, sz: Sizes, results: dict) -> None:
    """Both models, one after the other, in the same state/KV budget."""
    from serve.vllm_adapter import default_max_num_seqs

    seqs = default_max_num_seqs(lap_dir, budget_bytes=sz.budget_bytes)
    sb = results["shared_budget"] = {
        "requests": sz.budget_requests,
        "prompt_len": sz.budget_prompt,
        "new_tokens": sz.budget_new_tokens,
        "budget_bytes": sz.budget_bytes,
    }
    print(f"Shared budget of {sz.budget_bytes:,} B: Laplace", flush=True)
    sb["laplace"] = shared_budget_run(lap_dir, cfg.vocab_size, sz, seqs)
    if llama_dir is not None:
        print(f"Shared budget of {sz.budget_bytes:,} B: Llama", flush=True)
        sb["llama"] = shared_budget_run(llama_dir, cfg.vocab_size, sz, seqs)


def mid_models(cfg: LaplaceConfig, sz: Sizes, tmp: Path) -> dict[str, Path]:
    """The mid-size Laplace and Llama (`MID_SHAPE`, random weights), exported once into `tmp`
    for the mid-size and seed rows; served up to `mid_prompt + mid_new_tokens` tokens."""
    from bench.serving.models import export_laplace, make_llama

    mid, max_len = cfg.replace(**MID_SHAPE), sz.mid_prompt + sz.mid_new_tokens
    dirs = {"laplace": tmp / "laplace_mid", "llama": tmp / "llama_mid"}
    if not (dirs["laplace"] / "config.json").exists():
        export_laplace(mid, dirs["laplace"], max_len)
    if not (dirs["llama"] / "config.json").exists():
        make_llama(dirs["llama"], mid, max_len)
    return dirs


def run_mid(cfg: LaplaceConfig, sz: Sizes, tmp: Path, results: dict) -> None:
    """The mid-size row: Laplace and Llama of about 300M parameters (`MID_SHAPE`, random
    weights), `mid_seqs` sequences of `mid_prompt` tokens and `mid_new_tokens` new ones, each
    engine's pages / KV cache `mid_budget_bytes`; both alive, measured in alternating rounds."""
    max_len = sz.mid_prompt + sz.mid_new_tokens
    dirs = mid_models(cfg, sz, tmp)
    print(f"mid-size row: {MID_SHAPE}", flush=True)
    engines = {
        who: make_budget_llm(d, max_len, sz.mid_seqs, sz.mid_budget_bytes)
        for who, d in dirs.items()
    }
    rows = interleaved_throughput(
        engines, cfg.vocab_size, (sz.mid_seqs,), sz.mid_prompt, sz.mid_new_tokens, sz.mid_rounds
    )
    results["mid"] = {
        "shape": MID_SHAPE,
        "parameters": {who: _parameters(d) for who, d in dirs.items()},
        "budget_bytes": sz.mid_budget_bytes,
        **{who: rows[who][0] for who in engines},
    }
    del engines
    gc.collect()


def run_seed(cfg: LaplaceConfig, sz: Sizes, tmp: Path, results: dict) -> None:
    """The seed row: vLLM's compile mode over eager at the mid-size width (22 layers of 1,024,
    where the layers are most of a step), `seed_levels` sequences of `seed_prompt` tokens and
    `seed_new_tokens` new ones; Laplace and Llama, eager and compiled, the four engines alive
    together (`seed_budget_bytes` of pages / KV each), measured in alternating rounds."""
    max_len = sz.mid_prompt + sz.mid_new_tokens
    dirs = mid_models(cfg, sz, tmp)
    print(f"seed row: mid-size, compiled over eager, {sz.seed_levels} sequences", flush=True)
    engines = {
        who + ("_compiled" if compile_mode else ""): make_budget_llm(
            d, max_len, max(sz.seed_levels), sz.seed_budget_bytes, compile=compile_mode
        )
        for compile_mode in (False, True)
        for who, d in dirs.items()
    }
    results["seed"] = {
        "shape": MID_SHAPE,
        "budget_bytes": sz.seed_budget_bytes,
        **interleaved_throughput(
            engines, cfg.vocab_size, sz.seed_levels, sz.seed_prompt, sz.seed_new_tokens, sz.rounds
        ),
    }
    del engines
    gc.collect()


def _parameters(model_dir: Path) -> int:
    """Parameters of an exported folder (every tensor of its safetensors files)."""
    from safetensors import safe_open

    n = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            n += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return n


def phase(results: dict, name: str, fn, *args):
    """fn(*args), timed into results["phase_seconds"]; a failure other than in the Laplace
    engine's own phase is recorded as results[name + "_error"] (the other figures stand)."""
    t0 = time.perf_counter()
    try:
        return fn(*args)
    except Exception as e:
        if name == "side_by_side":
            raise
        results[f"{name}_error"] = repr(e)
        print(f"  {name} failed: {e!r}", flush=True)
    finally:
        results.setdefault("phase_seconds", {})[name] = time.perf_counter() - t0
        gc.collect()  # the phase's engine, even after a failure
