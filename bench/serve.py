"""Serving benchmark: Laplace (`small` preset, random weights) through vLLM on this CPU, side by
side with a vLLM-served Llama of the same width, depth, FFN width and vocabulary (random weights).

    python -m bench.serve            # full sizes -> bench/results/serve.json (+ serve.png)
    python -m bench.serve --quick    # smaller sizes, minutes -> bench/results/serve_quick.json
    python -m bench.serve --budget-requests 640 --turns 5 ...   # any size (see --help)

Measured in one run (absolute CPU numbers are not comparable to the write-up's; ratios are):
- output tokens/s vs concurrency (1, 8, 32, 64 sequences) at 64-token prompts (the original
  table) and at 128-token prompts, both engines (`over_llama_tokens_per_s_p128_s*`);
- output tokens/s of 64 sequences with 2,048-token prompts (`over_llama_tokens_per_s_p2048_s64`);
- 1,280 requests (1,024-token prompts, 128 new tokens each) given at once to an engine whose
  state pages (Laplace) or KV cache (Llama) hold exactly the same 1 GiB: end-to-end output
  tokens/s (`over_llama_tokens_per_s_1280_requests`), how many sequences each ran at once, each
  one's decode-phase rate (`shared_budget_run`);
- cost per output token at prompt 2,048 vs 8,192 tokens (the write-up: +0.5%), both engines;
- a 10-turn conversation, Laplace only (turn 1: a 256-token message; turn n+1 = turn n + its
  64-token greedy reply + a new 256-token message), time to first token per turn with vLLM's
  prefix caching (align mode) and without it (`prefix_cache_ttft_turn10_over_turn1`,
  `conversation_ttft`);
- state memory per sequence, measured on vLLM's state pages vs computed from the config; Llama's
  KV bytes per sequence;
- staggered arrivals (one request every few engine steps) vs one fixed batch (Laplace);
- vLLM's compile mode (the adapter's `--compile`), both engines: the 128-token-prompt table at
  1 and 64 sequences over eager, and whether its greedy tokens repeat the eager engine's.

The engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), one after another: no IPC in
the timings, the Laplace model's own forward time is measured beside the engine's step time, and
vLLM's scheduler is observed directly (`SchedulerTap`: what each engine step scheduled). On a
machine shared with other jobs, every figure keeps its N samples, its median and its best; the
headline ratios are of medians. Throughput is end to end (requests added at once, prefill included).

JSON (bench/results/serve.json; serve_quick.json with --quick; --out PATH):
    quick                      true for --quick (then every figure is a quick figure)
    sizes                      every size used (`Sizes`); notes: caveats of this run, in words
    machine, preset, config    the machine, the preset, the exported config.json
    headline                   docs/design.md s7 keys, plain numbers, from medians:
        cost_per_token_8k_over_2k, state_bytes_per_seq_measured, state_bytes_per_seq_computed,
        tokens_per_s_at_32 (64-token prompts), over_llama_tokens_per_s_p128_s{1,8,32,64},
        over_llama_tokens_per_s_p2048_s64, over_llama_tokens_per_s_1280_requests,
        prefix_cache_ttft_turn10_over_turn1 (turn `turns` over turn 1, with caching)
    headline_extra             more ratios (best-window cost, uncached TTFT growth, Llama's
                               concurrency and decode rates in the shared budget, ...)
    laplace_state              {layers, bytes_per_seq, slots} read from vLLM's state pages
    {laplace,llama}_throughput        rows at 64-token prompts
    {laplace,llama}_throughput_p128   rows at 128-token prompts
    {laplace,llama}_throughput_p2048  one row, `long_seqs` sequences
        row: {concurrency, prompt_len, new_tokens, output_tokens, tokens_per_s (best),
              median_tokens_per_s, samples_tokens_per_s, decode_tokens_per_s, max_running,
              preempted}
    {laplace,llama}_prefill    {seqs, prompt_len, prompt_tokens_per_s (best), samples_...}:
                               32 prompts of the shared budget's length, 1 new token each
    {laplace,llama}_cost       rows {prompt_len, seqs, decode_steps, seconds_per_output_token,
                               median_..., model_forward_..., window_samples, ...}
    staggered                  {fixed: {...}, staggered: {...}, requests, prompt_len, ...}
    {laplace,llama}_compiled_throughput_p128   rows at `compile_levels`, vLLM's compile mode
    {laplace,llama}_eager_greedy_tokens        greedy continuations (`greedy_tokens`) of the
                                               eager engine; _compiled_greedy_equal_eager:
                                               the share the compiled engine repeats exactly
    shared_budget              {requests, prompt_len, new_tokens, budget_bytes,
                                laplace: run, llama: run}; run: {seconds, output_tokens,
                                tokens_per_s, decode_steps, decode_seconds, decode_tokens_per_s,
                                steps, max_running, mean_running_decode, preempted,
                                engine: {max_num_seqs, kv_cache_memory_bytes, num_blocks,
                                block_size, allocated_bytes, vllm_max_concurrency}}
    prefix_cache               {turns, first_tokens, message_tokens, reply_tokens, repeats,
                                replies_equal, cached: turns, uncached: turns}; turn: {turn,
                                prompt_len, cached_tokens, prefill_tokens, ttft_s (best),
                                samples_ttft_s}
    memory_per_seq             rows {context, laplace_state_bytes, llama_kv_bytes_fp32}
    NAME_error                 where phase NAME failed (llama, laplace_prefix, shared_budget)
    seconds, phase_seconds     the whole run's wall time, each phase's
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from laplace_spec.config import BF16_BYTES, FP32_BYTES, LaplaceConfig, get_config

RESULTS = Path(__file__).resolve().parent / "results"
PRESET = "small"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(callable)
# Engine core and model in this process: no IPC in the timings, and the model's own forward
# time can be measured beside the engine's step time (see MODEL_TIME).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
MODEL_TIME = {"seconds": 0.0}
COST_PROMPTS = (2048, 8192)  # cost_per_token_8k_over_2k


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every size of a run; each is a flag (`--turn-reply 32`). Defaults: the full run."""

    levels: tuple[int, ...] = (1, 8, 32, 64)  # concurrent sequences, both throughput tables
    new_tokens: int = 64  # per request, 64-token-prompt table (tokens_per_s_at_32)
    p128_new_tokens: int = 128  # per request, 128-token-prompt table
    long_seqs: int = 64  # sequences with `long_prompt`-token prompts
    long_prompt: int = 2048
    long_new_tokens: int = 128
    repeats: int = 3  # best of, for every throughput figure
    cost_tokens: int = 24  # decode steps per timed window (cost per output token)
    cost_seqs: int = 4
    cost_repeats: int = 8
    budget_requests: int = 1280  # the shared state/KV budget run
    budget_prompt: int = 1024
    budget_new_tokens: int = 128
    budget_bytes: int = 2**30
    turns: int = 10  # the conversation
    turn_first: int = 256  # turn 1's prompt (the first message)
    turn_message: int = 256  # each later turn: + the reply + a new message of this many tokens
    turn_reply: int = 64
    turn_repeats: int = 3  # conversations (different tokens); best TTFT per turn
    compile_levels: tuple[int, ...] = (1, 64)  # vLLM compile mode, 128-token prompts
    exact_prompts: int = 8  # compile mode's greedy tokens vs eager's: prompts x exact_tokens
    exact_tokens: int = 32


