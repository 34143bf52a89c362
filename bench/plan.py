"""`python -m bench.plan`: Laplace 3B on 64 simulated devices, compiled only: the 2,048-token
recipe and long sequences split over a context axis.

The recipe (docs/design.md s8): `laplace-3b`, 524,288 tokens per step (256 sequences of
2,048), micro batch 64 (4 accumulation steps), FSDP over 64 devices. Long context (s11): the same
model at 32,768 tokens per sequence (16 sequences, `--mesh fsdp=16,context=4`), 131,072 (4
sequences, `fsdp=4,context=16`) and 1,048,576 (one sequence per step, `fsdp=1,context=64`), each
step one micro-batch. Every program the trainer puts on the devices is compiled with abstract
inputs (`train.plan.make_plan`); nothing of 3B size is allocated and nothing runs on Trainium.
Prints each plan's table and writes bench/results/plan.json: the recipe's plan, the recipe in one
micro-step (micro batch 256: the same tokens a step, laid out as the long rows are), and a row per
long sequence (peak memory, collectives by kind against their ideals, exchanges per step by kind,
census, modelled step time and cost per token against the recipe as run and against the recipe
at the same number of micro-steps: `headline_notes` says what each key compares). The hybrid
(s13, `attention_every=4`: one softmax-attention layer in four) is compiled at the recipe's
length and layout and at the 32k, 128k and 1m rows' (`hybrid` in the JSON): its peak memory, census
and modelled cost per token against pure Laplace's at the same length, sequences, mesh and
micro-batches (attention's quadratic FLOPs counted, over the share of the square its form
scores). On a context axis each hybrid row is compiled in both forms of its attention layers
(s13.3: `attention_context=ring` and `gather`), and `attention_context_default` names the
default laplace_jax/model.py follows: the ring unless its step is larger than the gather form's
at one of these lengths.
"""

from __future__ import annotations

import argparse

from train.plan import print_table, simulate_devices

# (row, tokens per sequence, context devices, tokens per step): docs/design.md s11
LONG_CONTEXT = (
    ("32k", 32_768, 4, 524_288),
    ("128k", 131_072, 16, 524_288),
    ("1m", 1_048_576, 64, 1_048_576),
)


# the hybrid's rows: (row, tokens per sequence, context devices, tokens per step), each compared
# with pure Laplace's plan of the same shape (the recipe at 2k, the long rows above)
HYBRID = (
    ("2k", 2_048, 1, 524_288),
    ("32k", 32_768, 4, 524_288),
    ("128k", 131_072, 16, 524_288),
    ("1m", 1_048_576, 64, 1_048_576),  # where the gather form stops fitting (docs/design.md s13.3)
)
HYBRID_EVERY = 4


def cost_per_token(plan: dict) -> float:
    """The modelled trn2 step time per token of a plan (train.plan's floor, docs/design.md s8)."""
    return plan["modelled_trn2"]["step_s"] / plan["batch"]["tokens"]


def hybrid_row(plan: dict, laplace: dict) -> dict:
    """A hybrid plan beside pure Laplace's plan of the same length and layout."""
    step = plan["programs"]["train_step"]
    return {
        "seq_len": plan["config"]["model"]["seq_len"],
        "attention_every": plan["config"]["model"]["attention_every"],
        "mesh": plan["mesh"],
        "batch": plan["batch"],
        "train_step_memory": step["memory"],
        "laplace_train_step_memory": laplace["programs"]["train_step"]["memory"],
        "collectives": step["collectives"],
        "neuron_census_violations": plan["headline"]["neuron_census_violations"],
        "modelled_trn2": plan["modelled_trn2"],
        "flops": plan["flops"],
        "modelled_cost_per_token_s": cost_per_token(plan),
        "cost_per_token_over_laplace": cost_per_token(plan) / cost_per_token(laplace),
        "compile_s": {name: p["compile_s"] for name, p in plan["programs"].items()},
    }


