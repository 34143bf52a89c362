"""`python -m train.plan`: compile, never run, every program the trainer puts on the devices.

    python -m train.plan --config laplace-3b --devices 64 micro_batch_size=64 [--json]

The configuration flags are `train.main`'s (`--config`, `key=value`, `--mesh` with its `data`,
`fsdp` and `context` axes, `--global-batch-tokens`); `--devices N` simulates N CPU devices (set
before JAX starts). Every input is a `jax.ShapeDtypeStruct` with its sharding, so nothing of the
model's size is allocated: this is how a 3B step for 64 NeuronCores is checked on a 2-core CPU.
For each program (parameter init, optimizer init, the train step with its accumulation, the eval
step, generation prefill and decode) it reports:

- memory per device from XLA's `memory_analysis()` (arguments, outputs, temporaries, aliased,
  peak), against `--hbm-gib` (24 GiB: a trn2 logical NeuronCore at LNC=2);
- collective bytes one device receives per run, by kind, read from the compiled HLO with loop
  trip counts (`laplace_jax/hlo.py`); an all-reduce used only through a dynamic-slice counts as
  the reduce-scatter that GPU/TPU/Neuron compilers form from it (XLA:CPU does not);
- a Neuron census (conditionals, loops without a static trip count, custom calls and host
  callbacks, variadic reductions, sort comparators, f64/int64 tensors, RNG algorithm).

For the train step it adds the FSDP ideal (docs/design.md s8: weights gathered in the compute dtype
for the forward and again for the rematerialised backward, gradients reduce-scattered in fp32:
8 P (n-1)/n bytes per micro-step in bf16, 12 P (n-1)/n in fp32, over a gather group of n, the
`fsdp` devices, or `fsdp x context` with a context axis, plus on a `data x fsdp` mesh the
all-reduce of each fp32 gradient shard across `data` once per step, plus Muon's two all_to_alls
once per step; all counted as bytes received). With a context axis (docs/design.md s11) the
slices' exchange is reported as its own collective kind, `context-exchange` (the collectives
traced under laplace_jax/context_parallel.py's name scopes), beside its ideal: the S - 1 states
of H x dk x dv fp32 a device receives per layer and per sequence it holds a slice of, forward
and backward (the conv windows and the slices' decays, which it also receives, are small and
not in the ideal). How many exchanges a program runs is counted by kind (`context_exchanges`:
the GLA states, per layer; the decays, once per step; the conv windows, per layer), and the
headline adds `context_exchange_over_ideal`, `context_exchanges_per_step_{state,decay,conv}`,
and the plan `tokens_per_device`. Then the training
FLOPs per step (6 x parameters x tokens, the write-up's count), and a modelled trn2 step time:
a floor from stated assumptions (`TRN2`), the step's FLOPs at the Tensor Engine's peak plus its
collective bytes at NeuronLink's bandwidth, not overlapped; no measured step goes into it.

The programs are compiled as the Neuron launcher runs them (`train.neuron launch`): its settings
(`LAUNCH_SETTINGS`: the unrolled chunk scan, parameters initialised on the host CPU) are added
unless the command line sets them, and parameter init uses the rbg PRNG, as train.main does on
the neuron backend. The verdict and the headline's census count only the programs that run on
the devices; the host-side programs (the init, and the end-of-run sample's prefill and decode,
on the host as train.main runs them beside the CPU backend) are listed, marked as such.
Compiled here, on XLA:CPU: what the Neuron compiler makes of the same program (fusion, memory
planning) can differ; nothing here ran on Trainium.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from train.neuron import LAUNCH_SETTINGS, unset_settings
from train.peak import NEURON_CORE_PEAK

GIB = 1024**3
CENSUS_VIOLATIONS = (
    "conditionals",
    "while_loops_without_static_trip_count",
    "custom_call_targets",
    "host_callbacks",
    "variadic_reductions",
    "f64_tensors",
    "int64_tensors",
)

# Assumptions of the modelled trn2 step time, a floor (all stated in the output). Nothing here
# is fitted to a measured step: compute runs at the Tensor Engine's peak and collectives at the
# link's bandwidth, one after the other.
TRN2 = {
    # peak dense bf16 of a logical NeuronCore at LNC=2 (train/peak.py's table and sources:
    # 667 TFLOP/s per Trainium2 chip, 4 logical cores each; 64 on a trn2.48xlarge)
    "bf16_flops_per_s_per_core": NEURON_CORE_PEAK["trn2-lnc2"],
    # the share of that peak the compute term assumes: 1, so the step time is a floor
    "flops_utilisation": 1.0,
    # NeuronLink-v3 bandwidth per device (1.28 TB/s, the write-up's figure for its collectives)
    "link_bytes_per_s": 1.28e12,
    "collectives_overlapped": False,
}


def with_launch_settings(overrides: list[str]) -> list[str]:
    """`overrides` with the Neuron launcher's settings added where they do not set them."""
    return [*unset_settings(overrides, LAUNCH_SETTINGS), *overrides]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m train.plan", description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    ap.add_argument("--config", default="small", help="a preset, or a YAML or JSON config file")
    ap.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step")
    ap.add_argument("--mesh", help="fsdp=F[,data=D][,context=S] (default: all devices, fsdp)")
    ap.add_argument("--devices", type=int, help="simulate N CPU devices (before JAX starts)")
    ap.add_argument("--hbm-gib", type=float, default=24.0, help="memory budget per device")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap.parse_intermixed_args(argv)