FULL = Sizes()
QUICK = dataclasses.replace(
    FULL, new_tokens=16, p128_new_tokens=32, long_new_tokens=16, repeats=1, cost_tokens=8,
    cost_seqs=2, cost_repeats=1, budget_requests=128, budget_prompt=256, budget_new_tokens=32,
    budget_bytes=2**27, turn_first=128, turn_message=128, turn_reply=16, turn_repeats=2,
)  # fmt: skip


def instrument_laplace() -> None:
    """Accumulate the wall time of the Laplace vLLM model's forward + logits in MODEL_TIME."""
    from serve import vllm_model

    cls = vllm_model.LaplaceVLLMForCausalLM
    for name in ("forward", "compute_logits"):
        f = getattr(cls, name)

        def timed(*a, _f=f, **k):
            t0 = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                MODEL_TIME["seconds"] += time.perf_counter() - t0

        setattr(cls, name, timed)


# ---- the two models ---------------------------------------------------------------------------


def export_laplace(cfg: LaplaceConfig, out: Path, max_len: int) -> Path:
    """JAX initialisation, exported with the project's exporter."""
    import jax

    from export import exporter
    from laplace_jax.model import init_params

    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0)))
    return exporter.export_model(cfg, params, out, max_len=max_len)


def make_llama(out: Path, cfg: LaplaceConfig, max_len: int) -> Path:
    """A Llama with Laplace small's width, depth, FFN width and vocabulary; random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    lc = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        max_position_embeddings=max_len,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(lc).save_pretrained(out)
    return out


def make_budget_llm(model_dir: Path, max_len: int, max_num_seqs: int, budget_bytes: int):
    """An engine whose state pages / KV cache hold exactly `budget_bytes`.

    vLLM 0.32's CPU platform (platforms/cpu.py) lets VLLM_CPU_KVCACHE_SPACE, in whole GiB,
    override `kv_cache_memory_bytes` whenever the variable is set, and vLLM parses it as an int
    when it caches its environment (so it cannot be blanked): it is unset while the engine is
    built and restored afterwards. `make_llm` would set the adapter's default again, so the
    adapter's own pieces (plugin, `engine_kwargs`) are used directly."""
    from vllm import LLM

    from serve.vllm_adapter import engine_kwargs
    from serve.vllm_plugin import register

    register()
    kw = engine_kwargs(str(model_dir), max_model_len=max_len, max_num_seqs=max_num_seqs)
    saved = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    try:
        return LLM(**kw, kv_cache_memory_bytes=budget_bytes)
    finally:
        if saved is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved


