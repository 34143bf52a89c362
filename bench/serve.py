"""Serving benchmark: Laplace (`small` preset, random weights) through vLLM on this CPU, side by
side with a vLLM-served Llama of the same width, depth, FFN width and vocabulary (random weights).

    python -m bench.serve            # full sizes -> bench/results/serve.json (+ serve.png)
    python -m bench.serve --quick    # smaller sizes, minutes -> bench/results/serve_quick.json
    python -m bench.serve --budget-requests 640 --turns 5 ...   # any size (see --help)
    python -m bench.serve --profile  # the decode-step profile -> bench/results/serve_profile.json
    python -m bench.serve --hybrid   # the hybrid rows -> bench/results/serve_hybrid.json
    python -m bench.serve --agent-resume  # the state store -> bench/results/agent_resume.json

Measured in one run (absolute CPU numbers are not comparable to the write-up's; ratios are):
- output tokens/s vs concurrency (1, 8, 32, 64 sequences) at 64-token prompts (the original
  table) and at 128-token prompts (`over_llama_tokens_per_s_p128_s*`), the latter eager and in
  vLLM's compile mode (the adapter's `--compile`: `compiled_over_eager_laplace_s*`,
  `over_llama_tokens_per_s_p128_s*_compiled`);
- output tokens/s of 64 sequences with 2,048-token prompts (`over_llama_tokens_per_s_p2048_s64`);
- the agent row: 1 and 8 sequences with an 8,192-token history (prompt) and 128 new tokens, eager
  and compiled (`over_llama_tokens_per_s_agent8k_s{1,8}[_compiled]`): the fixed state's case at
  low concurrency;
- prefill: prompt tokens/s of 32 prompts of 1,024 tokens, eager and compiled
  (`over_llama_prefill_tokens_per_s`);
- cost per output token at prompt 2,048 vs 8,192 tokens (the write-up: +0.5%), both models;
- greedy continuations of the compiled engines against the eager engines';
- staggered arrivals (one request every few engine steps) vs one fixed batch (Laplace);
- a 10-turn conversation, Laplace only (turn 1: a 256-token message; turn n+1 = turn n + its
  64-token greedy reply + a new 256-token message), time to first token per turn with vLLM's
  prefix caching (align mode) and without it (`prefix_cache_ttft_turn10_over_turn1`);
- 1,280 requests (1,024-token prompts, 128 new tokens each) given at once to an engine whose
  state pages (Laplace) or KV cache (Llama) hold exactly the same 1 GiB: end-to-end output
  tokens/s (`over_llama_tokens_per_s_1280_requests`), how many sequences each ran at once, each
  one's decode-phase rate (`shared_budget_run`);
- the mid-size row: a Laplace of about 300M parameters against a Llama of its width, depth and
  FFN width, 64 sequences of 1,024-token prompts and 128 new tokens, each engine's pages / KV
  cache 4 GiB (`over_llama_tokens_per_s_mid_s64`);
- the seed row: vLLM's compile mode over eager at the mid-size width, where the layers are most
  of a step, 1 and 8 sequences of 128-token prompts, both models
  (`compiled_over_eager_mid_s{1,8}_{laplace,llama}`), four engines alive together;
- state memory per sequence, measured on vLLM's state pages vs computed from the config; Llama's
  KV bytes per sequence.

Every figure that compares engines is measured on engines alive together, in alternating rounds:
in round r each engine runs the same prompts once, in an order rotated by r, so the machine's
drift falls on all of them alike. A ratio is taken round by round; the headline is the median
of its rounds, and `ratios` keeps the minimum, the maximum and every round. The engines run in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): no IPC in the timings, the Laplace model's own
forward time is measured beside the engine's step time, and vLLM's scheduler is observed directly
(`SchedulerTap`: what each engine step scheduled). Throughput is end to end (requests added at
once, prefill included).

This file is the run, in order; the parts are `bench/serving/`:
    sizes.py       `Sizes` (every size of a run, one flag each), the full and quick runs
    models.py      the engine environment, the exported Laplace, the same-size Llama, budget engines
    instrument.py  the model's forward time, what vLLM's scheduler scheduled
    measure.py     the measurements: alternating rounds over several engines, or one engine
    phases.py      the side-by-side engines, prefix caching, the shared budget, the mid-size row
    headlines.py   the paired ratios, the headlines and the run's notes
    profile.py     `--profile`: decode step time against the layer count, a layer's GEMMs alone
    hybrid.py      `--hybrid`: the hybrids beside Laplace and Llama (bytes per sequence, the
                   shared budget, 2,048-token prompts)
    agent_resume.py `--agent-resume`: a conversation resumed after a restart from the state
                   store (`--state-dir`) against a cold re-prefill, pure Laplace and the 3:1
                   hybrid; bytes on disk; a shared system prompt's blocks; replicas
    plot.py        the PNG beside the result
The result is written by `bench.common.write_result` (the machine and library versions with it).

JSON (bench/results/serve.json; serve_quick.json with --quick; --out PATH):
    quick                      true for --quick (then every figure is a quick figure)
    sizes                      every size used (`Sizes`); notes: caveats of this run, in words
    machine, preset, config    the machine and library versions (bench.common), the preset,
                               the exported config.json; torch_threads: torch's thread count
    headline                   docs/design.md s7 keys, plain numbers, medians of paired rounds:
        cost_per_token_8k_over_2k, state_bytes_per_seq_measured, state_bytes_per_seq_computed,
        tokens_per_s_at_32 (64-token prompts), over_llama_tokens_per_s_p128_s{1,8,32,64} and
        the same with _compiled (both engines compiled), over_llama_tokens_per_s_agent8k_s{1,8}
        and _compiled, compiled_over_eager_mid_s{1,8}_{laplace,llama},
        over_llama_tokens_per_s_p2048_s64, over_llama_tokens_per_s_1280_requests,
        prefix_cache_ttft_turn10_over_turn1 (turn `turns` over turn 1, with caching),
        compiled_over_eager_laplace_s{1,8}, over_llama_prefill_tokens_per_s,
        over_llama_tokens_per_s_mid_s64
    headline_extra             more ratios (compiled Laplace over compiled Llama, compiled over
                               eager at 32 and 64 and for Llama, Llama's concurrency and decode
                               rates in the shared budget, uncached TTFT growth, ...)
    ratios                     every paired ratio: {median, min, max, samples (round by round)}
    laplace_state              {layers, bytes_per_seq, slots} read from vLLM's state pages
    ENGINE_throughput          rows at 64-token prompts (ENGINE: laplace, llama)
    ENGINE_throughput_p128     rows at 128-token prompts (ENGINE: also laplace_compiled,
                               llama_compiled)
    ENGINE_throughput_p2048    one row, `long_seqs` sequences
    ENGINE_throughput_agent    rows at `agent_levels` sequences of `agent_prompt` tokens (ENGINE:
                               every engine, both modes)
        row: {concurrency, prompt_len, new_tokens, output_tokens, median_tokens_per_s,
              samples_tokens_per_s (round by round), tokens_per_s (the best round),
              decode_tokens_per_s, max_running, preempted}
    ENGINE_prefill             {seqs, prompt_len, median_prompt_tokens_per_s,
                               samples_prompt_tokens_per_s, prompt_tokens_per_s (best)}: 32
                               prompts of the shared budget's length, 1 new token each
    {laplace,llama}_cost       rows {prompt_len, seqs, decode_steps, window_samples (round by
                               round), median_seconds_per_output_token, model_forward_..., ...}
    ENGINE_greedy_tokens       greedy continuations (`greedy_tokens`) of every engine;
                               {laplace,llama}_compiled_greedy_equal_eager: the share equal
    staggered                  {fixed: {...}, staggered: {...}, requests, prompt_len, ...}
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
    mid                        {shape, parameters: {laplace, llama}, budget_bytes, laplace: row,
                                llama: row}
    seed                       {shape, budget_bytes, ENGINE: rows} at `seed_levels` (ENGINE:
                               laplace, llama, and each _compiled; the mid-size models)
    memory_per_seq             rows {context, laplace_state_bytes, llama_kv_bytes_fp32}
    NAME_error                 where phase NAME failed (laplace_prefix, shared_budget, mid)
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
from bench.serving.agent_resume import run_agent_resume
from bench.serving.headlines import headlines, run_notes
from bench.serving.hybrid import hybrid_headlines, run_hybrid
from bench.serving.instrument import instrument_laplace
from bench.serving.models import (
    export_laplace,
    llama_kv_bytes_per_token,
    make_llama,
    set_engine_environment,
)
from bench.serving.phases import (
    phase,
    run_laplace_prefix,
    run_mid,
    run_seed,
    run_shared_budget,
    run_side_by_side,
)
from bench.serving.plot import plot
from bench.serving.profile import run_profile
from bench.serving.sizes import COST_PROMPTS, PRESET, parse_sizes
from laplace_spec.config import get_config


def main(argv=None) -> int:
    import torch

    args, sz = parse_sizes(argv)
    set_engine_environment()
    if args.profile:
        return profile_main(args, sz)
    if args.hybrid:
        return hybrid_main(args, sz)
    if args.agent_resume:
        return agent_resume_main(args, sz)
    out = args.out or RESULTS / ("serve_quick.json" if args.quick else "serve.json")
    conversation = sz.turn_first + (sz.turns - 1) * (sz.turn_reply + sz.turn_message)
    max_len = max(
        max(COST_PROMPTS) + 128,
        sz.long_prompt + sz.long_new_tokens,
        sz.agent_prompt + sz.agent_new_tokens,
        conversation + sz.turn_reply,
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

    # the phases: the side-by-side engines, then one engine at a time (a failure after the
    # first is recorded as NAME_error)
    llama_dir = None if args.skip_llama else make_llama(tmp / "llama", cfg, max_len)
    replies = phase(
        results, "side_by_side", run_side_by_side, lap_dir, llama_dir, cfg, sz, max_len, results
    )
    phase(
        results, "laplace_prefix", run_laplace_prefix, lap_dir, cfg, sz, max_len, results, replies
    )
    phase(results, "shared_budget", run_shared_budget, lap_dir, llama_dir, cfg, sz, results)
    if sz.mid_seqs and llama_dir is not None:
        phase(results, "mid", run_mid, cfg, sz, tmp, results)
    if sz.seed_levels and llama_dir is not None:
        phase(results, "seed", run_seed, cfg, sz, tmp, results)

    kv_tok = llama_kv_bytes_per_token(cfg)
    computed = cfg.page_bytes_per_sequence()
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


def profile_main(args, sz) -> int:
    """`--profile`: the decode-step fit alone -> bench/results/serve_profile.json (or --out)."""
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench_serve_profile_"))
    result = run_profile(get_config(PRESET), sz, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    headline = {}
    for mode in ("eager", "compiled"):
        for n in sz.profile_seqs:
            row = result[mode][f"s{n}"]
            headline[f"laplace_over_llama_per_layer_s{n}_{mode}"] = row[
                "laplace_over_llama_per_layer"
            ]["median"]
            headline[f"laplace_layer_over_gemm_s{n}_{mode}"] = row["laplace_layer_over_gemm"][
                "median"
            ]
            for who in ("laplace", "llama"):
                headline[f"{who}_{mode}_s{n}_per_layer_ms"] = 1e3 * row[who]["per_layer_s"]
                headline[f"{who}_{mode}_s{n}_intercept_ms"] = 1e3 * row[who]["intercept_s"]
    result["seconds"] = time.perf_counter() - t_start
    out = args.out or RESULTS / "serve_profile.json"
    path = write_result("serve_profile", headline, path=out, preset=PRESET, **result)
    print(json.dumps(headline, indent=2))
    print(f"wrote {path} ({result['seconds']:.0f} s)")
    return 0


def hybrid_main(args, sz) -> int:
    """`--hybrid`: the hybrid rows alone -> bench/results/serve_hybrid.json (or --out)."""
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench_serve_hybrid_"))
    results: dict = {"quick": args.quick, "sizes": dataclasses.asdict(sz), "preset": PRESET}
    run_hybrid(get_config(PRESET), sz, tmp, results)
    shutil.rmtree(tmp, ignore_errors=True)
    headline = hybrid_headlines(results, sz)
    results["seconds"] = time.perf_counter() - t_start
    return _write(args, "serve_hybrid", headline, results)


def _write(args, name: str, headline: dict, results: dict) -> int:
    """A part's result: bench/results/NAME.json (NAME_quick.json with --quick; or --out)."""
    name += "_quick" if args.quick else ""
    path = write_result(name, headline, path=args.out or RESULTS / f"{name}.json", **results)
    print(json.dumps(headline, indent=2))
    print(f"wrote {path} ({results['seconds']:.0f} s)")
    return 0


