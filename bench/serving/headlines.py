"""The headline figures of a `bench.serve` run (docs/design.md s7 keys, from medians), the
extras beside them, and the notes a reader of the result must know."""

from __future__ import annotations

import dataclasses
import statistics

from bench.serving.models import llama_kv_bytes_per_token
from bench.serving.sizes import COST_PROMPTS, FULL, Sizes
from laplace_spec.config import LaplaceConfig


def _tps(results: dict, key: str, n: int) -> float | None:
    """The median output tokens/s of `n` concurrent requests (the headlines' figure)."""
    rows = results.get(key, [])
    return next((r["median_tokens_per_s"] for r in rows if r["concurrency"] == n), None)


def _median_ttft(row: dict) -> float:
    return statistics.median(row["samples_ttft_s"])


def _over(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def headlines(results: dict, cfg: LaplaceConfig, sz: Sizes) -> None:
    """docs/design.md s7's headline keys (plain numbers) and the extras beside them."""
    lc, measured = results["laplace_cost"], results["laplace_state"]
    computed = cfg.state_bytes_per_sequence()["total"]
    h = results["headline"] = {
        "cost_per_token_8k_over_2k": lc[1]["median_seconds_per_output_token"]
        / lc[0]["median_seconds_per_output_token"],
        "state_bytes_per_seq_measured": measured["bytes_per_seq"],
        "state_bytes_per_seq_computed": computed,
        "tokens_per_s_at_32": _tps(results, "laplace_throughput", 32),
    }
    x = results["headline_extra"] = {
        "model_forward_cost_per_token_8k_over_2k": lc[1]["model_forward_seconds_per_output_token"]
        / lc[0]["model_forward_seconds_per_output_token"],
        "best_window_cost_per_token_8k_over_2k": lc[1]["seconds_per_output_token"]
        / lc[0]["seconds_per_output_token"],
    }
    for n in sz.levels:
        h[f"over_llama_tokens_per_s_p128_s{n}"] = _over(
            _tps(results, "laplace_throughput_p128", n), _tps(results, "llama_throughput_p128", n)
        )
    h["over_llama_tokens_per_s_p2048_s64"] = _over(
        _tps(results, "laplace_throughput_p2048", sz.long_seqs),
        _tps(results, "llama_throughput_p2048", sz.long_seqs),
    )
    sb = results.get("shared_budget", {})
    if "llama" in sb:
        h["over_llama_tokens_per_s_1280_requests"] = (
            sb["laplace"]["tokens_per_s"] / sb["llama"]["tokens_per_s"]
        )
        x |= {
            "shared_budget_llama_max_running": sb["llama"]["max_running"],
            "shared_budget_llama_vllm_max_concurrency": sb["llama"]["engine"][
                "vllm_max_concurrency"
            ],
            "shared_budget_laplace_max_running": sb["laplace"]["max_running"],
            "shared_budget_decode_tokens_per_s_laplace": sb["laplace"]["decode_tokens_per_s"],
            "shared_budget_decode_tokens_per_s_llama": sb["llama"]["decode_tokens_per_s"],
        }
    pc = results.get("prefix_cache", {})
    if "cached" in pc:  # turn `turns` (10 in the full run) over turn 1
        h["prefix_cache_ttft_turn10_over_turn1"] = _median_ttft(pc["cached"][-1]) / _median_ttft(
            pc["cached"][0]
        )
        x["prefix_cache_off_ttft_turn10_over_turn1"] = _median_ttft(
            pc["uncached"][-1]
        ) / _median_ttft(pc["uncached"][0])
        x["prefix_cache_replies_equal"] = int(pc["replies_equal"])
    for n in sz.compile_levels:  # vLLM's compile mode: over eager, and Laplace over Llama
        lap_c = _tps(results, "laplace_compiled_throughput_p128", n)
        llama_c = _tps(results, "llama_compiled_throughput_p128", n)
        x[f"compiled_over_eager_laplace_p128_s{n}"] = _over(
            lap_c, _tps(results, "laplace_throughput_p128", n)
        )
        x[f"compiled_over_eager_llama_p128_s{n}"] = _over(
            llama_c, _tps(results, "llama_throughput_p128", n)
        )
        x[f"over_llama_compiled_tokens_per_s_p128_s{n}"] = _over(lap_c, llama_c)
    if "llama_prefill" in results:
        x["over_llama_prefill_tokens_per_s"] = statistics.median(
            results["laplace_prefill"]["samples_prompt_tokens_per_s"]
        ) / statistics.median(results["llama_prefill"]["samples_prompt_tokens_per_s"])
    for who in ("laplace", "llama"):
        if f"{who}_compiled_greedy_equal_eager" in results:
            x[f"{who}_compiled_greedy_equal_eager"] = results[f"{who}_compiled_greedy_equal_eager"]
    results["headline"] = {k: v for k, v in h.items() if v is not None}  # not measured: absent
    if "llama_cost" in results:
        kv_tok, long_p = llama_kv_bytes_per_token(cfg), COST_PROMPTS[1]
        x |= {
            "llama_cost_per_token_8k_over_2k": results["llama_cost"][1][
                "median_seconds_per_output_token"
            ]
            / results["llama_cost"][0]["median_seconds_per_output_token"],
            "llama_kv_bytes_per_seq_8k": kv_tok * long_p,
            "llama_over_laplace_memory_8k": kv_tok * long_p / computed,
        }
    results["headline_extra"] = {k: v for k, v in x.items() if v is not None}


def run_notes(results: dict, sz: Sizes, quick: bool) -> list[str]:
    """What a reader of the JSON must know about this run's figures."""
    notes = [
        "Throughput figures are end to end (all requests added at once, prefill included); "
        "tokens_per_s is the best of `repeats`, median_tokens_per_s their median, and the "
        "headline ratios are of medians. decode_tokens_per_s: output tokens over the wall "
        "time of the engine steps in which every scheduled request got exactly one token; steps "
        "mixing prefill chunks and decodes are not split, so it is the rate of the pure-decode "
        "phase.",
        "shared_budget: both engines are built with kv_cache_memory_bytes = budget_bytes "
        "(VLLM_CPU_KVCACHE_SPACE, which vLLM 0.32 on CPU lets override it in whole GiB, is "
        "unset meanwhile) and the same max_num_seqs (the Laplace adapter's default for that "
        "budget); engine.allocated_bytes is what vLLM allocated. max_running: the most "
        "sequences one engine step scheduled (vLLM's running set); vllm_max_concurrency: vLLM's "
        "own figure for sequences of prompt + new tokens in the blocks it has.",
        "prefix_cache: the uncached conversation runs on the engine without prefix caching, "
        "the cached one on an engine built with the adapter's prefix caching (align mode); "
        "prefill_tokens = prompt_len - vLLM's num_cached_tokens. TTFT is measured from adding "
        "the request to the engine step that returns its first token, one request at a time.",
    ]
    if quick or sz != FULL:
        changed = {
            f.name: getattr(sz, f.name)
            for f in dataclasses.fields(Sizes)
            if getattr(sz, f.name) != getattr(FULL, f.name)
        }
        notes.append(
            ("QUICK RUN: " if quick else "")
            + f"sizes differ from the full run's {changed}. The headline keys keep the names "
            "of docs/design.md s7, which describe the full sizes (s64, 1280_requests, turn10): "
            "these figures were measured at the sizes above and are not the full run's."
        )
    for who in ("laplace", "llama"):
        rows = results.get(f"{who}_throughput_p2048", [])
        if rows and rows[0]["max_running"] < sz.long_seqs:
            notes.append(
                f"{who}: at most {rows[0]['max_running']} of the {sz.long_seqs} "
                f"{sz.long_prompt}-token sequences were scheduled in one step (the "
                "first finish before the last are prefilled, max_num_batched_tokens a "
                "step, or the cache was full: see preempted)"
            )
    if results.get("prefix_cache", {}).get("replies_equal") is False:
        notes.append("prefix_cache: the greedy replies differ with and without caching")
    return notes
