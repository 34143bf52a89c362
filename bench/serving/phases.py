"""The phases of a `bench.serve` run, one engine each, their figures written into `results`:
Laplace without and with prefix caching, Llama, vLLM's compile mode, the shared budget."""

from __future__ import annotations

import gc
import time
from pathlib import Path

from bench.serving.measure import (
    conversation_ttft,
    cost_per_output_token,
    greedy_tokens,
    measured_state_bytes,
    prefill_rate,
    random_prompts,
    run_batch,
    staggered_vs_fixed,
    throughput_vs_concurrency,
)
from bench.serving.models import make_budget_llm
from bench.serving.sizes import COST_PROMPTS, Sizes
from laplace_spec.config import LaplaceConfig


def throughput_tables(llm, vocab: int, sz: Sizes, who: str, results: dict) -> None:
    """The three throughput tables of one engine: 64- and 128-token prompts at `levels`
    sequences, `long_seqs` sequences at `long_prompt` tokens; and its prefill rate at the
    shared budget's prompt length."""
    results[f"{who}_throughput"] = throughput_vs_concurrency(
        llm, vocab, sz.levels, 64, sz.new_tokens, sz.repeats
    )
    results[f"{who}_throughput_p128"] = throughput_vs_concurrency(
        llm, vocab, sz.levels, 128, sz.p128_new_tokens, sz.repeats
    )
    results[f"{who}_throughput_p2048"] = throughput_vs_concurrency(
        llm, vocab, (sz.long_seqs,), sz.long_prompt, sz.long_new_tokens, sz.repeats
    )
    results[f"{who}_prefill"] = prefill_rate(llm, vocab, 32, sz.budget_prompt, sz.repeats)


def run_laplace(lap_dir: Path, cfg: LaplaceConfig, sz: Sizes, max_len: int, results: dict):
    """The Laplace engine without prefix caching (64 sequences, the 2 GiB default budget).
    Returns the uncached conversations' replies."""
    from serve.vllm_adapter import make_llm

    print("Laplace (small) through vLLM", flush=True)
    llm = make_llm(str(lap_dir), max_model_len=max_len, max_num_seqs=64)
    results["laplace_state"] = measured = measured_state_bytes(llm)
    print(
        f"  state per sequence: measured {measured['bytes_per_seq']:,} B on vLLM's pages, "
        f"computed {cfg.state_bytes_per_sequence()['total']:,} B",
        flush=True,
    )
    throughput_tables(llm, cfg.vocab_size, sz, "laplace", results)
    results["laplace_cost"] = cost_per_output_token(
        llm, cfg.vocab_size, COST_PROMPTS, sz.cost_seqs, sz.cost_tokens, sz.cost_repeats
    )
    for c in results["laplace_cost"]:
        print(
            f"  prompt {c['prompt_len']}: {1e3 * c['seconds_per_output_token']:.3f} ms per "
            f"output token ({1e3 * c['model_forward_seconds_per_output_token']:.3f} ms in "
            "the model's forward)",
            flush=True,
        )
    results["staggered"] = staggered_vs_fixed(llm, cfg.vocab_size, 32, 64, sz.new_tokens, 2)
    results["laplace_eager_greedy_tokens"] = greedy_tokens(llm, cfg.vocab_size, sz)
    print("  conversation without prefix caching", flush=True)
    rows, replies = conversation_ttft(llm, cfg.vocab_size, sz)
    results["prefix_cache"] = {
        "turns": sz.turns,
        "first_tokens": sz.turn_first,
        "message_tokens": sz.turn_message,
        "reply_tokens": sz.turn_reply,
        "repeats": sz.turn_repeats,
        "uncached": rows,
    }
    del llm  # its pages go with the engine core
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


def run_llama(llama_dir: Path, cfg: LaplaceConfig, sz: Sizes, max_len: int, results: dict):
    """The same-size Llama: the throughput tables and the cost per output token."""
    from serve.vllm_adapter import make_llm

    print("Llama of the same width/depth/vocab through vLLM", flush=True)
    lm = make_llm(str(llama_dir), max_model_len=max_len, max_num_seqs=64)
    throughput_tables(lm, cfg.vocab_size, sz, "llama", results)
    results["llama_cost"] = cost_per_output_token(
        lm, cfg.vocab_size, COST_PROMPTS, sz.cost_seqs, sz.cost_tokens, sz.cost_repeats
    )
    for c in results["llama_cost"]:
        print(
            f"  prompt {c['prompt_len']}: {1e3 * c['seconds_per_output_token']:.3f} ms"
            " per output token",
            flush=True,
        )
    results["llama_eager_greedy_tokens"] = greedy_tokens(lm, cfg.vocab_size, sz)
    del lm  # its pages go with the engine core
    gc.collect()


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
        "allocated_bytes": sum(t.size for t in kv.kv_cache_tensors),
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


def run_compiled(
    model_dir: Path, who: str, cfg: LaplaceConfig, sz: Sizes, max_len: int, results: dict
) -> None:
    """vLLM's compile mode (the adapter's `--compile`): the 128-token-prompt table at
    `compile_levels`, and the share of greedy continuations equal to the eager engine's."""
    from serve.vllm_adapter import make_llm

    print(f"{who} in vLLM's compile mode", flush=True)
    llm = make_llm(str(model_dir), max_model_len=max_len, max_num_seqs=64, compile=True)
    results[f"{who}_compiled_throughput_p128"] = throughput_vs_concurrency(
        llm, cfg.vocab_size, sz.compile_levels, 128, sz.p128_new_tokens, sz.repeats
    )
    eager = results.get(f"{who}_eager_greedy_tokens")
    if eager is not None:
        compiled = greedy_tokens(llm, cfg.vocab_size, sz)
        same = sum(a == b for a, b in zip(compiled, eager, strict=True))
        results[f"{who}_compiled_greedy_equal_eager"] = same / len(eager)
        print(f"  greedy continuations equal to eager's: {same} of {len(eager)}", flush=True)
    del llm
    gc.collect()


def phase(results: dict, name: str, fn, *args):
    """fn(*args), timed into results["phase_seconds"]; a failure other than in the Laplace
    engine's own phase is recorded as results[name + "_error"] (the other figures stand)."""
    t0 = time.perf_counter()
    try:
        return fn(*args)
    except Exception as e:
        if name == "laplace":
            raise
        results[f"{name}_error"] = repr(e)
        print(f"  {name} failed: {e!r}", flush=True)
    finally:
        results.setdefault("phase_seconds", {})[name] = time.perf_counter() - t0
        gc.collect()  # the phase's engine, even after a failure
