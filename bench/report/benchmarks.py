"""docs/benchmarks.md: the kernels (bench.gla), Muon (bench.muon), the training step
(bench.train), the 3B plan (bench.plan) and serving (bench.serve, bench.serve --profile)."""

from __future__ import annotations

import statistics

from bench.report.fmt import load, minutes, pct, ratio, sci, spread, table

PAGE = "docs/benchmarks.md"


def gla() -> str:
    d = load("gla")
    res, h, sp = d["results"], d["headline"], d["speedups"]
    names = ("chunked", "recurrent", "softmax", "fla_chunk")
    Ts = [r["T"] for r in res["chunked"]]

    def cell(name, T):
        row = next((r for r in res[name] if r["T"] == T), None)
        return f"{row['seconds'] * 1e3:,.1f}" if row else "-"

    rows = [[f"{T:,}"] + [cell(n, T) for n in names] for T in Ts]
    head = ["T", "chunked scan", "recurrent", "softmax attention"]
    head.append("fla `naive_chunk_simple_gla` (torch)")
    fla, rec = sp["chunked_over_fla_T2048"], sp["chunked_over_recurrent_T2048"]
    return (
        table(head, rows) + "\n\n"
        f"Headline: at T = 2,048 the chunked scan is **{ratio(fla['median'])}** faster than "
        f"fla's PyTorch chunk reference (rounds: {ratio(fla['min'])} to {ratio(fla['max'])}) and "
        f"{ratio(rec['median'], 1)} faster than the recurrent reference ({ratio(rec['min'], 1)} "
        f"to {ratio(rec['max'], 1)}); its time per token at 16k is "
        f"**{ratio(h['per_token_time_16k_over_2k'], 3)}** that at 2k (medians)."
    )


def muon() -> str:
    d = load("muon")
    h, t = d["headline"], d["small_timing"]
    g, a = d["traffic_3b"]["gather"], d["traffic_3b"]["a2a"]

    def kinds(p):
        return ", ".join(f"{n} {k}" for k, n in p["collectives"].items() if n)

    med = t["median_seconds"]
    rows = [
        [
            "bytes sent + received per device per step (bf16)",
            f"{h['gather_bytes_per_device']:,}",
            f"{h['a2a_bytes_per_device']:,} (**{h['traffic_ratio']:.1f}x** less)",
        ],
        ["collectives in the compiled update", kinds(g), kinds(a)],
        [
            f"`small` preset, optimizer step on 8 simulated CPU devices (median of "
            f"{len(t['all_seconds']['a2a'])} alternating rounds)",
            f"{med['gather'] * 1e3:,.0f} ms",
            f"{med['a2a'] * 1e3:,.0f} ms (**{spread(t['gather_over_a2a'])}**)",
        ],
    ]
    fl, bits, order = d["flops"], d["bitwise_small"], d["fixed_order_timing"]

    def equal(mode):
        if h[f"{mode}_bitwise_equal_single"]:
            return "bit-identical to `single`'s"
        differing = bits[f"{mode}_leaves_differing"]
        return f"**not** bit-identical to `single`'s ({differing} leaves differ)"

    return (
        table(["", "gather", "a2a"], rows) + "\n\n"
        f"Newton-Schulz is {pct(h['ns_flop_share'], 2)} of a 3B training step's FLOPs "
        f"({sci(fl['ns_flops_total'])} of {sci(fl['step_flops_6NT'])}); the whole-matrix bound of "
        f"the traffic ratio is {d['whole_matrix_traffic_bound']:.1f}x.\n\n"
        f"One arithmetic for every layout ([design s4.2](design.md#42-distributed-muon-under-fsdp)"
        f"): {bits['steps']} training steps of `small` on fsdp=8 at XLA:CPU's default code "
        f"generation, every loss and every final parameter: `gather` {equal('gather')}, `a2a` "
        f"{equal('a2a')}. "
        f"The fixed order's cost on one device (Newton-Schulz over `small`'s matrices in column "
        f"tiles against whole matrices, median of {len(order['all_seconds']['tiled'])} "
        f"alternating rounds): **{spread(order['tiled_over_whole'])}**."
    )


