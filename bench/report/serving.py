"""docs/serving.md: bf16 parity (bench.bf16_parity), the prefix cache (bench.serve) and the
state store (bench.serve --agent-resume)."""

from __future__ import annotations

from bench.report.fmt import load, ratio, sci, table

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


def state_store() -> str:
    d = load("agent_resume")
    rows = []
    for r in d["rows"]:
        c = r["cold_over_store"]
        rows.append(
            [
                f"{r['history']:,}",
                f"{min(r['cached_tokens']):,} of {r['turn2_prompt']:,}",
                f"{1e3 * min(r['ttft_store_s']):.0f} ms",
                f"{1e3 * min(r['ttft_cold_s']):,.0f} ms",
                f"**{ratio(c['median'], 1)}** ({ratio(c['min'], 1)}-{ratio(c['max'], 1)})",
                f"{r['store_bytes'] / 2**10:,.0f} KiB",
                f"{r['llama_kv_bytes'] / 2**20:,.0f} MiB",
            ]
        )
    rep = d["replica"]
    files = "/".join(sorted({f"{r['store_files']}" for r in d["rows"]}))
    return (
        f"`python -m bench.serve --agent-resume` (`bench/results/agent_resume.json`, "
        f"{d['machine']['cpu']}): `small` (random weights, eager); a history, a reply of "
        f"{d['sizes']['resume_reply']} tokens, the server stopped and started again on the same "
        f"folder, then a {d['sizes']['resume_message']}-token message: time to first token from "
        f"the store, and of the same request recomputing the whole history (cold: another "
        f"`cache_salt`), {d['sizes']['resume_rounds']} restarts each (the fastest, and the "
        f"median ratio with its range); on disk, the conversation's two turns:\n\n"
        + table(
            [
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
        + f"\n\nOn disk a conversation costs at most two states a turn (at its prompt's last "
        f"block boundary and its newest, {d['state_bytes_per_sequence'] / 2**10:,.0f} KiB "
        f"each; here {files} files for its two turns) however long it is; "
        f"Llama's KV bytes (fp32, computed) grow with every token. Replica hand-over (a "
        f"2-replica server, turn 2 sent to the replica that did not serve turn 1): "
        f"{rep['cached_tokens']:,} tokens cached of an expected {rep['expected']:,}."
    )


BLOCKS = {"bf16-parity": bf16_parity, "prefix": prefix, "state-store": state_store}
