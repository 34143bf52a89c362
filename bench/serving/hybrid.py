"""`python -m bench.serve --hybrid`: the hybrid on vLLM beside pure Laplace and Llama, all of
the `small` width (random weights) -> bench/results/serve_hybrid.json.

- bytes per sequence at `hybrid_contexts` tokens, measured on vLLM's pages (the blocks vLLM's KV
  cache manager holds for a live sequence, times the bytes of one block in every layer) against
  the layout's formula (docs/design.md s13.4) and the unpadded figure (a state page per GLA
  layer, a conv window and H (d_k + d_v) keys and values a token per attention layer);
- the shared budget: `budget_requests` requests of `budget_prompt` + `budget_new_tokens` tokens
  given at once to each engine, whose pages / KV cache hold exactly `budget_bytes`, one engine
  at a time (each holds the budget), `hybrid_budget_rounds` rounds in alternating order;
- `long_seqs` sequences of `long_prompt`-token prompts on the four engines alive together, in
  alternating rounds (bench/serving/measure.py `interleaved_throughput`).
"""

from __future__ import annotations

import gc
import math
import statistics
from pathlib import Path

from bench.serving.headlines import paired
from bench.serving.measure import (
    interleaved_throughput,
    page_layout,
    pool_bytes,
    random_prompts,
    rotated,
)
from bench.serving.models import export_laplace, llama_kv_bytes_per_token, make_llama
from bench.serving.phases import shared_budget_run
from bench.serving.sizes import Sizes
from laplace_spec.config import FP32_BYTES, LaplaceConfig
from laplace_spec.vllm_settings import kv_block_bytes


def hybrid_models(cfg: LaplaceConfig, sz: Sizes, tmp: Path, max_len: int) -> dict[str, Path]:
    """{"laplace", "llama", "hybrid{k}" for k in hybrid_every}: exported into `tmp`."""
    dirs = {"laplace": export_laplace(cfg, tmp / "laplace", max_len)}
    dirs["llama"] = make_llama(tmp / "llama", cfg, max_len)
    for k in sz.hybrid_every:
        dirs[f"hybrid{k}"] = export_laplace(cfg.replace(attention_every=k), tmp / f"h{k}", max_len)
    return dirs


def computed_bytes(cfg: LaplaceConfig, block: int, n_tokens: int) -> dict[str, int]:
    """One sequence of n_tokens on the hybrid's vLLM pages, from the config and the block size
    (docs/design.md s13.4): `layout`, a block for every state layer and ceil(n / block) blocks
    per attention layer, each block `block` tokens of fp32 keys and values of
    `kv_page_head_size` in every head; `unpadded`, the same state and keys without vLLM's
    padding (a GLA layer's state page, an attention layer's conv window and H (d_k + d_v)
    values a token)."""
    block_bytes = kv_block_bytes(cfg, block, FP32_BYTES)
    blocks = cfg.n_layers + cfg.n_attention_layers * math.ceil(n_tokens / block)
    window = cfg.page_conv_window * cfg.d_model * FP32_BYTES
    unpadded = (
        cfg.page_bytes_per_sequence()
        + cfg.n_attention_layers * window
        + cfg.hybrid_kv_bytes(n_tokens, FP32_BYTES)
    )
    return {"layout": blocks * block_bytes, "block_bytes": block_bytes, "unpadded": unpadded}