def train() -> str:
    d = load("train")
    rows = []
    for r in d["runs"]:
        rows.append(
            [
                "Laplace (GLA)" if r["model"] == "gla" else "attention baseline",
                f"{r['seq_len']:,}",
                spread(r["step_s"], lambda x: f"{x:.2f}"),
                f"{r['tokens_per_s']['median']:,.0f}",
                spread(r["mfu"], pct),
            ]
        )
    sp, rate = d["gla_over_transformer_speedup"], d["matmul_flops_per_s"]
    return (
        f"Medians of {d['rounds']} interleaved rounds (minimum to maximum in brackets); the fp32 "
        f"matmul rate, the MFU denominator, was probed at the start of every round: median "
        f"{rate['median'] / 1e9:.1f} GFLOP/s ({rate['min'] / 1e9:.1f} to "
        f"{rate['max'] / 1e9:.1f}).\n\n"
        + table(["model", "T", "s/step", "tokens/s", "MFU"], rows)
        + "\n\n"
        f"Laplace trains **{spread(sp['8192'])}** faster than the attention baseline at 8,192 "
        f"tokens and {spread(sp['2048'])} at 2,048 (each round's ratio of the two steps)."
    )


KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")


def plan() -> str:
    d = load("plan")
    h, m = d["headline"], d["modelled_trn2"]
    gib = 1024**3
    rows = []
    for name, p in d["programs"].items():
        mem, col, census = p["memory"], p["collectives"], p["census"]
        where = " (host)" if p["runs_on"] == "host" else ""
        rows.append(
            [
                f"{name}{where}",
                f"{mem['arguments'] / gib:.2f}",
                f"{mem['temporaries'] / gib:.2f}",
                f"{mem['peak'] / gib:.2f}",
                "yes" if mem["fits"] else "NO",
                *(f"{col[k] / 1e6:,.1f}" for k in KINDS),
                f"{census['violations']:,}",
            ]
        )
    head = ["program", "args GiB", "temps GiB", "peak GiB", "fits 24 GiB"]
    head += ["all-gather", "reduce-scatter", "all-reduce", "all-to-all", "census"]
    total = d["programs"]["train_step"]["collectives"]["total"]
    a = m["assumptions"]
    return (
        f"`python -m train.plan --config laplace-3b --devices 64 {' '.join(d['recipe_overrides'])}`"
        " (what `bench.plan` runs):\n\n" + table(head, rows) + "\n\n"
        f"**The 3B step fits: {h['train_step_gib_per_device']:.2f} GiB per device**; Neuron "
        f"census of the programs a Neuron run executes: **{h['neuron_census_violations']}**. "
        f"Collectives: {total / 1e9:.1f} GB per step against the FSDP ideal of "
        f"{d['fsdp_ideal_bytes_received']['total'] / 1e9:.1f} GB "
        f"(**{h['collective_bytes_over_fsdp_ideal']:.3f}x**). Training FLOPs per step "
        f"{sci(h['train_flops_per_step'], 4)} (6 x parameters x tokens). Modelled trn2 step, "
        f"a floor and not a prediction: **{m['step_s']:.2f} s** = {m['compute_s']:.2f} s of "
        f"compute (the step's {sci(d['flops']['with_mixer_terms'], 4)} FLOPs, GLA terms "
        "included, at "
        f"{pct(a['flops_utilisation'], 0)} of {a['bf16_flops_per_s_per_core'] / 1e12:g} TFLOP/s "
        f"on each of {d['mesh']['fsdp'] * d['mesh'].get('data', 1)} cores) + "
        f"{m['collective_s_not_overlapped']:.3f} s of collectives (the compiled step's bytes at "
        f"{a['link_bytes_per_s'] / 1e12:g} TB/s, not overlapped)."
    )