# ---- measurements -----------------------------------------------------------------------------

_REQUEST_IDS = itertools.count()


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, length).tolist() for _ in range(n)]


def _greedy(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)


class SchedulerTap:
    """What vLLM's scheduler scheduled in the latest engine step (`last`, a SchedulerOutput),
    read by wrapping the in-process engine core's `scheduler.schedule`."""

    def __init__(self, llm):
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        schedule = scheduler.schedule
        self.last = None

        def tapped(*a, **k):
            self.last = schedule(*a, **k)
            return self.last

        scheduler.schedule = tapped

    @staticmethod
    def of(llm) -> SchedulerTap:
        if getattr(llm, "_bench_tap", None) is None:
            llm._bench_tap = SchedulerTap(llm)
        return llm._bench_tap


def _run_batch(llm, prompts, new_tokens: int) -> dict:
    """All `prompts` added at once (greedy, `new_tokens` each), the engine stepped until every
    request finished. End to end: wall seconds and output tokens. From the scheduler: the most
    sequences scheduled in one step (`max_running`), preemptions, and the decode phase: the
    steps in which every scheduled request got exactly one token (no prefill chunk), their
    output tokens over their wall time (`decode_tokens_per_s`; mixed steps are not split)."""
    engine, tap, sp = llm.llm_engine, SchedulerTap.of(llm), _greedy(new_tokens)
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(f"b{next(_REQUEST_IDS)}", {"prompt_token_ids": p}, sp)
    out_tokens = steps = preempted = 0
    decode = {"steps": 0, "seconds": 0.0, "tokens": 0}
    running: list[int] = []
    while engine.has_unfinished_requests():
        tap.last = None
        s0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - s0
        out_tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
        so = tap.last
        if so is None or not so.total_num_scheduled_tokens:
            continue
        n = len(so.num_scheduled_tokens)
        steps += 1
        running.append(n)
        preempted += len(so.preempted_req_ids or ())
        if so.total_num_scheduled_tokens == n:
            decode["steps"] += 1
            decode["seconds"] += dt
            decode["tokens"] += n
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "output_tokens": out_tokens,
        "tokens_per_s": out_tokens / seconds,
        "steps": steps,
        "decode_steps": decode["steps"],
        "decode_seconds": decode["seconds"],
        "decode_tokens_per_s": decode["tokens"] / decode["seconds"] if decode["seconds"] else 0.0,
        "max_running": max(running, default=0),
        "mean_running_decode": decode["tokens"] / decode["steps"] if decode["steps"] else 0.0,
        "preempted": preempted,
    }


