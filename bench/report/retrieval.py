"""docs/retrieval.md: the retrieval benchmark (bench.retrieval)."""

from __future__ import annotations

import json

from bench.report.fmt import load, minutes, pct, table

PAGE = "docs/retrieval.md"

S135 = (  # the design section that says why the hybrid's scales exist
    "[design s13.5](design.md#135-the-embeddings-scale-and-the-gla-branches-multiplier-what-lets-"
    "the-attention-layer-learn-the-lookup)"
)
MIXER_ORDER = ["laplace", "attention", "hybrid", "hybrid4"]


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
            "sqrt(D) (`embed_scale`, " + S135 + "), when its attention layer never "
            "learnt the lookup; the hybrid as it is now: `bench.hybrid_init`, on the "
            "[Hybrid](hybrid.md) page. Not yet rerun."
        )
    elif "gla_branch_scale" not in d:  # measured before gla_branch_scale existed
        note = (
            "\n\nThe hybrids' rows here were measured before a hybrid's GLA branches were "
            "multiplied by 0.1 (`gla_branch_scale`, " + S135 + "): they are "
            "`gla_branch_scale=1`. The hybrids as they are now: `bench.hybrid_init`'s "
            "`hybrid_scaled_gla_x0.1` and `hybrid4_gla_x0.1`, on the [Hybrid](hybrid.md) "
            "page. Not yet rerun."
        )
    return table(head, rows) + note


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
    return table(head, rows) + "\n\n" + runs_took(d)


def runs_took(d: dict) -> str:
    """How long a benchmark's runs took, and how many were reused."""
    groups = d["runs"].values() if isinstance(d["runs"], dict) else [d["runs"]]
    runs = {json.dumps(r, sort_keys=True) for rs in groups for r in rs}
    old = ""  # retrieval.json written before bench.passkey held the passkey study
    if isinstance(d["runs"], dict) and "passkey" in d["runs"]:
        old = f" ({len(d['runs']['passkey'])} of them its d_model 64 passkey study, since replaced)"
    return (
        f"Training and scoring took {minutes(d['train_and_eval_s'])} in all on this "
        f"project's {d['machine']['cores']}-core CPU machine ({d['machine']['cpu']}), for "
        f"{len(runs)} runs{old}; {len(d['reused_runs'])} of them were trained by an earlier "
        f"invocation of the same code and arguments and reused (`reused_from` in the JSON), the "
        f"last invocation took {minutes(d['elapsed_s'])}."
    )


def retrieval_passkey() -> str:
    d = load("passkey")
    contexts = sorted({c["context"] for c in d["passkey"][0]["cells"]})
    order = ("hybrid", "hybrid4", "attention", "laplace")  # each model's seeds together
    rows = []
    for p in sorted(d["passkey"], key=lambda p: (order.index(p["mixer"]), -p["t_max"], p["seed"])):
        row = [f"{p['mixer']}, T_max {p['t_max']:,.0f}, seed {p['seed']}"]
        for T in contexts:
            accs = sorted((c for c in p["cells"] if c["context"] == T), key=lambda c: c["depth"])
            row.append(" / ".join(pct(c["accuracy"]) for c in accs))
        rows.append(row)
    head = [f"passkey (d_model {d['d_model']}, trained at 64 tokens)"]
    head += [f"{T:,} tokens: depth 0 / 0.5 / 1" for T in contexts]
    worst = []  # per model, the worst cell of each seed
    for name in ("hybrid", "hybrid4", "attention"):
        seeds = sorted((p for p in d["passkey"] if p["mixer"] == name), key=lambda p: p["seed"])
        worst.append(
            name + " " + " / ".join(pct(min(c["accuracy"] for c in p["cells"])) for p in seeds)
        )
    labels = " / ".join(str(seed) for seed in range(d["seeds"]))
    return (
        table(head, rows)
        + f"\n\nThe worst cell of each seed ({labels}), at any context and depth: "
        + "; ".join(worst)
        + ".\n\n"
        + runs_took(d)
    )


BLOCKS = {
    "retrieval-mqar": retrieval_mqar,
    "retrieval-sweep": retrieval_sweep,
    "retrieval-state": retrieval_state,
    "retrieval-passkey": retrieval_passkey,
}