def serve() -> str:
    d = load("serve")
    h, r = d["headline"], d["ratios"]

    def med(key, level):
        return next(x for x in d[key] if x["concurrency"] == level)["median_tokens_per_s"]

    def ttft_growth(turns):  # the last turn's median time to first token over the first's
        return statistics.median(turns[-1]["samples_ttft_s"]) / statistics.median(
            turns[0]["samples_ttft_s"]
        )

    sizes = d["sizes"]
    rows = []
    for workload, key, levels, name in (
        ("128-token prompts", "p128", sizes["levels"], "p128"),
        (
            f"agent: {sizes['agent_prompt']:,}-token history + {sizes['agent_new_tokens']} new",
            "agent",
            sizes["agent_levels"],
            "agent8k",
        ),
    ):
        for mode, suffix in (("eager", ""), ("compiled", "_compiled")):
            for level in levels:
                seqs = f"{level} sequence" + ("s" if level > 1 else "")
                rows.append(
                    [
                        f"{workload}, {seqs}, {mode}",
                        med(f"laplace{suffix}_throughput_{key}", level),
                        med(f"llama{suffix}_throughput_{key}", level),
                        spread(r[f"over_llama_tokens_per_s_{name}_s{level}{suffix}"]),
                    ]
                )
    n = sizes["long_seqs"]
    rows.append(
        [
            f"{n} sequences, 2,048-token prompts, eager",
            med("laplace_throughput_p2048", n),
            med("llama_throughput_p2048", n),
            spread(r["over_llama_tokens_per_s_p2048_s64"]),
        ]
    )
    for mode, lap_key, llama_key, key in (
        ("eager", "laplace", "llama", "over_llama_prefill_tokens_per_s"),
        (
            "compiled",
            "laplace_compiled",
            "llama_compiled",
            "over_llama_compiled_prefill_tokens_per_s",
        ),
    ):
        rows.append(
            [
                f"prefill, {d['laplace_prefill']['seqs']} x "
                f"{d['laplace_prefill']['prompt_len']:,}-token prompts (prompt tokens/s), {mode}",
                d[f"{lap_key}_prefill"]["median_prompt_tokens_per_s"],
                d[f"{llama_key}_prefill"]["median_prompt_tokens_per_s"],
                spread(r[key]),
            ]
        )
    sb = d["shared_budget"]
    rows.append(
        [
            f"{sb['requests']:,} requests of {sb['prompt_len']:,} + {sb['new_tokens']} tokens, "
            f"one {sb['budget_bytes'] / 2**30:g} GiB budget, eager (one run each)",
            sb["laplace"]["tokens_per_s"],
            sb["llama"]["tokens_per_s"],
            ratio(h["over_llama_tokens_per_s_1280_requests"]),
        ]
    )
    mid = d["mid"]
    rows.append(
        [
            f"mid-size ({mid['parameters']['laplace'] / 1e6:.0f}M and "
            f"{mid['parameters']['llama'] / 1e6:.0f}M parameters), {mid['laplace']['concurrency']} "
            f"sequences of {mid['laplace']['prompt_len']:,} + {mid['laplace']['new_tokens']} "
            f"tokens, {mid['budget_bytes'] / 2**30:.0f} GiB of pages / KV each, eager",
            mid["laplace"]["median_tokens_per_s"],
            mid["llama"]["median_tokens_per_s"],
            spread(r["over_llama_tokens_per_s_mid_s64"]),
        ]
    )
    rows = [[x[0], f"{x[1]:,.0f}", f"{x[2]:,.0f}", x[3]] for x in rows]
    levels = sizes["levels"]

    def by_sequences(key, ns):  # "1: ratio (spread), 8: ..." of the ratios key.format(n=n)
        return ", ".join(f"{n}: {spread(r[key.format(n=n)])}" for n in ns)

    st, pc = d["staggered"], d["prefix_cache"]
    kv_8k = next(m["llama_kv_bytes_fp32"] for m in d["memory_per_seq"] if m["context"] == 8192)
    head = ["workload (output tokens/s, medians of rounds)", "Laplace", "Llama"]
    head.append("Laplace / Llama, median (min to max) of rounds")
    return (
        table(head, rows) + "\n\n"
        f"- Compile mode over eager, 128-token prompts, by sequences: Laplace "
        f"{by_sequences('compiled_over_eager_laplace_s{n}', levels)}; Llama "
        f"{by_sequences('compiled_over_eager_llama_s{n}', levels)}. Greedy "
        f"tokens of the compiled engines equal to the eager engines': Laplace "
        f"{d['laplace_compiled_greedy_equal_eager']:.0%}, Llama "
        f"{d['llama_compiled_greedy_equal_eager']:.0%}.\n"
        f"- Compile mode over eager at the mid-size width ({d['seed']['shape']['d_model']:,} x "
        f"{d['seed']['shape']['n_layers']} layers, where the layers are most of a step), "
        f"{sizes['seed_prompt']}-token prompts + {sizes['seed_new_tokens']} new, by sequences, "
        f"the four engines alive together: Laplace "
        f"{by_sequences('compiled_over_eager_mid_s{n}_laplace', sizes['seed_levels'])}; Llama "
        f"{by_sequences('compiled_over_eager_mid_s{n}_llama', sizes['seed_levels'])}.\n"
        f"- Decode phase of the shared budget: {sb['laplace']['decode_tokens_per_s']:,.0f} vs "
        f"{sb['llama']['decode_tokens_per_s']:,.0f} tokens/s, "
        f"{sb['laplace']['max_running']} vs {sb['llama']['max_running']} sequences at once "
        f"(Llama's preemptions: {sb['llama']['preempted']}).\n"
        f"- Cost per output token, prompt 8,192 over 2,048 (each round's windows): Laplace "
        f"{spread(r['cost_per_token_8k_over_2k'], lambda x: ratio(x, 3))}, Llama "
        f"{spread(r['llama_cost_per_token_8k_over_2k'])}.\n"
        f"- Time to first token, turn {pc['turns']} over turn 1 (medians), prefix cache on: "
        f"{ratio(ttft_growth(pc['cached']))} (off: {ratio(ttft_growth(pc['uncached']), 1)}).\n"
        f"- Staggered arrivals ({st['requests']} requests, one every {st['arrival_every_steps']} "
        f"engine steps) against one fixed batch: {st['staggered']['tokens_per_s']:,.0f} vs "
        f"{st['fixed']['tokens_per_s']:,.0f} tokens/s, mean time to first token "
        f"{st['staggered']['mean_time_to_first_token_s']:.3f} s vs "
        f"{st['fixed']['mean_time_to_first_token_s']:.3f} s (one run each).\n"
        f"- State page: {h['state_bytes_per_seq_measured']:,} B measured on vLLM's pages, "
        f"{h['state_bytes_per_seq_computed']:,} B computed; Llama's fp32 KV at 8,192 tokens: "
        f"{kv_8k:,} B. {d['sizes']['rounds']} alternating rounds per figure; the whole run "
        f"took {minutes(d['seconds'])}."
    )