def long_context_row(plan: dict, recipe: dict, recipe_same: dict, context: int) -> dict:
    """One long-sequence plan, summarised beside the recipe as run (`recipe`: 4 micro-steps) and
    the recipe at the same number of micro-steps (`recipe_same`: one, the same tokens a step)."""
    step = plan["programs"]["train_step"]
    h, b = plan["headline"], plan["batch"]
    return {
        "seq_len": plan["config"]["model"]["seq_len"],
        "context": context,
        "mesh": plan["mesh"],
        "batch": b,
        "train_step_memory": step["memory"],
        "collectives": step["collectives"],
        "context_exchanges": step["context_exchanges"],
        "ideal": plan["fsdp_ideal_bytes_received"],
        "collective_bytes_over_ideal": h["collective_bytes_over_fsdp_ideal"],
        "context_exchange_over_ideal": h["context_exchange_over_ideal"],
        "neuron_census_violations": h["neuron_census_violations"],
        "modelled_trn2": plan["modelled_trn2"],
        "modelled_cost_per_token_s": cost_per_token(plan),
        "cost_per_token_over_2k": cost_per_token(plan) / cost_per_token(recipe),
        "cost_per_token_over_2k_same_micro_steps": cost_per_token(plan)
        / cost_per_token(recipe_same),
        "compile_s": {name: p["compile_s"] for name, p in plan["programs"].items()},
    }


