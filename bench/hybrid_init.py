"""The hybrid's initialisation study (docs/design.md s13.5): why its attention layer never learnt
the MQAR lookup, which change lets it, and what that change does to pure Laplace.

    python -m bench.hybrid_init [--seeds N] [--steps N] [--variants a,b] [--work-dir DIR]
                                [--result NAME]

bench/retrieval.py's MQAR model (2 layers, d_model 128, 4 heads, trained on MQAR (64, 4) for
1,000 steps, scored at (64, 4), (128, 8), (256, 16)) in each variant below, `--seeds` seeds
each: the hybrid (layer 0 GLA, layer 1 attention) at its learning rate 0.01, pure Laplace at
its 0.03 (both the best of bench.retrieval's sweep before this study). Each run is
bench.retrieval's `run_one` (the project's trainer and evaluator, in-process) in its
`--work-dir`, so the runs of today's defaults (`hybrid`, `laplace`) are bench.retrieval's own and
either command reuses the other's.

    hybrid              the embedding scaled by sqrt(D) (embed_scale=auto), the GLA branch not
                        (gla_branch_scale=1): the first study's choice
    hybrid_as_built     embed_scale=one gla_branch_scale=1: the hybrid before either
    hybrid_gla_x0.1     embed_scale=one, the GLA layer's mixer branch (its W_out output) times a
                        fixed 0.1 (gla_branch_scale=0.1: a multiplier, not an initial scale)
    hybrid_zero_out     as built, W_out and W_3 initialised to zero (the residual branches
                        start at nothing; Muon then moves them)
    hybrid_attn_first   as built, layer 0 attention and layer 1 GLA
    hybrid_scaled_gla_x0.1
                        sqrt(D) and the GLA branch times 0.1: today's default (both "auto")
    hybrid4             4 layers, attention_every=4 (three GLA layers, then attention: the 3:1
                        layout) with sqrt(D) alone (gla_branch_scale=1), at 0.03 (its best rate
                        in bench.retrieval's sweep then)
    hybrid4_gla_x0.1    hybrid4 at 0.01 with every GLA layer's mixer branch times 0.1: today's
                        default
    hybrid4_gla_x0.2    hybrid4 at 0.01 with every GLA layer's mixer branch times 0.2
    hybrid4_gla_x0.3    the same times 0.3
    hybrid4_attn_first  hybrid4 (gla_branch_scale=1) at 0.01, attention first in its block
    attention4          4 attention layers at 0.01: does depth alone stop the lookup?
    laplace             pure Laplace as it is (embed_scale=auto: 1)
    laplace_sqrt_d      pure Laplace with embed_scale=sqrt_d_model

The second study's variants are `{hybrid,hybrid4}_FORM[_lr0.03]`, FORM one of bench.quality's
BRANCH_FORMS (configuration overrides), and `{hybrid,hybrid4}_FORM_residual_out` for the post-norm
forms: their GLA layers' W_out initialised by the residual rule, 1 / sqrt(2 L) of the fan-in's
scale, as the post-norm was first measured, rather than at the fan-in's scale;
`{hybrid,hybrid4}_post_norm_attention_out`: the post-norm with the attention layers' W_out at the
fan-in's scale too.

The `*_zero_out`, `*_attn_first`, `*_residual_out` and `*_attention_out` variants are not
configuration options: this script applies them while the run trains and is scored (the config's
`residual_init_scale`, `layer_mixers` and `mixer_out_init_scale` replaced). The others are
configuration overrides (`embed_scale`, `gla_branch_scale`, ...); a variant of today's defaults
and no patch is bench.retrieval's own run at that learning rate.

At initialisation (seed 0, no training), each hybrid variant's `identity_cosine`: over MQAR
(64, 4) sequences, the cosine between the attention layer's input, normalised as its
LayerNorm_1 does, at a key's position among the pairs and where the same key comes back as a
query. The lookup has to match those two; 1.0 when the attention layer reads the embedding
itself (attention first) or nothing has been added to it (zero-initialised branches).

Writes bench/results/hybrid_init.json (`--result NAME`: NAME.json; the 3:1 study of s13.5 is
hybrid4_init.json): per variant, each seed's accuracies and final loss.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import jax

from bench.common import chosen, write_result
from bench.quality import BRANCH_FORMS
from bench.retrieval import (
    MIXER_SETTINGS,
    MQAR_SETTINGS,
    cell_accuracy,
    model_overrides,
    mqar_spec,
    run_one,
)
from laplace_spec.config import LaplaceConfig

UNSCALED_GLA = ["gla_branch_scale=1"]
AS_BUILT = ["embed_scale=one", *UNSCALED_GLA]
# variant -> (mixer, learning rate, config overrides (none: today's defaults), patch)
VARIANTS = {
    "hybrid": ("hybrid", 1e-2, UNSCALED_GLA, None),
    "hybrid_as_built": ("hybrid", 1e-2, AS_BUILT, None),
    "hybrid_gla_x0.1": ("hybrid", 1e-2, ["embed_scale=one", "gla_branch_scale=0.1"], None),
    "hybrid_zero_out": ("hybrid", 1e-2, AS_BUILT, "zero_out"),
    "hybrid_attn_first": ("hybrid", 1e-2, AS_BUILT, "attn_first"),
    "hybrid_scaled_gla_x0.1": ("hybrid", 1e-2, [], None),
    "hybrid4": ("hybrid4", 3e-2, UNSCALED_GLA, None),
    "hybrid4_gla_x0.1": ("hybrid4", 1e-2, [], None),
    "hybrid4_gla_x0.2": ("hybrid4", 1e-2, ["gla_branch_scale=0.2"], None),
    "hybrid4_gla_x0.3": ("hybrid4", 1e-2, ["gla_branch_scale=0.3"], None),
    "hybrid4_attn_first": ("hybrid4", 1e-2, UNSCALED_GLA, "attn_first"),
    "attention4": ("attention4", 1e-2, [], None),
    # the second study (s13.5): forms that bound what a GLA branch writes (bench.quality's
    # BRANCH_FORMS), at both rates
    **{
        f"{layout}_{form}{suffix}": (layout, lr, changes, None)
        for layout in ("hybrid", "hybrid4")
        for form, changes in BRANCH_FORMS.items()
        for suffix, lr in (("", 1e-2), ("_lr0.03", 3e-2))
    },
    # the post-norm forms with the GLA layers' W_out at the residual rule's 1 / sqrt(2 L), as
    # the post-norm was first measured (hybrid_branch.json), not at 1 (`mixer_out_init_scale`)
    **{
        f"{layout}_{form}_residual_out": (layout, 1e-2, changes, "residual_out")
        for layout in ("hybrid", "hybrid4")
        for form, changes in BRANCH_FORMS.items()
        if "gla_branch=post_norm" in changes
    },
    # the post-norm at s = 1 with the attention layers' W_out at the fan-in's scale too (as the
    # GLA layers' is under it), not by the residual rule
    **{
        f"{layout}_post_norm_attention_out": (
            layout,
            1e-2,
            BRANCH_FORMS["post_norm"],
            "attention_out",
        )
        for layout in ("hybrid", "hybrid4")
    },
    "laplace": ("gla", 3e-2, [], None),
    "laplace_sqrt_d": ("gla", 3e-2, ["embed_scale=sqrt_d_model"], None),
}


def _attention_first(self) -> tuple[str, ...]:
    k = self.attention_every
    return tuple("attention" if i % k == 0 else "gla" for i in range(self.n_layers))


@contextlib.contextmanager
def applied(patch: str | None):
    """A variant's change to the model, for as long as a run trains and is scored (JAX's caches
    cleared on both sides, so no program traced under another variant is reused)."""
    jax.clear_caches()
    with contextlib.ExitStack() as stack:
        stack.callback(jax.clear_caches)
        if patch == "zero_out":
            zero = property(lambda self: 0.0)
            stack.enter_context(mock.patch.object(LaplaceConfig, "residual_init_scale", zero))
        elif patch == "residual_out":
            residual = lambda self, mixer: self.residual_init_scale  # noqa: E731
            stack.enter_context(mock.patch.object(LaplaceConfig, "mixer_out_init_scale", residual))
        elif patch == "attention_out":
            fan_in = lambda self, mixer: 1.0  # noqa: E731
            stack.enter_context(mock.patch.object(LaplaceConfig, "mixer_out_init_scale", fan_in))
        elif patch == "attn_first":
            first = property(_attention_first)
            stack.enter_context(mock.patch.object(LaplaceConfig, "layer_mixers", first))
        yield


def identity_cosine(variant: str, seed: int = 0, n: int = 64) -> float:
    """At initialisation: the mean cosine between the first attention layer's normalised input
    at a key's pair position and at the same key's query position (MQAR (64, 4))."""
    from laplace_jax.model import init_params
    from laplace_spec.config import get_config
    from train.tasks import mqar

    mixer, lr, changes, patch = VARIANTS[variant]
    spec = mqar_spec(mixer, seed, lr)
    overrides = model_overrides(spec["d_model"], spec["heads"], spec["t_max"])
    overrides += [*MIXER_SETTINGS[mixer], "seq_len=64", *changes]
    tokens, _ = mqar(n, 64, 4, 256, seed=(seed, 64, 4))
    tokens = tokens[:, :-1]
    with applied(patch):
        cfg = get_config("tiny", overrides)
        params = init_params(cfg, jax.random.key(seed))
        x = residual_parts(cfg, params, tokens)[-1]  # the stream the attention layer reads
    return key_query_cosine(x, tokens)


def residual_parts(cfg, params, tokens) -> list:
    """[the scaled embedding, the residual stream after each layer before the first attention
    layer], each [B, T, D] float64 numpy, for `tokens` [B, T]."""
    import jax.numpy as jnp
    import numpy as np

    from laplace_jax.model import LaplaceLM, init_state

    first = cfg.layer_mixers.index("attention")

    def parts(model, tokens):
        x = model.embed(tokens) * cfg.embed_multiplier
        out, state = [x], init_state(cfg, tokens.shape[0])
        for i in range(first):
            x, _ = model.layers[i](x, state[f"layer_{i}"])
            out.append(x)
        return out

    xs = LaplaceLM(cfg).apply({"params": params}, jnp.asarray(tokens), method=parts)
    return [np.asarray(x, np.float64) for x in xs]


def key_query_cosine(x, tokens) -> float:
    """x [B, 63, D]: an attention layer's input on MQAR (64, 4) sequences `tokens`; the mean
    cosine, once normalised as LayerNorm_1 at initialisation does (scale 1, no bias), between a
    key's pair position and each position where that key comes back as a query."""
    import numpy as np

    x = x - x.mean(-1, keepdims=True)
    x = x / np.linalg.norm(x, axis=-1, keepdims=True)
    cosines = []
    for b in range(x.shape[0]):
        for i in range(4):  # pair i: key at 2i; its query where the key comes back after 2P
            later = np.nonzero(tokens[b, 8:] == tokens[b, 2 * i])[0]
            cosines += [float(x[b, 2 * i] @ x[b, 8 + q]) for q in later]
    return statistics.mean(cosines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hybrid_init", description=__doc__)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--only-seeds", help="comma list: these of the --seeds seeds (a subset)")
    ap.add_argument(
        "--reuse-only", action="store_true", help="train nothing: the finished runs' table"
    )
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--work-dir", default="runs/bench-retrieval", help="bench.retrieval's")
    ap.add_argument("--result", default="hybrid_init", help="bench/results/<RESULT>.json")
    args = ap.parse_args(argv)
    variants = chosen(ap, args.variants, VARIANTS, "variant")
    flags = ["--task", "mqar", "--seq-lens", "64,128,256", "--pairs", "4,8,16"]
    seeds = list(range(args.seeds))
    if args.only_seeds:
        seeds = [int(s) for s in args.only_seeds.split(",") if int(s) in seeds]
    rows, t0 = [], time.perf_counter()
    for variant in variants:
        mixer, lr, changes, patch = VARIANTS[variant]
        for seed in seeds:
            spec = mqar_spec(mixer, seed, lr)
            if changes or patch is not None:  # not bench.retrieval's own run
                spec |= {"variant": variant}
            with applied(patch):
                r = run_one(
                    Path(args.work_dir),
                    spec,
                    args.steps,
                    flags,
                    lambda *a: print(*a, flush=True),
                    overrides=changes,
                    reuse_only=args.reuse_only,
                )
            if r is not None:
                rows.append({**r, "variant": variant})
    table = []
    for variant in [v for v in variants if any(r["variant"] == v for r in rows)]:
        runs = [r for r in rows if r["variant"] == variant]
        row = {"variant": variant, "final_loss": [round(r["final_loss"], 4) for r in runs]}
        row["seeds"] = [r["seed"] for r in runs]
        if VARIANTS[variant][0].startswith("hybrid"):
            row["identity_cosine"] = round(identity_cosine(variant), 3)
        for T, P in MQAR_SETTINGS:
            accs = [cell_accuracy(r, seq_len=T, num_pairs=P) for r in runs]
            row[f"{T}_{P}"] = {"seeds": accs, "mean": statistics.mean(accs), "min": min(accs)}
        table.append(row)
        print(
            f"{variant:16s} "
            + "  ".join(
                f"({T},{P}) {row[f'{T}_{P}']['mean']:6.1%} "
                + "/".join(f"{a:.1%}" for a in row[f"{T}_{P}"]["seeds"])
                for T, P in MQAR_SETTINGS
            )
            + f"  loss {row['final_loss']}  cosine at init {row.get('identity_cosine')}",
            flush=True,
        )
    headline = {
        f"mqar_acc_{row['variant']}_{T}_{P}": round(row[f"{T}_{P}"]["mean"], 4)
        for row in table
        for T, P in MQAR_SETTINGS
    }
    print(
        write_result(
            args.result,
            headline,
            steps=args.steps,
            seeds=args.seeds,
            variants={
                v: {"mixer": m, "lr": lr, "overrides": o, "patch": p}
                for v, (m, lr, o, p) in VARIANTS.items()
                if v in variants
            },
            elapsed_s=round(time.perf_counter() - t0, 1),
            train_and_eval_s=round(sum(r["train_s"] + r["eval_s"] for r in rows), 1),
            command=f"python -m bench.hybrid_init {shlex.join(argv or sys.argv[1:])}".strip(),
            table=table,
            runs=rows,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
