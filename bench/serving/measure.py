"""The measurements of `bench.serve` on the engines they are given: batches stepped to the end;
throughput against concurrency, prefill rate and decode cost per output token, each over several
engines in alternating rounds; staggered arrivals, the state pages' bytes, a multi-turn
conversation's time to first token and greedy continuations, on one engine."""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time

import numpy as np

from bench.serving.instrument import MODEL_TIME, SchedulerTap
from bench.serving.sizes import Sizes

_REQUEST_IDS = itertools.count()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, length).tolist() for _ in range(n)]


def _greedy(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)


def run_batch(llm, prompts, new_tokens: int) -> dict:
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


def rotated(names: list[str], r: int) -> list[str]:
    """Round r's order: the engines rotated by r (each is first, second, ... in turn)."""
    k = r % len(names)
    return names[k:] + names[:k]


def interleaved_throughput(
    engines: dict, vocab, levels, prompt_len, new_tokens, rounds
) -> dict[str, list[dict]]:
    """Output tokens/s of `n` concurrent requests (prefill included) on every engine, measured
    in alternating rounds: in round r each engine runs the same prompts once, in an order
    rotated by r, so a drift of the machine's speed falls on every engine alike. Sample r of
    each engine is from round r (the paired ratios of bench/serving/headlines.py); the median
    of the samples is the figure, the best is kept beside it."""
    names = list(engines)
    for name in names:  # warm-up
        run_batch(engines[name], random_prompts(2, prompt_len, vocab, 0), 4)
    rows: dict[str, list[dict]] = {name: [] for name in names}
    for n in levels:
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for r in range(rounds):
            prompts = random_prompts(n, prompt_len, vocab, n + r)
            for name in rotated(names, r):
                runs[name].append(run_batch(engines[name], prompts, new_tokens))
        for name in names:
            tps = [run["tokens_per_s"] for run in runs[name]]
            best = max(runs[name], key=lambda run: run["tokens_per_s"])
            rows[name].append(
                {
                    "concurrency": n,
                    "prompt_len": prompt_len,
                    "new_tokens": new_tokens,
                    "output_tokens": best["output_tokens"],
                    "tokens_per_s": best["tokens_per_s"],
                    "median_tokens_per_s": statistics.median(tps),
                    "samples_tokens_per_s": tps,
                    "decode_tokens_per_s": statistics.median(
                        run["decode_tokens_per_s"] for run in runs[name]
                    ),
                    "max_running": best["max_running"],
                    "preempted": best["preempted"],
                }
            )
        shown = ", ".join(f"{k} {rows[k][-1]['median_tokens_per_s']:,.1f}" for k in names)
        print(f"  prompt {prompt_len:5d}, concurrency {n:3d}: {shown} output tokens/s", flush=True)
    return rows


def interleaved_prefill(engines: dict, vocab: int, n_seqs: int, prompt_len: int, rounds: int):
    """Prompt tokens/s of `n_seqs` prompts given at once with 1 new token each (the engine's
    prefill, chunked by its max_num_batched_tokens), every engine in alternating rounds on the
    same prompts (as `interleaved_throughput`). Returns {engine: row}."""
    names = list(engines)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up
        run_batch(engines[name], random_prompts(2, prompt_len, vocab, 0), 1)
    for r in range(rounds):
        prompts = random_prompts(n_seqs, prompt_len, vocab, 100 + r)
        for name in rotated(names, r):
            rates[name].append(
                n_seqs * prompt_len / run_batch(engines[name], prompts, 1)["seconds"]
            )
    shown = ", ".join(f"{k} {statistics.median(v):,.0f}" for k, v in rates.items())
    print(
        f"  prefill of {n_seqs} x {prompt_len}-token prompts: {shown} prompt tokens/s", flush=True
    )
    return {
        name: {
            "seqs": n_seqs,
            "prompt_len": prompt_len,
            "prompt_tokens_per_s": max(v),
            "median_prompt_tokens_per_s": statistics.median(v),
            "samples_prompt_tokens_per_s": v,
        }
        for name, v in rates.items()
    }


def decode_window(llm, vocab, prompt_len, n_seqs, new_tokens, seed: int):
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
    for rid, p in zip(ids, random_prompts(n_seqs, prompt_len, vocab, seed), strict=True):
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


