"""docs/hybrid.md: the hybrid's studies (bench.hybrid_init), plans (bench.plan), quality
(bench.quality), parity (bench.hybrid_parity) and serving (bench.serve --hybrid)."""

from __future__ import annotations

from bench.quality import RUNS as QUALITY_RUNS
from bench.report.fmt import load, minutes, pct, ratio, spread, table

PAGE = "docs/hybrid.md"


HYBRID4_INIT = (  # the 3:1 study's command (docs/design.md s13.5)
    "--variants hybrid4_attn_first,hybrid4_gla_x0.1,attention4,hybrid_scaled_gla_x0.1 "
    "--result hybrid4_init"
)


def hybrid_init(name: str = "hybrid_init") -> str:
    """bench.hybrid_init: the hybrid's initialisation study (docs/design.md s13.5); `name`
    "hybrid4_init": its 3:1 study."""
    d = load(name)
    settings = [k for k in d["table"][0] if k[0].isdigit()]
    per_row = "seeds" in d["table"][0]  # studies whose variants have different seeds
    rows = []
    for r in d["table"]:
        v = d["variants"][r["variant"]]
        cells = [
            f"**{pct(r[k]['mean'])}** ({' / '.join(pct(a) for a in r[k]['seeds'])})"
            for k in settings
        ]
        cos = r.get("identity_cosine")
        seeds = [", ".join(str(s) for s in r["seeds"])] if per_row else []
        rows.append(
            [f"`{r['variant']}`", f"{v['lr']:g}", *seeds, *cells]
            + [
                " / ".join(f"{x:.3g}" for x in r["final_loss"]),
                "-" if cos is None else f"{cos:.2f}",
            ]
        )
    head = ["variant", "lr", *(["seeds"] if per_row else [])]
    head += [f"({k.replace('_', ', ')})" for k in settings]
    head += ["final loss per seed", "identity cosine at init"]
    mean = "mean over its seeds" if per_row else f"mean of {d['seeds']} seeds"
    command = d.get("command") or (  # the first two studies' files predate the field
        "python -m bench.hybrid_init" + ("" if name == "hybrid_init" else " " + HYBRID4_INIT)
    )
    took = (  # a table of reused runs: their own training and scoring time
        f"{minutes(d['train_and_eval_s'])} of training and scoring"
        if "train_and_eval_s" in d
        else minutes(d["elapsed_s"])
    )
    return (
        f"`{command}` "
        f"(`bench/results/{name}.json`, "
        f"{took} on this project's {d['machine']['cores']}-core CPU machine): "
        f"MQAR accuracy, {mean} (each seed in brackets), trained on (64, 4) "
        f"for {d['steps']:,} steps:\n\n" + table(head, rows)
    )


def plan_hybrid() -> str:
    """The 3B hybrid's plans beside pure Laplace's of the same shape (bench.plan), each row on a
    context axis in both forms of its attention layers (the default and the other)."""
    d = load("plan")
    gib = 1024**3
    default = d["headline"].get("attention_context_default")
    other = next(f for f in ("ring", "gather") if f != default) if default else None
    rows = []
    for r in d["hybrid"].values():
        b = r["batch"]
        alt = r.get(f"attention_context_{other}")
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
                "-" if alt is None else f"{alt['train_step_memory']['peak'] / gib:.2f}",
                "-" if alt is None else ratio(alt["cost_per_token_over_laplace"], 3),
            ]
        )
    head = ["tokens per sequence", "mesh", "accum x micro", "hybrid peak GiB", "Laplace peak GiB"]
    head += ["fits 24 GiB", "census", "modelled step s", "cost per token vs Laplace"]
    head += [f"{other} form: peak GiB", f"{other} form: cost vs Laplace"]
    every = next(iter(d["hybrid"].values()))["attention_every"]
    commands = "\n".join(f"    {r['command']}" for r in d["hybrid"].values())
    return (
        f"The hybrid, `attention_every={every}` (one softmax-attention layer in {every}), each row "
        "compiled by `python -m bench.plan` as\n\n" + commands + "\n\n"
        f"and, on a context axis, again with `attention_context={other}` (the last two "
        f"columns); the default form, `{default}`, is the one whose step is no larger at any "
        "length:\n\n" + table(head, rows) + "\n\n"
        "Each row is compared with pure Laplace's plan of the same length, mesh and micro-batches "
        "(the recipe at 2,048 tokens, the long rows of "
        "[Long context](long-context.md#the-3b-plans-to-1m-tokens)); the modelled cost counts "
        "attention's FLOPs over the share of each sequence's square its form scores: all of it "
        "on one device and in the gather form, (2 S + 1) / (4 S) of it in the ring over S "
        "devices."
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


def hybrid_parity(name: str = "hybrid_parity") -> str:
    """bench.hybrid_parity of the default hybrid, or (`name`) of one trained with `--set`."""
    d = load(name)
    h, n, k = d["headline"], d["new_tokens"], len(d["prompts"])
    fp32 = "equal on every prompt" if h["hybrid_greedy_equal_fp32"] == 1 else "not all equal"
    settings = d.get("settings") or []
    flags = "".join(f" {s}" for s in settings)
    command = "python -m bench.hybrid_parity" + (
        f" --set{flags} --result {name}" if settings else ""
    )
    model = f" (`{' '.join(settings)}`)" if settings else ""
    return (
        f"`{command}` (`bench/results/{name}.json`): the tiny hybrid{model} "
        f"trained {d['steps']} steps (loss {d['loss_first_last'][0]:.2f} -> "
        f"{d['loss_first_last'][1]:.2f}), {k} prompts, {n} greedy tokens each: JAX, PyTorch, "
        f"vLLM eager and vLLM compiled (fp32) {fp32}; bf16 vLLM and bf16 PyTorch agree on the "
        f"first {h['hybrid_bf16_steps_equal_min']} of {n} steps of every prompt (the fewest)."
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


BLOCKS = {
    "hybrid-init": hybrid_init,
    "hybrid4-init": lambda: hybrid_init("hybrid4_init"),
    "hybrid-branch": lambda: hybrid_init("hybrid_branch"),
    "hybrid-branch-post-norm": lambda: hybrid_init("hybrid_branch_post_norm"),
    "plan-hybrid": plan_hybrid,
    "quality": quality,
    "hybrid-parity": hybrid_parity,
    "hybrid-parity-forms": lambda: hybrid_parity("hybrid_parity_forms"),
    "serve-hybrid": serve_hybrid,
}
