"""docs/serving.md: bf16 parity (bench.bf16_parity), the prefix cache (bench.serve) and the
state store (bench.serve --agent-resume)."""

from __future__ import annotations

from bench.report.fmt import load, ratio, sci, table

PAGE = "docs/serving.md"
DESIGN_STORE = "design.md#101-the-agents-state-store-a-conversations-state-on-disk-state-dir"


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


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


def state_store() -> str:
    d = load("agent_resume")
    hybrid = d["hybrid4"]
    rows = []
    for model, runs in (("Laplace", d["rows"]), ("3:1 hybrid", hybrid["rows"])):
        for r in runs:
            c = r["cold_over_store"]
            rows.append(
                [
                    model,
                    f"{r['history']:,}",
                    f"{min(r['cached_tokens']):,} of {r['turn2_prompt']:,}",
                    f"{1e3 * min(r['ttft_store_s']):.0f} ms",
                    f"{1e3 * min(r['ttft_cold_s']):,.0f} ms",
                    f"**{ratio(c['median'], 1)}** ({ratio(c['min'], 1)}-{ratio(c['max'], 1)})",
                    _size(r["store_bytes"]),
                    f"{r['llama_kv_bytes'] / 2**20:,.0f} MiB",
                ]
            )
    rep, shared, last = d["replica"], hybrid["shared_prompt"], hybrid["rows"][-1]
    files = "/".join(sorted({f"{r['store_files']}" for r in d["rows"]}))
    equal = all(all(r["first_token_equal_cold"]) for r in d["rows"] + hybrid["rows"])
    return (
        f"`python -m bench.serve --agent-resume` (`bench/results/agent_resume.json`, "
        f"{d['machine']['cpu']}): `small` and its 3:1 hybrid (`attention_every=4`; random "
        f"weights, eager); a history, a reply of {d['sizes']['resume_reply']} tokens, the server "
        f"stopped and started again on the same folder, then a "
        f"{d['sizes']['resume_message']}-token message: time to first token from the store, and "
        f"of the same request recomputing the whole history (cold: another `cache_salt`), "
        f"{d['sizes']['resume_rounds']} restarts each (the fastest, and the median ratio with its "
        f"range); on disk, the conversation's two turns:\n\n"
        + table(
            [
                "model",
                "history",
                "cached after restart",
                "first token, store",
                "first token, cold",
                "cold / store",
                "on disk",
                "Llama's KV",
            ],
            rows,
        )
        + "\n\n"
        + (
            "The first token from the store is the cold run's in every round. "
            if equal
            else "**The first token from the store differs from the cold run's in a round.** "
        )
        + f"On disk a Laplace conversation costs at most two states a turn (at its prompt's last "
        f"block boundary and its newest, {d['state_bytes_per_sequence'] / 2**10:,.0f} KiB "
        f"each; here {files} files for its two turns) however long it is; the hybrid adds its "
        f"attention layer's blocks, once each ({_size(last['store_bytes'])} at "
        f"{last['history']:,} tokens against {_size(last['formula_bytes'])} by the formula of "
        f"[design s10.1]({DESIGN_STORE})); Llama's KV bytes (fp32, computed) grow with every "
        "token. "
        f"{shared['conversations']} hybrid conversations that open with one "
        f"{shared['shared_prompt']:,}-token system prompt store {shared['attention_blocks']:,} "
        f"attention blocks ({_size(shared['store_bytes'])} in all): the prompt's once "
        f"({shared['attention_blocks_if_shared_once']:,} expected; "
        f"{shared['attention_blocks_if_copied']:,} if each kept its own). Replica hand-over (a "
        f"2-replica server, turn 2 sent to the replica that did not serve turn 1): "
        f"{rep['cached_tokens']:,} tokens cached of an expected {rep['expected']:,}."
    )


BLOCKS = {"bf16-parity": bf16_parity, "prefix": prefix, "state-store": state_store}