def throughput_vs_concurrency(llm, vocab, levels, prompt_len, new_tokens, repeats) -> list[dict]:
    """Output tokens/s of `n` concurrent requests (prefill included); best of `repeats`
    (other jobs on a shared machine only ever slow a run down), the median is kept too."""
    rows = []
    _run_batch(llm, _prompts(2, prompt_len, vocab, 0), 4)  # warm-up
    for n in levels:
        runs = [_run_batch(llm, _prompts(n, prompt_len, vocab, n + r), new_tokens)
                for r in range(repeats)]  # fmt: skip
        tps = [r["tokens_per_s"] for r in runs]
        best = max(runs, key=lambda r: r["tokens_per_s"])
        rows.append(
            {
                "concurrency": n,
                "prompt_len": prompt_len,
                "new_tokens": new_tokens,
                "output_tokens": best["output_tokens"],
                "tokens_per_s": best["tokens_per_s"],
                "median_tokens_per_s": statistics.median(tps),
                "samples_tokens_per_s": tps,
                "decode_tokens_per_s": max(r["decode_tokens_per_s"] for r in runs),
                "max_running": best["max_running"],
                "preempted": best["preempted"],
            }
        )
        print(f"  prompt {prompt_len:5d}, concurrency {n:3d}: {max(tps):9.1f} output tokens/s",
              flush=True)  # fmt: skip
    return rows


def prefill_rate(llm, vocab: int, n_seqs: int, prompt_len: int, repeats: int) -> dict:
    """Prompt tokens/s of `n_seqs` prompts given at once with 1 new token each (the engine's
    prefill, chunked by its max_num_batched_tokens); best of `repeats`."""
    runs = [_run_batch(llm, _prompts(n_seqs, prompt_len, vocab, 100 + r), 1)
            for r in range(repeats)]  # fmt: skip
    rates = [n_seqs * prompt_len / run["seconds"] for run in runs]
    print(f"  prefill of {n_seqs} x {prompt_len}-token prompts: {max(rates):9.0f} prompt tokens/s",
          flush=True)  # fmt: skip
    return {"seqs": n_seqs, "prompt_len": prompt_len, "prompt_tokens_per_s": max(rates),
            "samples_prompt_tokens_per_s": rates}  # fmt: skip


