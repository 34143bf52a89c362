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

This file is the run, in order; the parts are `bench/serving/`:
    sizes.py       `Sizes` (every size of a run, one flag each), the full and quick runs
    models.py      the engine environment, the exported Laplace, the same-size Llama, budget engines
    instrument.py  the model's forward time, what vLLM's scheduler scheduled
    measure.py     the measurements, each on an engine it is given
    phases.py      one engine per phase, its figures into the result
    headlines.py   the headline ratios and the run's notes
    plot.py        the PNG beside the result
The result is written by `bench.common.write_result` (the machine and library versions with it).

JSON (bench/results/serve.json; serve_quick.json with --quick; --out PATH):
    quick                      true for --quick (then every figure is a quick figure)
    sizes                      every size used (`Sizes`); notes: caveats of this run, in words
    machine, preset, config    the machine and library versions (bench.common), the preset,
                               the exported config.json; torch_threads: torch's thread count
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

import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, write_result
from bench.serving.headlines import headlines, run_notes
from bench.serving.instrument import instrument_laplace
from bench.serving.models import (
    export_laplace,
    llama_kv_bytes_per_token,
    make_llama,
    set_engine_environment,
)
from bench.serving.phases import (
    phase,
    run_compiled,
    run_laplace,
    run_laplace_prefix,
    run_llama,
    run_shared_budget,
)
from bench.serving.plot import plot
from bench.serving.sizes import COST_PROMPTS, PRESET, parse_sizes
from laplace_spec.config import get_config


def main(argv=None) -> int:
    import torch

    args, sz = parse_sizes(argv)
    set_engine_environment()
    out = args.out or RESULTS / ("serve_quick.json" if args.quick else "serve.json")
    conversation = sz.turn_first + (sz.turns - 1) * (sz.turn_reply + sz.turn_message)
    max_len = max(
        max(COST_PROMPTS) + 128, sz.long_prompt + sz.long_new_tokens, conversation + sz.turn_reply
    )
    results: dict = {
        "quick": args.quick,
        "sizes": dataclasses.asdict(sz),
        "preset": PRESET,
        "torch_threads": torch.get_num_threads(),
    }
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    cfg = get_config(PRESET)
    lap_dir = export_laplace(cfg, tmp / "laplace", max_len)
    results["config"] = json.loads((lap_dir / "config.json").read_text())
    instrument_laplace()

    # the phases, one engine each (a failure after the first is recorded as NAME_error)
    replies = phase(results, "laplace", run_laplace, lap_dir, cfg, sz, max_len, results)
    phase(
        results, "laplace_prefix", run_laplace_prefix, lap_dir, cfg, sz, max_len, results, replies
    )
    llama_dir = None
    if not args.skip_llama:
        llama_dir = make_llama(tmp / "llama", cfg, max_len)
        phase(results, "llama", run_llama, llama_dir, cfg, sz, max_len, results)
    for who, model_dir in (("laplace", lap_dir), ("llama", llama_dir)):
        if model_dir is not None and sz.compile_levels:
            name = f"{who}_compiled"
            phase(results, name, run_compiled, model_dir, who, cfg, sz, max_len, results)
    phase(results, "shared_budget", run_shared_budget, lap_dir, llama_dir, cfg, sz, results)

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
    path = write_result("serve", results.pop("headline"), path=out, **results)
    result = json.loads(path.read_text())
    plot(result, path.with_suffix(".png"))
    summary = {"quick": args.quick, **result["headline"], **result["headline_extra"]}
    print(json.dumps(summary, indent=2))
    print(f"wrote {path} ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