def interleaved_cost(engines: dict, vocab, prompt_lens, n_seqs, new_tokens, rounds):
    """Decode cost per output token for each engine and prompt length, over `rounds` rounds;
    in each, every engine (order rotated by the round) times one window at every prompt length
    (2k, 8k). Window r of each row is from round r, so 8k over 2k is a paired ratio within an
    engine and a round (bench/serving/headlines.py). Returns {engine: rows}."""
    names = list(engines)
    samples = {name: {p: [] for p in prompt_lens} for name in names}
    model = {name: {p: [] for p in prompt_lens} for name in names}
    for r in range(rounds):
        for name in rotated(names, r):
            for p in prompt_lens:
                eng, mod = decode_window(engines[name], vocab, p, n_seqs, new_tokens, 1000 + r)
                samples[name][p].append(eng)
                model[name][p].append(mod)
    return {
        name: [
            {
                "prompt_len": p,
                "seqs": n_seqs,
                "decode_steps": new_tokens,
                "seconds_per_output_token": min(samples[name][p]),
                "median_seconds_per_output_token": statistics.median(samples[name][p]),
                "model_forward_seconds_per_output_token": min(model[name][p]),
                "window_samples": samples[name][p],
                "model_forward_samples": model[name][p],
            }
            for p in prompt_lens
        ]
        for name in names
    }


def staggered_vs_fixed(llm, vocab, n_requests, prompt_len, new_tokens, every_steps) -> dict:
    """One engine, the same requests: all at once, or one added every `every_steps` steps."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = random_prompts(n_requests, prompt_len, vocab, 77)
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
        print(
            f"  {mode:9s}: {out[mode]['tokens_per_s']:8.1f} tokens/s, {steps} steps, "
            f"mean latency {out[mode]['mean_latency_s']:.2f} s",
            flush=True,
        )
    out.update(
        requests=n_requests,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        arrival_every_steps=every_steps,
    )
    return out


def _paged_layers(worker):
    """Runs in the vLLM worker: (name, "state" | "kv", its page tensors) of every layer with
    pages: the state layers' (conv window, GLA matrices) and the attention layers' KV cache."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    for name, m in worker.model_runner.model.named_modules():
        if isinstance(m, MambaBase):
            yield name, "state", tuple(m.kv_cache)
        elif isinstance(m, Attention):
            yield name, "kv", (m.kv_cache,)  # [blocks, ...]


def _state_page_bytes(worker) -> dict:
    """Runs in the vLLM worker: bytes of one sequence's page in every state layer."""
    layers = [tensors for _, kind, tensors in _paged_layers(worker) if kind == "state"]
    per_seq = sum(sum(t[0].nbytes for t in tensors) for tensors in layers)
    slots = layers[0][0].shape[0] if layers else 0
    return {"layers": len(layers), "bytes_per_seq": per_seq, "slots": slots}


def measured_state_bytes(llm) -> dict:
    return llm.collective_rpc(_state_page_bytes)[0]


def _page_layout(worker) -> dict:
    """Runs in the vLLM worker: each state layer's slot and each attention layer's block, in
    bytes as laid out in vLLM's pages (the stride between slots / blocks: padding included)."""
    out = {}
    for name, kind, tensors in _paged_layers(worker):
        strides = {t.stride(0) * t.element_size() for t in tensors}
        assert len(strides) == 1, f"{name}: its page tensors' slots differ: {strides}"
        out[name] = {"kind": kind, "bytes": strides.pop()}
    return out


def _pool_bytes(worker) -> int:
    """Runs in the vLLM worker: the bytes of the distinct buffers behind every layer's pages
    (a hybrid's layers all view one buffer; vLLM's KV-cache config lists a tensor a layer)."""
    buffers = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for _, _, tensors in _paged_layers(worker)
        for t in tensors
    }
    return sum(buffers.values())


def pool_bytes(llm) -> int:
    return llm.collective_rpc(_pool_bytes)[0]


def page_layout(llm) -> dict:
    """{layer name: {"kind": "state" | "kv", "bytes": one slot's / block's bytes}}."""
    return llm.collective_rpc(_page_layout)[0]


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
        rows.append(
            {
                "turn": turn,
                "prompt_len": len(prompt),
                "cached_tokens": cached,
                "prefill_tokens": len(prompt) - cached,
                "ttft_s": ttft,
            }
        )
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
        print(
            f"  turn {row['turn']:2d}: prompt {row['prompt_len']:5d}, prefilled "
            f"{row['prefill_tokens']:5d}, first token after {1e3 * row['ttft_s']:7.1f} ms",
            flush=True,
        )
    return rows, [replies for _, replies in runs]


def greedy_tokens(llm, vocab: int, sz: Sizes) -> list[list[int]]:
    """`exact_prompts` greedy continuations of `exact_tokens` (prompts of 16 to 300 tokens),
    through the adapter's own `generate`."""
    from serve.vllm_adapter import generate

    rng = np.random.default_rng(7)
    prompts = [
        rng.integers(1, vocab, int(n)).tolist() for n in np.linspace(16, 300, sz.exact_prompts)
    ]
    return [o["token_ids"] for o in generate(llm, prompts, sz.exact_tokens, ignore_eos=True)]