def _decode_cost_once(llm, vocab, prompt_len, n_seqs, new_tokens, seed: int):
    """Seconds per output token over a window of pure decode steps at context `prompt_len`.

    Requests go in through the engine's step API. vLLM prefills long prompts in chunks, one
    sequence after another, so sequences start decoding at different steps: nothing is timed
    until every sequence has its first token, and no sequence may finish inside the timed
    window (max_tokens has a wide margin; the rest is aborted). The window is timed as a whole
    (single steps are not: the engine pipelines its steps). Returns (engine seconds, model
    forward seconds) per output token; the latter is 0 where the model is not instrumented.
    """
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(
        max_tokens=new_tokens + 256, temperature=0.0, ignore_eos=True, detokenize=False
    )
    ids = [f"cost-{seed}-{prompt_len}-{i}" for i in range(n_seqs)]
    for rid, p in zip(ids, _prompts(n_seqs, prompt_len, vocab, seed), strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    started: set[str] = set()
    while len(started) < n_seqs:  # prefill (all chunks) until every sequence has a token
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    produced = 0
    m0 = MODEL_TIME["seconds"]
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        produced += len(engine.step())  # one output per running sequence and step
    dt = time.perf_counter() - t0
    model = MODEL_TIME["seconds"] - m0
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return dt / produced, model / produced


def cost_per_output_token(llm, vocab, prompt_lens, n_seqs, new_tokens, repeats) -> list[dict]:
    """Decode cost per output token for each prompt length, over `repeats` windows measured
    interleaved (2k, 8k, 2k, 8k, ...). The figure is the best window: on a machine shared with
    other jobs, their load only ever adds time; the median is kept too."""
    samples: dict[int, list[float]] = {p: [] for p in prompt_lens}
    model: dict[int, list[float]] = {p: [] for p in prompt_lens}
    for r in range(repeats):
        for p in prompt_lens:
            eng, mod = _decode_cost_once(llm, vocab, p, n_seqs, new_tokens, 1000 + r)
            samples[p].append(eng)
            model[p].append(mod)
    return [
        {
            "prompt_len": p,
            "seqs": n_seqs,
            "decode_steps": new_tokens,
            "seconds_per_output_token": min(samples[p]),
            "median_seconds_per_output_token": statistics.median(samples[p]),
            "model_forward_seconds_per_output_token": min(model[p]),
            "window_samples": samples[p],
            "model_forward_samples": model[p],
        }
        for p in prompt_lens
    ]


def staggered_vs_fixed(llm, vocab, n_requests, prompt_len, new_tokens, every_steps) -> dict:
    """One engine, the same requests: all at once, or one added every `every_steps` steps."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = _prompts(n_requests, prompt_len, vocab, 77)
    out = {}
    for mode in ("fixed", "staggered"):
        pending = list(enumerate(prompts))
        done, steps, first_token = 0, 0, {}
        t0 = time.perf_counter()
        arrival = {}
        if mode == "fixed":
            for i, p in pending:
                engine.add_request(f"{mode}-{i}", {"prompt_token_ids": p}, sp)
                arrival[f"{mode}-{i}"] = t0
            pending = []
        latencies = []
        while pending or engine.has_unfinished_requests():
            if pending and steps % every_steps == 0:
                i, p = pending.pop(0)
                engine.add_request(f"{mode}-{i}", {"prompt_token_ids": p}, sp)
                arrival[f"{mode}-{i}"] = time.perf_counter()
            for o in engine.step():
                if o.request_id not in first_token and o.outputs[0].token_ids:
                    first_token[o.request_id] = time.perf_counter() - arrival[o.request_id]
                if o.finished:
                    done += 1
                    latencies.append(time.perf_counter() - arrival[o.request_id])
            steps += 1
        dt = time.perf_counter() - t0
        out[mode] = {
            "seconds": dt,
            "engine_steps": steps,
            "tokens_per_s": n_requests * new_tokens / dt,
            "mean_latency_s": statistics.mean(latencies),
            "mean_time_to_first_token_s": statistics.mean(first_token.values()),
        }
        print(f"  {mode:9s}: {out[mode]['tokens_per_s']:8.1f} tokens/s, {steps} steps, "
              f"mean latency {out[mode]['mean_latency_s']:.2f} s", flush=True)  # fmt: skip
    out.update(requests=n_requests, prompt_len=prompt_len, new_tokens=new_tokens,
               arrival_every_steps=every_steps)  # fmt: skip
    return out


def _state_page_bytes(worker) -> dict:
    """Runs in the vLLM worker: bytes of one sequence's page in every state layer."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    model = worker.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, MambaBase)]
    per_seq = sum(sum(t[0].nbytes for t in m.kv_cache) for m in layers)
    slots = layers[0].kv_cache[0].shape[0] if layers else 0
    return {"layers": len(layers), "bytes_per_seq": per_seq, "slots": slots}


def measured_state_bytes(llm) -> dict:
    return llm.collective_rpc(_state_page_bytes)[0]


def llama_kv_bytes_per_token(cfg: LaplaceConfig) -> int:
    """fp32 K and V, every layer (the served Llama's dtype): twice laplace_spec's bf16 count."""
    return cfg.kv_cache_bytes(1) * FP32_BYTES // BF16_BYTES


def _conversation(llm, vocab, sz: Sizes, seed: int) -> tuple[list[dict], list[list[int]]]:
    """One conversation of `sz.turns` turns, one request at a time. Turn 1's prompt is
    `turn_first` random tokens; turn n+1's = turn n's prompt + its greedy reply (`turn_reply`
    tokens) + a new message (`turn_message` random tokens). Time to first token: from adding
    the request to the engine step that returns its first token. Cached tokens: vLLM's
    `num_cached_tokens` (0 without prefix caching)."""
    engine, sp = llm.llm_engine, _greedy(sz.turn_reply)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, vocab, sz.turn_first).tolist()
    rows, replies = [], []
    for turn in range(1, sz.turns + 1):
        t0 = time.perf_counter()
        engine.add_request(f"c{next(_REQUEST_IDS)}", {"prompt_token_ids": prompt}, sp)
        ttft, reply, cached = None, [], 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                if ttft is None and o.outputs[0].token_ids:
                    ttft = time.perf_counter() - t0
                if o.finished:
                    reply, cached = list(o.outputs[0].token_ids), o.num_cached_tokens or 0
        rows.append({"turn": turn, "prompt_len": len(prompt), "cached_tokens": cached,
                     "prefill_tokens": len(prompt) - cached, "ttft_s": ttft})  # fmt: skip
        replies.append(reply)
        prompt = prompt + reply + rng.integers(1, vocab, sz.turn_message).tolist()
    return rows, replies


