"""docs/long-context.md: the 3B long-sequence plans (bench.plan) and the passkey study
(bench.long_context)."""

from __future__ import annotations

from bench.report.fmt import load, pct, ratio, table

PAGE = "docs/long-context.md"


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


BLOCKS = {"long-context": long_context, "long-context-passkey": long_context_passkey}