def live_sequence_bytes(llm, vocab: int, n_tokens: int) -> dict:
    """The bytes vLLM holds for one sequence of `n_tokens` prompt tokens once its prefill is
    done: the blocks its KV cache manager gives it in every group (the null block aside),
    times the bytes one block id takes across the pool's tensors."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    per_block = pool_bytes(llm) // scheduler.kv_cache_config.num_blocks
    null = scheduler.kv_cache_manager.block_pool.null_block.block_id
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, detokenize=False)
    prompt = {"prompt_token_ids": random_prompts(1, n_tokens, vocab, 7)[0]}
    rid = engine.add_request("live", prompt, sp)  # the engine's own id for it
    blocks = None
    while engine.has_unfinished_requests():
        engine.step()
        live = scheduler.requests.get(rid)
        if blocks is None and live is not None and live.num_computed_tokens >= n_tokens:
            ids = scheduler.kv_cache_manager.get_block_ids(rid)  # prefill done
            blocks = [sum(b != null for b in group) for group in ids]
    bytes_ = sum(blocks) * per_block
    return {"blocks_per_group": blocks, "bytes_per_block": per_block, "bytes": bytes_}


def run_hybrid(cfg: LaplaceConfig, sz: Sizes, tmp: Path, results: dict) -> None:
    from serve.vllm_adapter import default_max_num_seqs, make_llm

    max_len = max(max(sz.hybrid_contexts) + 2, sz.long_prompt + sz.long_new_tokens)
    dirs = hybrid_models(cfg, sz, tmp, max_len)
    hybrids = [name for name in dirs if name.startswith("hybrid")]
    vocab = cfg.vocab_size

    print("hybrid: bytes per sequence on vLLM's pages", flush=True)
    memory = results["memory"] = {}
    for name in hybrids:
        hcfg = cfg.replace(attention_every=int(name.removeprefix("hybrid")))
        llm = make_llm(str(dirs[name]), max_model_len=max_len, max_num_seqs=4)
        block = llm.llm_engine.vllm_config.cache_config.block_size
        memory[name] = {"block_size": block, "layers": page_layout(llm), "contexts": []}
        for n in sz.hybrid_contexts:
            row = {"context": n, "measured": live_sequence_bytes(llm, vocab, n)}
            row["computed"] = computed_bytes(hcfg, block, n)
            row["laplace_state_bytes"] = cfg.page_bytes_per_sequence()
            row["llama_kv_bytes"] = llama_kv_bytes_per_token(cfg) * n
            memory[name]["contexts"].append(row)
            print(
                f"  {name}, {n} tokens: measured {row['measured']['bytes']:,} B, computed "
                f"{row['computed']['layout']:,} B (unpadded {row['computed']['unpadded']:,} B)",
                flush=True,
            )
        del llm
        gc.collect()

    seqs = default_max_num_seqs(dirs["laplace"], budget_bytes=sz.budget_bytes)
    budget = results["shared_budget"] = {
        "requests": sz.budget_requests,
        "prompt_len": sz.budget_prompt,
        "new_tokens": sz.budget_new_tokens,
        "budget_bytes": sz.budget_bytes,
        "max_num_seqs": seqs,
        "rounds": {name: [] for name in dirs},
    }
    names = list(dirs)
    for r in range(sz.hybrid_budget_rounds):
        for name in rotated(names, r):
            print(f"shared budget, round {r + 1}: {name}", flush=True)
            budget["rounds"][name].append(shared_budget_run(dirs[name], vocab, sz, seqs))
    budget["median_tokens_per_s"] = {
        name: statistics.median(run["tokens_per_s"] for run in runs)
        for name, runs in budget["rounds"].items()
    }

    print(f"hybrid: {sz.long_seqs} x {sz.long_prompt}-token prompts, engines alive together")
    engines = {
        name: make_llm(str(d), max_model_len=max_len, max_num_seqs=sz.long_seqs)
        for name, d in dirs.items()
    }
    results["throughput_p2048"] = {
        name: rows[0]
        for name, rows in interleaved_throughput(
            engines, vocab, (sz.long_seqs,), sz.long_prompt, sz.long_new_tokens, sz.rounds
        ).items()
    }
    del engines
    gc.collect()


def hybrid_headlines(results: dict, sz: Sizes) -> dict:
    """serve_hybrid.json's headline (plain numbers); every paired ratio with its spread goes to
    `results["ratios"]`: the shared budget's round by round (one run of each engine a round),
    the 2,048-token prompts' from their alternating rounds."""
    head: dict = {}
    ratios = results["ratios"] = {}
    rounds = results["shared_budget"]["rounds"]
    p2048 = results["throughput_p2048"]
    for name in rounds:
        if name == "llama":
            continue
        key = "" if name == "laplace" else f"_{name}"
        tps = {n: [run["tokens_per_s"] for run in rounds[n]] for n in (name, "llama")}
        ratios[f"over_llama_tokens_per_s_1280_requests{key}"] = paired(tps[name], tps["llama"])
        ratios[f"over_llama_tokens_per_s_p2048_s{sz.long_seqs}{key}"] = paired(
            p2048[name]["samples_tokens_per_s"], p2048["llama"]["samples_tokens_per_s"]
        )
    head.update({k: v["median"] for k, v in ratios.items()})
    for name, runs in rounds.items():
        head[f"{name}_seqs_at_once_1280"] = max(run["max_running"] for run in runs)
    for name, mem in results["memory"].items():
        for row in mem["contexts"]:
            n = row["context"]
            k = f"{name}_bytes_per_seq_{f'{n // 1024}k' if n % 1024 == 0 else n}"
            head[f"{k}_measured"] = row["measured"]["bytes"]
            head[f"{k}_computed"] = row["computed"]["layout"]
            head[f"{k}_unpadded"] = row["computed"]["unpadded"]
    return head