def simulate_devices(n: int) -> None:
    """Ask XLA for n host devices; must happen before JAX initialises its backends."""
    if "jax" in sys.modules:
        import jax

        if jax.device_count() != n:
            raise SystemExit(f"error: --devices {n}: JAX already started with {jax.device_count()}")
        return
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def make_plan(cfg, mesh, hbm_gib: float = 24.0) -> dict:
    """Compile every device program of a run of `cfg` (train.config.RunConfigs) on `mesh`."""
    import jax
    import jax.numpy as jnp

    from laplace_jax import hlo, muon_accounting
    from laplace_jax.accounting import (
        attention_share,
        parameter_counts,
        training_flops_per_token,
    )
    from laplace_jax.context_parallel import (
        EXCHANGE,
        EXCHANGE_CONV,
        EXCHANGE_DECAY,
        EXCHANGE_STATE,
    )
    from laplace_jax.generate import decode, next_token_by_recompute, prefill
    from laplace_jax.model import init_params, init_state
    from laplace_jax.optim import muon_plan
    from laplace_jax.sharding import (
        CONTEXT,
        DATA,
        axis_size,
        logical_sharding,
        one_device,
        param_axes,
        replicated,
    )
    from train.build import build_model
    from train.config import batch_layout
    from train.step import EVAL_BATCH_AXES, TRAIN_BATCH_AXES

    m, n = cfg.model, mesh.size
    context, attention = mesh.shape.get(CONTEXT, 1), "attention" in m.layer_mixers
    B, A, M = batch_layout(cfg.train, m.seq_len, n, context=context, attention=attention)
    t = cfg.train  # packed documents: the plan compiles the resets a run on such data makes
    eot_id = t.eot_id if t.doc_reset != "off" and t.eot_id >= 0 else None
    parts = build_model(cfg, mesh, eot_id=eot_id)
    abs_params = parts["abs_params"]
    tokens = lambda shape, axes: jax.ShapeDtypeStruct(  # noqa: E731
        shape, jnp.int32, sharding=logical_sharding(mesh, axes) if axes else replicated(mesh)
    )
    state = {
        "params": abs_params,
        "opt_state": parts["abs_opt"],
        "bad_streak": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated(mesh)),
    }
    key = jax.eval_shape(lambda: jax.random.key(0, impl="rbg"))  # train.main's PRNG on Neuron
    prompt = min(m.chunk_size, m.seq_len)
    # the end-of-run sample runs on one device (train.loop.sample_params): so is it compiled;
    # under the launcher's setting (init_on_host: JAX's CPU backend is there) it is the host's
    on_one = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device()), tree
    )
    sample_params = on_one(abs_params)
    abs_state = on_one(jax.eval_shape(lambda: init_state(m, 1)))
    sample_tokens = lambda shape: on_one(jax.ShapeDtypeStruct(shape, jnp.int32))  # noqa: E731
    if t.init_on_host:  # the launcher's setting: one unsharded program on the host CPU, as
        init = jax.jit(lambda k: init_params(m, k))  # train.build.init_params_on_host runs it
    else:
        init = jax.jit(lambda k: init_params(m, k), out_shardings=parts["p_shard"])
    programs = {
        "init_params": lambda: init.lower(key),
        "init_optimizer": lambda: jax.jit(parts["tx"].init, out_shardings=parts["o_shard"]).lower(
            abs_params
        ),
        "train_step": lambda: parts["train_step"].lower(
            state, tokens((A, M, m.seq_len + 1), TRAIN_BATCH_AXES)
        ),
        "eval_step": lambda: parts["eval_step"].lower(
            abs_params, tokens((M, m.seq_len + 1), EVAL_BATCH_AXES)
        ),
    }
    if "attention" in m.layer_mixers:  # no decode step: each token recomputes the sequence
        n_sample = prompt + t.sample_tokens
        generate = {
            "generate_recompute": lambda: next_token_by_recompute.lower(
                m, sample_params, sample_tokens((1, n_sample)), prompt - 1
            )
        }
    else:
        generate = {
            "generate_prefill": lambda: prefill.lower(m, sample_params, sample_tokens((1, prompt))),
            "generate_decode": lambda: decode.lower(
                m, sample_params, sample_tokens((1,)), abs_state
            ),
        }
    programs.update(generate)
    # where each program runs: the mesh's devices, but for these
    sample_on = "host" if t.init_on_host else "one device"
    runs_on = {name: sample_on for name in generate}
    if t.init_on_host:
        runs_on["init_params"] = "host"
    report = {}
    exchanges = {"state": EXCHANGE_STATE, "decay": EXCHANGE_DECAY, "conv": EXCHANGE_CONV}
    for name, lower in programs.items():
        t0 = time.perf_counter()
        compiled = lower().compile()
        text = compiled.as_text()
        collectives = hlo.collectives(text, n)
        scopes = {"context-exchange": EXCHANGE}  # the slices' exchange, its own kind
        report[name] = {
            "compile_s": round(time.perf_counter() - t0, 1),
            "memory": memory(compiled, hbm_gib),
            "collectives": hlo.collective_bytes(collectives, scopes=scopes),
            "collectives_as_compiled_here": hlo.collective_bytes(
                collectives, target_forms_reduce_scatter=False, scopes=scopes
            ),
            "census": hlo.neuron_census(text),
            "runs_on": runs_on.get(name, "devices"),
            "context_exchanges": hlo.collective_executions(collectives, exchanges),
        }

    P = parameter_counts(m)["total_params"]
    f, d = axis_size(mesh, param_axes(mesh)), mesh.shape.get(DATA, 1)  # f: fsdp (x context)
    S = mesh.shape.get(CONTEXT, 1)
    muon_received = muon_accounting.bytes_per_device(muon_plan(cfg.optim, abs_params, mesh)) // 2
    gathered = jnp.dtype(m.compute_dtype).itemsize  # weights travel in the compute dtype
    fsdp_micro = (2 * gathered + 4) * P * (f - 1) // f  # gathers twice + fp32 reduce-scatter
    data_step = 2 * (4 * P // f) * (d - 1) // d  # all-reduce of the fp32 gradient shard
    # docs/design.md s11: the S - 1 other slices' states of H x dk x dv fp32 per layer and
    # sequence, forward and backward, for each sequence a device holds a slice of (0 without a
    # context axis)
    local_sequences = M * S // n
    gla_states = m.state_bytes_per_sequence()["gla"]  # all GLA layers' H x dk x dv x 4 bytes
    exchange_micro = 2 * local_sequences * (S - 1) * gla_states
    ideal = {"fsdp_per_micro_step": fsdp_micro, "data_parallel": data_step}
    ideal["muon_a2a"] = muon_received
    ideal["context_exchange_per_micro_step"] = exchange_micro
    ideal["total"] = A * (fsdp_micro + exchange_micro) + data_step + muon_received
    step = report["train_step"]
    step_tokens = B * m.seq_len
    flops = 6 * P * step_tokens
    # 6 P + the token mixers' own terms, the attention's over the share of the square its
    # context form scores (laplace_jax/accounting.py)
    share = attention_share(cfg.train.attention_context, S) if attention else 1.0
    model_flops = training_flops_per_token(m, share) * step_tokens
    peak = TRN2["bf16_flops_per_s_per_core"] * TRN2["flops_utilisation"]
    compute_s = model_flops / n / peak
    comm_s = step["collectives"]["total"] / TRN2["link_bytes_per_s"]
    train_gib = step["memory"]["peak"] / GIB
    headline = {
        "train_step_gib_per_device": round(train_gib, 3),
        "train_step_fits_24gib": int(train_gib <= 24.0),
        "train_step_fits_16gib": int(train_gib <= 16.0),  # issue 8's margin
        "collective_bytes_over_fsdp_ideal": round(step["collectives"]["total"] / ideal["total"], 3),
        "neuron_census_violations": sum(
            p["census"]["violations"] for p in report.values() if p["runs_on"] != "host"
        ),
        "modelled_trn2_step_s": round(compute_s + comm_s, 3),
        "train_flops_per_step": float(flops),
    }
    if S > 1:  # the slices' exchange against its ideal (docs/design.md s11)
        exchanged = step["collectives"]["context-exchange"]
        headline["context_exchange_over_ideal"] = round(exchanged / (A * exchange_micro), 3)
        for kind, count in step["context_exchanges"].items():
            headline[f"context_exchanges_per_step_{kind}"] = count
    return {
        "headline": headline,
        "config": {
            "model": m.to_dict(),
            "train": cfg.train.to_dict(),
            "optim": cfg.optim.to_dict(),
        },
        "mesh": dict(mesh.shape),
        "batch": {
            "sequences": B,
            "accum_steps": A,
            "micro_batch": M,
            "tokens": step_tokens,
            "tokens_per_device": M * m.seq_len // n,  # of a micro-batch
        },
        "parameters": P,
        "hbm_gib": hbm_gib,
        "programs": report,
        "fsdp_ideal_bytes_received": ideal,
        "flops": {
            "six_p_tokens": flops,
            "with_mixer_terms": model_flops,
            "attention_share_of_square": share,
        },
        "modelled_trn2": {
            "kind": "floor: the step's FLOPs at peak plus its collectives at link bandwidth",
            "assumptions": TRN2,
            "computed": {
                "flops_per_device": model_flops / n,
                "collective_bytes": step["collectives"]["total"],
            },
            "compute_s": compute_s,
            "collective_s_not_overlapped": comm_s,
            "step_s": compute_s + comm_s,
        },
        "notes": [
            "compiled for simulated CPU devices with abstract inputs; never run on Trainium",
            "collective bytes are bytes received per device per program run (rings send as many);"
            " an all-reduce used only through a dynamic-slice counts as a reduce-scatter",
        ],
    }


def memory(compiled, hbm_gib: float) -> dict:
    """Bytes per device from XLA's memory analysis, and the verdict against the budget."""
    ma = compiled.memory_analysis()
    out = {
        "arguments": ma.argument_size_in_bytes,
        "outputs": ma.output_size_in_bytes,
        "temporaries": ma.temp_size_in_bytes,
        "aliased": ma.alias_size_in_bytes,
    }
    total = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
    out["peak"] = max(getattr(ma, "peak_memory_in_bytes", 0) or 0, total)
    out["fits"] = out["peak"] <= hbm_gib * GIB
    return out


def print_table(plan: dict) -> None:
    b, h = plan["batch"], plan["headline"]
    print(
        f"mesh {plan['mesh']}; batch {b['sequences']} x {plan['config']['model']['seq_len']} "
        f"tokens (accum {b['accum_steps']} x micro {b['micro_batch']}); "
        f"{plan['parameters']:,} parameters; budget {plan['hbm_gib']:g} GiB per device"
    )
    head = f"{'program':18s} {'args':>8s} {'temps':>8s} {'peak GiB':>9s} {'fits':>5s}"
    head += f" {'gather':>9s} {'red-scat':>9s} {'all-red':>9s} {'a2a':>9s} {'ctx-exch':>9s}"
    head += f" {'census':>7s}"
    print(head + "   (memory GiB per device; collectives MB received per device)")
    for name, p in plan["programs"].items():
        mem, col = p["memory"], p["collectives"]
        print(
            f"{name:18s} {mem['arguments'] / GIB:8.2f} {mem['temporaries'] / GIB:8.2f} "
            f"{mem['peak'] / GIB:9.2f} {'yes' if mem['fits'] else 'NO':>5s} "
            f"{col['all-gather'] / 1e6:9.1f} {col['reduce-scatter'] / 1e6:9.1f} "
            f"{col['all-reduce'] / 1e6:9.1f} {col['all-to-all'] / 1e6:9.1f} "
            f"{col['context-exchange'] / 1e6:9.1f} {p['census']['violations']:7d}"
        )
    ideal, model = plan["fsdp_ideal_bytes_received"], plan["modelled_trn2"]
    print(
        f"train step collectives {plan['programs']['train_step']['collectives']['total'] / 1e9:.2f}"
        f" GB vs FSDP ideal {ideal['total'] / 1e9:.2f} GB: "
        f"{h['collective_bytes_over_fsdp_ideal']:.2f}x"
    )
    if "context_exchange_over_ideal" in h:
        exchanged = plan["programs"]["train_step"]["collectives"]["context-exchange"]
        exchange_ideal = ideal["context_exchange_per_micro_step"] * b["accum_steps"]
        print(
            f"context exchange {exchanged / 1e6:.1f} MB vs its ideal {exchange_ideal / 1e6:.1f} MB "
            "((S - 1) x H x dk x dv x 4 bytes per layer and sequence, forward and backward): "
            f"{h['context_exchange_over_ideal']:.2f}x"
        )
        counts = plan["programs"]["train_step"]["context_exchanges"]
        print(
            "context exchanges per step: "
            + ", ".join(f"{kind} {n}" for kind, n in counts.items())
            + " (collectives run, forward and backward)"
        )
    print(
        f"training FLOPs per step {h['train_flops_per_step']:.3e}; modelled trn2 step, a floor: "
        f"{model['step_s']:.2f} s (compute {model['compute_s']:.2f} s at the bf16 peak + "
        f"collectives {model['collective_s_not_overlapped']:.3f} s at link bandwidth, "
        "not overlapped)"
    )
    for name, p in plan["programs"].items():
        c = p["census"]
        if c["violations"]:
            bad = {k: c[k] for k in CENSUS_VIOLATIONS if c[k]}
            where = " (runs on the host, not a Neuron program)" if p["runs_on"] == "host" else ""
            print(f"Neuron census, {name}{where}: {bad}")
    fits = "fits" if h["train_step_fits_24gib"] else "does NOT fit"
    margin = "yes" if h["train_step_fits_16gib"] else "NO"
    print(
        f"verdict: the train step {fits} in 24 GiB per device "
        f"({h['train_step_gib_per_device']:.2f} GiB; within the 16 GiB margin: {margin}); "
        f"Neuron census of the device programs: {h['neuron_census_violations']}"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.devices:
        simulate_devices(args.devices)
    from laplace_spec.config import ConfigError
    from train import config as train_config
    from train.cli import mesh_from_flag

    try:
        cfg = train_config.resolve(
            args.config,
            with_launch_settings(args.overrides),
            {"global_batch_tokens": args.global_batch_tokens},
        )
        mesh = mesh_from_flag(args.mesh)
        plan = make_plan(cfg, mesh, args.hbm_gib)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan))
    else:
        print_table(plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