def _tokens_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def agent_resume_main(args, sz) -> int:
    """`--agent-resume`: the state store's rows, pure Laplace and the 3:1 hybrid ->
    bench/results/agent_resume.json (or --out)."""
    t_start = time.perf_counter()
    cfg = get_config(PRESET)
    hybrid = cfg.replace(attention_every=4)
    tmp = Path(tempfile.mkdtemp(prefix="bench_agent_resume_"))
    max_len = max(max(sz.resume_histories), sz.shared_prompt) + 2 * sz.resume_reply
    max_len += sz.resume_message + 64
    results = run_agent_resume(
        cfg,
        sz,
        export_laplace(cfg, tmp / "laplace", max_len),
        max_len,
        llama_kv_bytes_per_token(cfg),
    )
    results["hybrid4"] = run_agent_resume(
        hybrid,
        sz,
        export_laplace(hybrid, tmp / "hybrid4", max_len),
        max_len,
        llama_kv_bytes_per_token(cfg),
        replica=False,
    )
    shutil.rmtree(tmp, ignore_errors=True)
    headline: dict = {}
    for suffix, rows in (("", results["rows"]), ("_hybrid4", results["hybrid4"]["rows"])):
        for row in rows:
            k = _tokens_label(row["history"])
            headline[f"ttft_restart_cold_over_store_{k}{suffix}"] = row["cold_over_store"]["median"]
            headline[f"store_bytes_per_conversation_{k}{suffix or '_laplace'}"] = row["store_bytes"]
            if suffix:
                headline[f"store_bytes_formula_{k}{suffix}"] = row["formula_bytes"]
            else:
                headline[f"store_bytes_per_conversation_{k}_llama"] = row["llama_kv_bytes"]
        last = rows[-1]
        headline[f"cached_tokens_after_restart_{_tokens_label(last['history'])}{suffix}"] = min(
            last["cached_tokens"]
        )
    shared = results["hybrid4"]["shared_prompt"]
    headline[f"store_bytes_shared_prompt_{shared['conversations']}_hybrid4"] = shared["store_bytes"]
    headline["replica_handover_hit"] = results["replica"]["hit"]
    results.update(quick=args.quick, sizes=dataclasses.asdict(sz), preset=PRESET)
    results["state_bytes_per_sequence"] = cfg.page_bytes_per_sequence()
    results["seconds"] = time.perf_counter() - t_start
    return _write(args, "agent_resume", headline, results)


if __name__ == "__main__":
    raise SystemExit(main())
