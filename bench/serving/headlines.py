"""The headline figures of a `bench.serve` run (docs/design.md s7 keys, from medians), the
extras beside them, and the notes a reader of the result must know."""

from __future__ import annotations

import dataclasses
import statistics

from bench.serving.models import llama_kv_bytes_per_token
from bench.serving.sizes import COST_PROMPTS, FULL, Sizes
from laplace_spec.config import LaplaceConfig


def _samples(results: dict, key: str, n: int) -> list[float] | None:
    """The round-by-round output tokens/s of `n` concurrent requests (sample r: round r)."""
    rows = results.get(key, [])
    return next((r["samples_tokens_per_s"] for r in rows if r["concurrency"] == n), None)


def _median_ttft(row: dict) -> float:
    return statistics.median(row["samples_ttft_s"])


def paired(a: list[float] | None, b: list[float] | None) -> dict | None:
    """The ratio a / b of two engines measured in the same alternating rounds, round by round:
    {median, min, max, samples}; the median is the headline, min..max its spread."""
    if not a or not b:
        return None
    r = [x / y for x, y in zip(a, b, strict=True)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r), "samples": r}


def headlines(results: dict, cfg: LaplaceConfig, sz: Sizes) -> None:
    """docs/design.md s7's headline keys (plain numbers), the extras beside them, and every
    paired ratio with its spread (`ratios`)."""
    measured = results["laplace_state"]
    computed = cfg.page_bytes_per_sequence()
    ratios: dict[str, dict] = {}

    def cost(who: str, field: str = "window_samples") -> dict | None:  # 8k over 2k, by round
        rows = results.get(f"{who}_cost")
        return paired(rows[1][field], rows[0][field]) if rows else None

    def tps(a: str, b: str, key: str, n: int) -> dict | None:
        return paired(_samples(results, f"{a}_{key}", n), _samples(results, f"{b}_{key}", n))

    def prefill(a: str, b: str) -> dict | None:
        ra, rb = results.get(f"{a}_prefill"), results.get(f"{b}_prefill")
        if not ra or not rb:
            return None
        return paired(ra["samples_prompt_tokens_per_s"], rb["samples_prompt_tokens_per_s"])

    def mid() -> dict | None:
        m = results.get("mid")
        return m and paired(
            m["laplace"]["samples_tokens_per_s"], m["llama"]["samples_tokens_per_s"]
        )

    def seed(who: str, n: int) -> dict | None:  # compiled over eager, mid-size, by round
        rows = results.get("seed", {})
        if who not in rows:
            return None
        samples = {
            mode: next(r["samples_tokens_per_s"] for r in rows[mode] if r["concurrency"] == n)
            for mode in (who, f"{who}_compiled")
        }
        return paired(samples[f"{who}_compiled"], samples[who])

    headline_ratios = {
        "cost_per_token_8k_over_2k": cost("laplace"),
        **{
            f"over_llama_tokens_per_s_p128_s{n}{suffix}": tps(
                "laplace" + suffix, "llama" + suffix, "throughput_p128", n
            )
            for suffix in ("", "_compiled")
            for n in sz.levels
        },
        **{  # the agent row: `agent_prompt` tokens of history (8,192 in the full run)
            f"over_llama_tokens_per_s_agent8k_s{n}{suffix}": tps(
                "laplace" + suffix, "llama" + suffix, "throughput_agent", n
            )
            for suffix in ("", "_compiled")
            for n in sz.agent_levels
        },
        "over_llama_tokens_per_s_p2048_s64": tps(
            "laplace", "llama", "throughput_p2048", sz.long_seqs
        ),
        **{
            f"compiled_over_eager_laplace_s{n}": tps(
                "laplace_compiled", "laplace", "throughput_p128", n
            )
            for n in sz.levels[:2]
        },
        "over_llama_prefill_tokens_per_s": prefill("laplace", "llama"),
        "over_llama_tokens_per_s_mid_s64": mid(),
        **{  # the seed row: compile mode over eager at the mid-size width
            f"compiled_over_eager_mid_s{n}_{who}": seed(who, n)
            for n in sz.seed_levels
            for who in ("laplace", "llama")
        },
    }
    extra_ratios = {
        "model_forward_cost_per_token_8k_over_2k": cost("laplace", "model_forward_samples"),
        "llama_cost_per_token_8k_over_2k": cost("llama"),
        **{
            f"compiled_over_eager_laplace_s{n}": tps(
                "laplace_compiled", "laplace", "throughput_p128", n
            )
            for n in sz.levels[2:]
        },
        **{
            f"compiled_over_eager_llama_s{n}": tps("llama_compiled", "llama", "throughput_p128", n)
            for n in sz.levels
        },
        "over_llama_compiled_prefill_tokens_per_s": prefill("laplace_compiled", "llama_compiled"),
        "compiled_over_eager_laplace_prefill": prefill("laplace_compiled", "laplace"),
    }
    h = {
        "state_bytes_per_seq_measured": measured["bytes_per_seq"],
        "state_bytes_per_seq_computed": computed,
        "tokens_per_s_at_32": next(
            (
                r["median_tokens_per_s"]
                for r in results["laplace_throughput"]
                if r["concurrency"] == 32
            ),
            None,
        ),
    }
    x: dict = {}
    for target, found in ((h, headline_ratios), (x, extra_ratios)):
        for key, r in found.items():
            if r is not None:
                ratios[key] = r
                target[key] = r["median"]
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
    for who in ("laplace", "llama"):
        if f"{who}_compiled_greedy_equal_eager" in results:
            x[f"{who}_compiled_greedy_equal_eager"] = results[f"{who}_compiled_greedy_equal_eager"]
    if "llama_cost" in results:
        kv_tok, long_p = llama_kv_bytes_per_token(cfg), COST_PROMPTS[1]
        x |= {
            "llama_kv_bytes_per_seq_8k": kv_tok * long_p,
            "llama_over_laplace_memory_8k": kv_tok * long_p / computed,
        }
    results["headline"] = {k: v for k, v in h.items() if v is not None}  # not measured: absent
    results["headline_extra"] = x
    results["ratios"] = ratios


def run_notes(results: dict, sz: Sizes, quick: bool) -> list[str]:
    """What a reader of the JSON must know about this run's figures."""
    notes = [
        "The engines compared (Laplace and Llama, eager and compiled) are alive together and "
        "measured in alternating rounds: in round r each runs the same prompts once, in an "
        "order rotated by r. A ratio is taken round by round and headlined as the median of "
        "its rounds (`ratios` keeps min, max and every round). Throughput figures are end to "
        "end (all requests added at once, prefill included); median_tokens_per_s is the median "
        "of the rounds, tokens_per_s the best. decode_tokens_per_s: output tokens over the wall "
        "time of the engine steps in which every scheduled request got exactly one token; steps "
        "mixing prefill chunks and decodes are not split, so it is the rate of the pure-decode "
        "phase (median of the rounds).",
        "cost_per_token_8k_over_2k: each round times one window of pure decode steps at 2,048 "
        "and at 8,192 tokens of context on each engine; the ratio is taken within a round.",
        "shared_budget: one run per model, one engine at a time (each engine holds the whole "
        "budget), so its ratio is not of alternating rounds. Both engines are built with "
        "kv_cache_memory_bytes = budget_bytes "
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