def conversation_ttft(llm, vocab, sz: Sizes) -> tuple[list[dict], list[list[list[int]]]]:
    """Time to first token per turn of `turn_repeats` conversations (different tokens, so one
    never hits another's cache), after a 2-turn warm-up conversation: per turn the best of the
    repeats, samples kept. Returns the rows and every conversation's replies."""
    _conversation(llm, vocab, dataclasses.replace(sz, turns=2), seed=499)  # warm-up
    runs = [_conversation(llm, vocab, sz, seed=500 + r) for r in range(sz.turn_repeats)]
    rows = []
    for i, row in enumerate(runs[0][0]):
        samples = [rs[i]["ttft_s"] for rs, _ in runs]
        rows.append({**row, "ttft_s": min(samples), "samples_ttft_s": samples})
    for row in rows:
        print(f"  turn {row['turn']:2d}: prompt {row['prompt_len']:5d}, prefilled "
              f"{row['prefill_tokens']:5d}, first token after {1e3 * row['ttft_s']:7.1f} ms",
              flush=True)  # fmt: skip
    return rows, [replies for _, replies in runs]


def shared_budget_run(model_dir: Path, vocab: int, sz: Sizes, max_num_seqs: int) -> dict:
    """`budget_requests` requests (`budget_prompt` tokens, `budget_new_tokens` new each) given at
    once to an engine whose state pages / KV cache hold exactly `budget_bytes`
    (`kv_cache_memory_bytes`); `max_num_seqs` is the same for both models (the Laplace adapter's
    default for that budget), so only the cache limits how many run at once. Returns
    `_run_batch`'s figures and the engine's pages: blocks, block size, bytes allocated and vLLM's
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
    _run_batch(llm, _prompts(2, 16, vocab, 0), 4)  # warm-up
    prompts = _prompts(sz.budget_requests, sz.budget_prompt, vocab, 1280)
    run = _run_batch(llm, prompts, sz.budget_new_tokens)
    del llm  # its pages go with the engine core
    gc.collect()
    print(f"  {sz.budget_requests} requests: {run['tokens_per_s']:9.1f} output tokens/s end to "
          f"end, decode phase {run['decode_tokens_per_s']:9.1f}, at most {run['max_running']} "
          f"sequences at once ({engine['num_blocks']} blocks of {engine['block_size']}, "
          f"{engine['allocated_bytes']:,} B)", flush=True)  # fmt: skip
    return {**run, "engine": engine}


# ---- run ----------------------------------------------------------------------------------


def machine_info() -> dict:
    import torch
    import vllm

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "devices": 1, "torch": torch.__version__,
            "vllm": vllm.__version__, "python": platform.python_version(),
            "torch_threads": torch.get_num_threads()}  # fmt: skip


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
    print(f"  state per sequence: measured {measured['bytes_per_seq']:,} B on vLLM's pages, "
          f"computed {cfg.state_bytes_per_sequence()['total']:,} B", flush=True)  # fmt: skip
    throughput_tables(llm, cfg.vocab_size, sz, "laplace", results)
    results["laplace_cost"] = cost_per_output_token(
        llm, cfg.vocab_size, COST_PROMPTS, sz.cost_seqs, sz.cost_tokens, sz.cost_repeats
    )
    for c in results["laplace_cost"]:
        print(f"  prompt {c['prompt_len']}: {1e3 * c['seconds_per_output_token']:.3f} ms per "
              f"output token ({1e3 * c['model_forward_seconds_per_output_token']:.3f} ms in "
              "the model's forward)", flush=True)  # fmt: skip
    results["staggered"] = staggered_vs_fixed(llm, cfg.vocab_size, 32, 64, sz.new_tokens, 2)
    results["laplace_eager_greedy_tokens"] = greedy_tokens(llm, cfg.vocab_size, sz)
    print("  conversation without prefix caching", flush=True)
    rows, replies = conversation_ttft(llm, cfg.vocab_size, sz)
    results["prefix_cache"] = {"turns": sz.turns, "first_tokens": sz.turn_first,
                               "message_tokens": sz.turn_message, "reply_tokens": sz.turn_reply,
                               "repeats": sz.turn_repeats, "uncached": rows}  # fmt: skip
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
        print(f"  prompt {c['prompt_len']}: {1e3 * c['seconds_per_output_token']:.3f} ms"
              " per output token", flush=True)  # fmt: skip
    results["llama_eager_greedy_tokens"] = greedy_tokens(lm, cfg.vocab_size, sz)
    del lm  # its pages go with the engine core
    gc.collect()


def run_shared_budget(lap_dir, llama_dir, cfg: LaplaceConfig, sz: Sizes, results: dict) -> None:
    """Both models, one after the other, in the same state/KV budget."""
    from serve.vllm_adapter import default_max_num_seqs

    seqs = default_max_num_seqs(lap_dir, budget_bytes=sz.budget_bytes)
    sb = results["shared_budget"] = {"requests": sz.budget_requests, "prompt_len": sz.budget_prompt,
                                     "new_tokens": sz.budget_new_tokens,
                                     "budget_bytes": sz.budget_bytes}  # fmt: skip
    print(f"Shared budget of {sz.budget_bytes:,} B: Laplace", flush=True)
    sb["laplace"] = shared_budget_run(lap_dir, cfg.vocab_size, sz, seqs)
    if llama_dir is not None:
        print(f"Shared budget of {sz.budget_bytes:,} B: Llama", flush=True)
        sb["llama"] = shared_budget_run(llama_dir, cfg.vocab_size, sz, seqs)


def greedy_tokens(llm, vocab: int, sz: Sizes) -> list[list[int]]:
    """`exact_prompts` greedy continuations of `exact_tokens` (prompts of 16 to 300 tokens),
    through the adapter's own `generate`."""
    from serve.vllm_adapter import generate

    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, vocab, int(n)).tolist()
               for n in np.linspace(16, 300, sz.exact_prompts)]  # fmt: skip
    return [o["token_ids"] for o in generate(llm, prompts, sz.exact_tokens)]