def serve_profile() -> str:
    d = load("serve_profile")
    layers = d["layers"]
    rows = []
    for mode in ("eager", "compiled"):
        for seqs, row in d[mode].items():
            for who in ("laplace", "llama"):
                f = row[who]
                worst = max(abs(r) for r in f["residual_s"].values())
                rows.append(
                    [
                        f"{who.capitalize()} {mode}, {seqs.removeprefix('s')} seq"
                        + ("s" if seqs != "s1" else ""),
                        " / ".join(f"{1e3 * f['step_s'][str(n)]:.2f}" for n in layers),
                        f"{1e3 * f['intercept_s']:.2f}",
                        f"{1e3 * f['per_layer_s']:.3f}",
                        f"{1e3 * worst:.3f}",
                        f"{1e3 * f['gemm_per_layer_s']['median']:.3f}",
                        spread(row[f"{who}_layer_over_gemm"]),
                        spread(row["laplace_over_llama_per_layer"]) if who == "laplace" else "",
                    ]
                )
    head = [
        "model, mode, sequences",
        f"decode step at {' / '.join(map(str, layers))} layers (ms)",
        "intercept (ms)",
        "per layer (ms)",
        "largest fit residual (ms)",
        "the layer's weight GEMMs alone (ms)",
        "layer over its GEMMs",
        "Laplace over Llama per layer",
    ]
    return (
        f"`python -m bench.serve --profile` (`bench/results/serve_profile.json`, "
        f"{minutes(d['seconds'])}): the `small` width at {', '.join(map(str, layers))} "
        f"layers; for each mode the six engines alive together, {d['rounds']} alternating "
        f"rounds of {d['window_steps']} decode steps each; step time (median over rounds) "
        "fitted linearly against the layer count. The GEMMs: one layer's linear layers called "
        f"alone in the engine's worker, the median of {d['gemm_calls']} calls each, every "
        "round. Ratios are per round (a fit per round), median (min to max).\n\n"
        + table(head, rows)
    )


BLOCKS = {
    "gla": gla,
    "muon": muon,
    "train": train,
    "plan": plan,
    "serve": serve,
    "serve-profile": serve_profile,
}