NOTES = {
    "cost_per_token_{row}_over_2k": "the row's modelled cost per token over the recipe as run "
    "(4 accumulation micro-steps of 64 sequences, each micro-step gathering and "
    "reduce-scattering the weights once): the long rows run one micro-step, so this ratio "
    "counts the recipe's three extra weight exchanges against it",
    "cost_per_token_{row}_over_2k_same_micro_steps": "like for like: the row's modelled cost per "
    "token over the recipe at the same number of micro-steps (one: micro_batch_size=256, the "
    "same 524,288 tokens a step)",
    "context_exchange_over_ideal_{row}": "bytes the compiled step's context exchange receives "
    "per device (GLA states, conv windows and decays) over the ideal of the S - 1 other slices' "
    "GLA states per layer and sequence, forward and backward",
    "context_exchanges_per_step_{kind}": "collectives of each exchange kind the compiled step "
    "runs (forward and backward; the 32k row's): state and conv per layer, decay once per step",
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument(
        "--rows",
        default=",".join(name for name, *_ in LONG_CONTEXT),
        help="long-sequence rows to compile beside the recipe (comma-separated; '' for none)",
    )
    ap.add_argument(
        "--no-hybrid", dest="hybrid", action="store_false", help="skip the hybrid's rows"
    )
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="on top of the recipe")
    args = ap.parse_args(argv)
    simulate_devices(args.devices)

    from bench.common import write_result
    from laplace_jax.sharding import make_mesh
    from train import config as train_config
    from train.plan import make_plan, with_launch_settings

    def compile_row(label, overrides, context=1, step_tokens=None) -> tuple[dict, str]:
        """The plan of laplace-3b with `overrides` (the Neuron launcher's settings added) on
        `context` x (devices / context), printed, and the `train.plan` command that makes it."""
        overrides = with_launch_settings(overrides)
        mesh = f"fsdp={args.devices // context}" + (f",context={context}" if context > 1 else "")
        batch = f"--global-batch-tokens {step_tokens} " if step_tokens else ""
        command = (
            f"python -m train.plan --config laplace-3b --devices {args.devices} --mesh {mesh} "
            f"{batch}{' '.join(overrides)}"
        )
        print(f"\n{label}: {command}")
        given = {"global_batch_tokens": step_tokens} if step_tokens else {}
        cfg = train_config.resolve("laplace-3b", overrides, given)
        plan = make_plan(cfg, make_mesh(args.devices, context=context))
        print_table(plan)
        return plan, command

    # micro batch 64: 4 accumulation steps; GPT-2's end-of-text id: packed documents reset
    recipe = ["micro_batch_size=64", "eot_id=50256", *args.overrides]
    plan, _ = compile_row("the recipe", recipe)
    headline = plan.pop("headline")
    recipe_plan = {**plan, "headline": headline}
    # the same tokens a step in one micro-step: the long rows' layout, for like-for-like costs
    same, same_command = compile_row(
        "the recipe in one micro-step", ["micro_batch_size=256", *recipe[1:]]
    )

    rows, long_plans, long_overrides = {}, {}, {}
    wanted = [r for r in args.rows.split(",") if r]
    for name, seq_len, context, step_tokens in LONG_CONTEXT:
        if name not in wanted:
            continue
        overrides = [
            f"seq_len={seq_len}",
            f"micro_batch_size={step_tokens // seq_len}",  # one micro-batch per step
            "eot_id=50256",
            *args.overrides,
        ]
        long_plan, command = compile_row(name, overrides, context, step_tokens)
        long_plans[name], long_overrides[name] = long_plan, overrides
        rows[name] = long_context_row(long_plan, recipe_plan, same, context)
        rows[name]["command"] = command
        headline[f"train_step_gib_per_device_{name}"] = round(
            rows[name]["train_step_memory"]["peak"] / 1024**3, 3
        )
        headline[f"context_exchange_over_ideal_{name}"] = rows[name]["context_exchange_over_ideal"]
        for over in ("over_2k", "over_2k_same_micro_steps"):
            headline[f"cost_per_token_{name}_{over}"] = round(
                rows[name][f"cost_per_token_{over}"], 4
            )
    if rows:
        first = rows[next(iter(rows))]
        for kind, count in first["context_exchanges"].items():
            headline[f"context_exchanges_per_step_{kind}"] = count

    # the hybrid's rows: on a context axis in both forms of its attention layers (the ring and
    # the gather form, docs/design.md s13.3); the default is the form whose step is no larger
    # at any length compiled
    from laplace_jax.model import ATTENTION_CONTEXT_FORMS

    hybrid = {}
    for name, seq_len, context, step_tokens in HYBRID if args.hybrid else ():
        if seq_len == 2_048:  # the recipe's layout (4 micro-batches of 64)
            overrides, laplace, given = recipe, recipe_plan, None
        elif name in long_plans:
            overrides, laplace, given = long_overrides[name], long_plans[name], step_tokens
        else:
            continue  # its pure-Laplace row was not compiled (--rows)
        overrides = [*overrides, f"attention_every={HYBRID_EVERY}"]
        forms = {}
        for form in ATTENTION_CONTEXT_FORMS if context > 1 else (None,):
            extra = [f"attention_context={form}"] if form else []
            label = f"hybrid {name}" + (f", attention_context={form}" if form else "")
            hybrid_plan, command = compile_row(label, [*overrides, *extra], context, given)
            forms[form] = {**hybrid_row(hybrid_plan, laplace), "command": command}
        hybrid[name] = forms

    def peak(row):
        return row["train_step_memory"]["peak"]

    both = [forms for forms in hybrid.values() if len(forms) > 1]
    ring_fits_better = all(peak(forms["ring"]) <= peak(forms["gather"]) for forms in both)
    default = "ring" if ring_fits_better else "gather"
    if both:
        headline["attention_context_default"] = default
    for name, forms in hybrid.items():
        key = f"hybrid{HYBRID_EVERY}_{name}"
        chosen = forms[default] if default in forms else forms[None]
        for form, row in forms.items():
            suffix = "" if row is chosen else f"_{form}"  # the other form's keys: named by it
            headline[f"train_step_gib_per_device_{key}{suffix}"] = round(peak(row) / 1024**3, 3)
            headline[f"cost_per_token_{key}{suffix}_over_laplace"] = round(
                row["cost_per_token_over_laplace"], 4
            )
        hybrid[name] = {**chosen, "attention_context": default if default in forms else None}
        others = {f: r for f, r in forms.items() if r is not chosen}
        hybrid[name].update({f"attention_context_{f}": r for f, r in others.items()})
    print(
        write_result(
            "plan",
            headline,
            recipe_overrides=with_launch_settings(recipe),
            recipe_one_micro_step={
                "command": same_command,
                "batch": same["batch"],
                "train_step_memory": same["programs"]["train_step"]["memory"],
                "collectives": same["programs"]["train_step"]["collectives"],
                "modelled_trn2": same["modelled_trn2"],
                "modelled_cost_per_token_s": cost_per_token(same),
            },
            long_context=rows,
            hybrid=hybrid,
            headline_notes=NOTES,
            **plan,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