def run_compiled(model_dir: Path, who: str, cfg: LaplaceConfig, sz: Sizes, max_len: int,
                 results: dict) -> None:  # fmt: skip
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
        changed = {f.name: getattr(sz, f.name) for f in dataclasses.fields(Sizes)
                   if getattr(sz, f.name) != getattr(FULL, f.name)}  # fmt: skip
        notes.append(
            ("QUICK RUN: " if quick else "")
            + f"sizes differ from the full run's {changed}. The headline keys keep the names "
            "of docs/design.md s7, which describe the full sizes (s64, 1280_requests, turn10): "
            "these figures were measured at the sizes above and are not the full run's."
        )
    for who in ("laplace", "llama"):
        rows = results.get(f"{who}_throughput_p2048", [])
        if rows and rows[0]["max_running"] < sz.long_seqs:
            notes.append(f"{who}: at most {rows[0]['max_running']} of the {sz.long_seqs} "
                         f"{sz.long_prompt}-token sequences were scheduled in one step (the "
                         "first finish before the last are prefilled, max_num_batched_tokens a "
                         "step, or the cache was full: see preempted)")  # fmt: skip
    if results.get("prefix_cache", {}).get("replies_equal") is False:
        notes.append("prefix_cache: the greedy replies differ with and without caching")
    return notes


def _show(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, tuple) else str(v)


def parse_sizes(argv=None) -> tuple[argparse.Namespace, Sizes]:
    ap = argparse.ArgumentParser(
        prog="python -m bench.serve",
        description="Serving benchmark: Laplace vs a same-size Llama, through vLLM on this CPU.",
        epilog="Sizes: the `Sizes` class in bench/serve.py says what each one is.",
    )
    ap.add_argument("--quick", action="store_true",
                    help="smaller sizes, a few minutes (written to serve_quick.json)")  # fmt: skip
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="result JSON (a PNG beside it)")
    for f in dataclasses.fields(Sizes):
        is_tuple = isinstance(f.default, tuple)
        ap.add_argument(
            "--" + f.name.replace("_", "-"),
            type=(lambda s: tuple(int(v) for v in s.split(","))) if is_tuple else int,
            default=None,
            help=f"default {_show(f.default)} (quick {_show(getattr(QUICK, f.name))})",
        )
    args = ap.parse_args(argv)
    base = QUICK if args.quick else FULL
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Sizes)}
    return args, dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})


def _phase(results: dict, name: str, fn, *args):
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


