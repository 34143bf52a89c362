"""docs/serving.md: bf16 parity (bench.bf16_parity) and the prefix cache (bench.serve)."""

from __future__ import annotations

from bench.report.fmt import load, sci

PAGE = "docs/serving.md"


def bf16_parity() -> str:
    d = load("bf16_parity")
    h, n, k, cpu = d["headline"], d["new_tokens"], len(d["prompts"]), d["machine"]["cpu"]
    return (
        f"`python -m bench.bf16_parity` (`bench/results/bf16_parity.json`, {cpu}): `small` "
        f"trained {d['steps']} steps, exported in bf16, {k} prompts, {n} greedy tokens each: "
        f"vLLM and the PyTorch bf16 module pick the same tokens on {h['bf16_prompts_equal']} of "
        f"{k} prompts (the fewest leading equal steps: {h['bf16_steps_equal_min']}); vLLM's "
        f"log-probabilities of its tokens are at most {sci(h['bf16_logprob_gap_max'], 2)} from "
        f"the module's, teacher-forced as vLLM runs, and "
        f"{sci(h['bf16_prefill_logprob_gap_max'], 2)} through the prefill path alone "
        "([design s12.4](design.md#124-the-bf16-contract-what-is-rounded-where): the bf16 "
        "contract, and why decode steps differ by about a bf16 "
        "spacing of the logits)."
    )


def prefix() -> str:
    d = load("serve")["prefix_cache"]
    last = d["cached"][-1]
    return (
        f"In `bench.serve`'s {d['turns']}-turn conversation ({d['first_tokens']} first tokens, "
        f"then +{d['reply_tokens']} reply +{d['message_tokens']} message tokens a turn), turn "
        f"{last['turn']} prefills {last['prefill_tokens']:,} of its {last['prompt_len']:,} "
        f"tokens (`vllm:prefix_cache_hits` on `/metrics`, `num_cached_tokens` per request)."
    )


BLOCKS = {"bf16-parity": bf16_parity, "prefix": prefix}