def main(argv=None) -> int:
    args, sz = parse_sizes(argv)
    out = args.out or RESULTS / ("serve_quick.json" if args.quick else "serve.json")
    conversation = sz.turn_first + (sz.turns - 1) * (sz.turn_reply + sz.turn_message)
    max_len = max(max(COST_PROMPTS) + 128, sz.long_prompt + sz.long_new_tokens,
                  conversation + sz.turn_reply)  # fmt: skip

    results: dict = {"quick": args.quick, "sizes": dataclasses.asdict(sz),
                     "machine": machine_info(), "preset": PRESET}  # fmt: skip
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    cfg = get_config(PRESET)
    lap_dir = export_laplace(cfg, tmp / "laplace", max_len)
    results["config"] = json.loads((lap_dir / "config.json").read_text())
    instrument_laplace()

    replies = _phase(results, "laplace", run_laplace, lap_dir, cfg, sz, max_len, results)
    _phase(results, "laplace_prefix", run_laplace_prefix, lap_dir, cfg, sz, max_len, results,
           replies)  # fmt: skip
    llama_dir = None
    if not args.skip_llama:
        llama_dir = make_llama(tmp / "llama", cfg, max_len)
        _phase(results, "llama", run_llama, llama_dir, cfg, sz, max_len, results)
    for who, model_dir in (("laplace", lap_dir), ("llama", llama_dir)):
        if model_dir is not None and sz.compile_levels:
            _phase(results, f"{who}_compiled", run_compiled, model_dir, who, cfg, sz, max_len,
                   results)  # fmt: skip
    _phase(results, "shared_budget", run_shared_budget, lap_dir, llama_dir, cfg, sz, results)

    kv_tok = llama_kv_bytes_per_token(cfg)
    computed = cfg.state_bytes_per_sequence()["total"]
    results["memory_per_seq"] = [
        {"context": n, "laplace_state_bytes": computed, "llama_kv_bytes_fp32": kv_tok * n}
        for n in (512, 2048, 8192, 32768)
    ]
    headlines(results, cfg, sz)
    results["notes"] = run_notes(results, sz, args.quick)
    shutil.rmtree(tmp, ignore_errors=True)  # the two exported models
    results["seconds"] = time.perf_counter() - t_start
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    print(json.dumps({"quick": args.quick, **results["headline"],
                      **results["headline_extra"]}, indent=2))  # fmt: skip
    print(f"wrote {out} ({results['seconds']:.0f} s)")
    return 0


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    quick = " [QUICK]" if results.get("quick") else ""
    ax = axes[0]
    for key, label in (("laplace_throughput_p128", "Laplace"), ("llama_throughput_p128", "Llama")):
        if key in results:
            rows = results[key]
            ax.plot([r["concurrency"] for r in rows], [r["tokens_per_s"] for r in rows], "o-",
                    label=label)  # fmt: skip
    ax.set(xscale="log", xlabel="concurrent sequences", ylabel="output tokens/s",
           title="Output tokens/s, 128-token prompts" + quick)  # fmt: skip
    ax.legend()
    ax = axes[1]
    for key, label in (("laplace_cost", "Laplace"), ("llama_cost", "Llama")):
        if key in results:
            rows = results[key]
            ms = [1e3 * r["seconds_per_output_token"] for r in rows]
            ax.plot([r["prompt_len"] for r in rows], ms, "o-", label=label)
    ax.set(xlabel="prompt tokens", ylabel="ms per output token",
           title="Cost per output token vs prompt length" + quick)  # fmt: skip
    ax.legend()
    ax = axes[2]
    rows = results["memory_per_seq"]
    ax.plot([r["context"] for r in rows], [r["laplace_state_bytes"] / 1e6 for r in rows], "o-",
            label="Laplace state (fixed)")  # fmt: skip
    ax.plot([r["context"] for r in rows], [r["llama_kv_bytes_fp32"] / 1e6 for r in rows], "o-",
            label="Llama KV cache (fp32)")  # fmt: skip
    ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="MB per sequence",
           title="Memory per sequence")  # fmt: skip
    ax.legend()
    ax = axes[3]
    ratios = {k.removeprefix("over_llama_tokens_per_s_"): v
              for k, v in results["headline"].items() if k.startswith("over_llama")}  # fmt: skip
    ax.bar(list(ratios), list(ratios.values()))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(ylabel="Laplace / Llama output tokens/s", title="Laplace over Llama" + quick)
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
