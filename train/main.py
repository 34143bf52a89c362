"""Train a Laplace model: `python -m train.main [--config PRESET|file.json] [key=value ...]`.

With no arguments: the `small` preset on the embedded default corpus (the interpreter's standard
library, BPE-tokenised and cached on first use), on every device JAX sees, for a few minutes on
a CPU; it ends by printing a greedy sample. A run directory (default `runs/default`) holds
`metrics.jsonl`, `checkpoints/`, `config.json` and `tokenizer.json`; running again with the same
directory resumes from its newest good checkpoint on exactly the next batch.

`key=value` overrides go to the model config (LaplaceConfig), the optimizer config
(OptimizerConfig) or the training config (TrainConfig), whichever has the key; prefix it with
`model.`, `optim.` or `train.` when a name is ambiguous. Unknown keys are errors.

Several hosts: set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (or pass
`--distributed` where JAX detects the cluster itself, e.g. SLURM or Cloud TPU); each process reads
its own share of the data windows.
"""

from __future__ import annotations

import logging

from absl import logging as absl_logging

absl_logging.set_verbosity(absl_logging.ERROR)  # grain and orbax are chatty at import

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from laplace_jax.config import PRESETS, ConfigError, LaplaceConfig, get_config, parse_overrides  # noqa: E402
from train import optimizer as optim  # noqa: E402
from train.checkpoint import (  # noqa: E402
    Checkpointer,
    ConfigMismatch,
    abstract_with_shardings,
    config_diff,
)
from train.config import TrainConfig, batch_layout, train_preset  # noqa: E402

log = logging.getLogger("train")


# ---- command line ---------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m train.main",
        description="Train a Laplace GLA language model (defaults: small preset, stdlib corpus).",
    )
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    ap.add_argument("--config", default="small", help="model preset or JSON file")
    ap.add_argument("--data", help="glob of training token shards (default: stdlib corpus)")
    ap.add_argument("--val-data", help="glob of validation shards (default: none with --data)")
    ap.add_argument("--tokenizer", help="tokenizer.json of --data (for the sample, copied to run)")
    ap.add_argument("--steps", type=int, help="train until this step")
    ap.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step")
    ap.add_argument("--mesh", help="fsdp=N: use N devices (default: all)")
    ap.add_argument("--run-dir", default="runs/default", help="run directory")
    ap.add_argument("--ckpt-dir", help="checkpoint directory (default: RUN_DIR/checkpoints)")
    ap.add_argument("--ckpt-every", type=int, help="steps between checkpoints")
    ap.add_argument("--log-every", type=int, help="steps between metrics lines")
    ap.add_argument("--distributed", action="store_true", help="jax.distributed.initialize()")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    # test hook: SIGKILL this process after the given step (a crash between checkpoints)
    ap.add_argument("--debug-sigkill-at-step", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--debug-nan-at-step", type=int, action="append", help=argparse.SUPPRESS)
    return ap.parse_intermixed_args(argv)


def split_overrides(items: list[str], opt_fields: set[str]):
    """Route `key=value` strings to the model, optimizer and training configs."""
    model_fields = {f.name for f in dataclasses.fields(LaplaceConfig)}
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    prefixes = {"model": model_fields, "optim": opt_fields, "train": train_fields}
    routed: dict[str, list[str]] = {k: [] for k in prefixes}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        prefix, dot, name = key.partition(".")
        if dot and prefix in prefixes:
            if name not in prefixes[prefix]:
                raise ConfigError(f"unknown {prefix} config key {name!r}")
            routed[prefix].append(f"{name}={value}")
            continue
        owners = [p for p, fields in prefixes.items() if key in fields]
        if not owners:
            known = sorted(model_fields | opt_fields | train_fields)
            raise ConfigError(f"unknown config key {key!r} (known: {', '.join(known)})")
        if len(owners) > 1:
            raise ConfigError(
                f"config key {key!r} is ambiguous ({', '.join(owners)}): write e.g. "
                f"{owners[0]}.{key}={value}"
            )
        routed[owners[0]].append(f"{key}={value}")
    return routed


def resolve_configs(args):
    routed = split_overrides(args.overrides, optim.optimizer_fields())
    model_cfg = get_config(args.config, routed["model"])
    preset = args.config if args.config in PRESETS else "small"
    train_over = parse_overrides(routed["train"], TrainConfig)
    for flag, key in (
        ("steps", "steps"),
        ("global_batch_tokens", "global_batch_tokens"),
        ("ckpt_every", "ckpt_every"),
        ("log_every", "log_every"),
    ):
        if getattr(args, flag) is not None:
            train_over[key] = getattr(args, flag)
    train_cfg = dataclasses.replace(train_preset(preset), **train_over)
    opt_cfg = optim.optimizer_config(preset, routed["optim"], train_cfg.steps)
    return model_cfg, opt_cfg, train_cfg


def parse_mesh(spec: str | None) -> int | None:
    if spec is None:
        return None
    key, sep, value = spec.partition("=")
    if key != "fsdp" or not sep or not value.isdigit():
        raise ConfigError(f"--mesh expects fsdp=N, got {spec!r}")
    return int(value)


def maybe_initialize_distributed(force: bool) -> None:
    env = os.environ
    if "JAX_COORDINATOR_ADDRESS" in env:
        jax.distributed.initialize(
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(env.get("JAX_NUM_PROCESSES", "1")),
            process_id=int(env.get("JAX_PROCESS_ID", "0")),
        )
    elif force:
        jax.distributed.initialize()


# ---- metrics --------------------------------------------------------------------------------


class Metrics:
    """metrics.jsonl (process 0 only), plus TensorBoard when tensorboardX is installed."""

    def __init__(self, run_dir: Path, keep_until_step: int, enabled: bool):
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        self.tb = None
        if not enabled:
            return
        # a resumed run drops what the crashed run logged after its checkpoint
        lines = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= keep_until_step:
                        lines.append(line)
                except json.JSONDecodeError:
                    pass  # a line cut by a crash
        self.path.write_text("".join(line + "\n" for line in lines))
        try:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:
            pass

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, int | float):
                    self.tb.add_scalar(k, v, record["step"])

    def close(self):
        if self.tb is not None:
            self.tb.close()


# ---- the run --------------------------------------------------------------------------------


def run(args) -> int:
    maybe_initialize_distributed(args.distributed)
    if jax.default_backend() == "neuron":
        jax.config.update("jax_default_prng_impl", "rbg")  # Threefry is not fully supported

    from laplace_jax.accounting import parameter_counts, training_flops_per_token
    from laplace_jax.model import LaplaceLM, abstract_params, init_params
    from laplace_jax.sharding import make_mesh, param_shardings
    from train import data as data_lib
    from train.step import make_eval_step, make_train_step, measure_matmul_flops

    model_cfg, opt_cfg, tcfg = resolve_configs(args)
    unroll = tcfg.scan_unroll or jax.default_backend() == "neuron"
    proc, nproc = jax.process_index(), jax.process_count()
    main_proc = proc == 0
    say = print if main_proc else (lambda *a, **k: None)

    run_dir = Path(args.run_dir)
    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else run_dir / "checkpoints"
    run_dir.mkdir(parents=True, exist_ok=True)

    # data and tokenizer
    if args.data:
        train_paths = data_lib.expand_shards(args.data)
        val_paths = data_lib.expand_shards(args.val_data) if args.val_data else []
        tokenizer_src = Path(args.tokenizer) if args.tokenizer else None
    else:
        from train.corpus import default_data

        train_paths, val_paths, tokenizer_src = default_data(model_cfg.vocab_size, main_proc)
    if tokenizer_src is not None:
        from tokenizers import Tokenizer

        tok_vocab = Tokenizer.from_file(str(tokenizer_src)).get_vocab_size()
        if tok_vocab > model_cfg.vocab_size:
            raise ConfigError(
                f"tokenizer {tokenizer_src} has {tok_vocab} tokens, more than the model's "
                f"vocab_size {model_cfg.vocab_size}"
            )

    mesh = make_mesh(parse_mesh(args.mesh))
    n_dev = mesh.shape["fsdp"]
    B, A, M = batch_layout(tcfg, model_cfg.seq_len, n_dev, nproc)
    train_src = data_lib.TokenWindows(train_paths, model_cfg.seq_len)
    dataset = data_lib.train_dataset(train_src, B // nproc, tcfg.seed, proc, nproc)
    batches = data_lib.BatchIterator(dataset, A)
    val_batches = []
    if val_paths:
        val_src = data_lib.TokenWindows(val_paths, model_cfg.seq_len)
        val_batches = data_lib.eval_batches(val_src, M // nproc, tcfg.eval_batches, proc, nproc)

    # model, optimizer, shardings
    model = LaplaceLM(model_cfg, unroll=unroll)
    p_shard = param_shardings(model_cfg, mesh)
    abs_params = abstract_with_shardings(abstract_params(model_cfg), p_shard)
    tx, lr_schedule, o_shard = optim.build(opt_cfg, abs_params, p_shard, mesh)
    abs_opt = jax.eval_shape(tx.init, abs_params)
    train_step, state_shard = make_train_step(model, tx, mesh, p_shard, o_shard, tcfg.grad_clip)
    eval_step = make_eval_step(model, mesh, p_shard)

    requested = {"model": model_cfg.to_dict()}
    opt_dict = opt_cfg.to_dict()
    ckpt = Checkpointer(ckpt_dir, keep=tcfg.keep_checkpoints, async_save=tcfg.async_checkpoints)
    restored = ckpt.restore_latest(abs_params, abstract_with_shardings(abs_opt, o_shard), requested)
    if restored is not None:
        start = restored["step"]
        params, opt_state = restored["params"], restored["opt_state"]
        batches.set_state(restored["data"])
        for line in config_diff(restored["meta"].get("optimizer", {}), opt_dict):
            say(f"note: optimizer config changed since the checkpoint: {line}")
        say(f"resumed from {ckpt_dir / str(start)} at step {start}")
    else:
        start = 0
        key = jax.random.key(tcfg.seed)
        params = jax.jit(lambda k: init_params(model_cfg, k), out_shardings=p_shard)(key)
        opt_state = jax.jit(tx.init, out_shardings=o_shard)(params)
    state = {
        "params": params,
        "opt_state": opt_state,
        "bad_streak": jax.device_put(jnp.zeros((), jnp.int32), state_shard["bad_streak"]),
    }

    # run directory: config, tokenizer, metrics
    tokenizer_ref = None
    if tokenizer_src is not None:
        tokenizer_ref = str((run_dir / "tokenizer.json").absolute())
        if main_proc and Path(tokenizer_src).resolve() != Path(tokenizer_ref).resolve():
            shutil.copyfile(tokenizer_src, tokenizer_ref)
    run_config = {
        "model": model_cfg.to_dict(),
        "optimizer": opt_dict,
        "train": tcfg.to_dict(),
        "data": {"train": train_paths, "val": val_paths, "train_tokens": train_src.num_tokens},
        "tokenizer": tokenizer_ref,
        "tokenizer_source": str(tokenizer_src) if tokenizer_src else None,
        "mesh": {"fsdp": n_dev},
        "processes": nproc,
        "batch": {"sequences": B, "accum_steps": A, "micro_batch": M},
    }
    if main_proc:
        (run_dir / "config.json").write_text(json.dumps(run_config, indent=2))
    meta = {k: run_config[k] for k in ("model", "optimizer", "train", "tokenizer")}
    meta["tokenizer_source"] = run_config["tokenizer_source"]
    meta["config"] = meta["model"]  # the name export/ looks for first
    metrics = Metrics(run_dir, start, main_proc)

    flops_per_token = training_flops_per_token(model_cfg)
    peak = tcfg.peak_flops or measure_matmul_flops(mesh)
    tokens_per_step = B * model_cfg.seq_len
    say(
        f"model {args.config}: {model_cfg.d_model}d x {model_cfg.n_layers}L, "
        f"{parameter_counts(model_cfg)['total_params'] / 1e6:.1f}M params; "
        f"mesh fsdp={n_dev} ({jax.default_backend()}); "
        f"batch {B} x {model_cfg.seq_len} tokens (accum {A} x micro {M}); "
        f"{train_src.num_tokens:,} training tokens; matmul peak {peak / 1e9:.1f} GFLOP/s"
    )

    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "fsdp"))
    global_shape = (A, M, model_cfg.seq_len + 1)
    nan_steps = set(args.debug_nan_at_step or [])
    bar = tqdm(
        total=tcfg.steps, initial=start, disable=not main_proc or args.no_progress, unit="step"
    )
    window_tokens, window_time = 0, 0.0
    status = 0
    val_loss = None
    for step in range(start, tcfg.steps):
        t_step = time.perf_counter()  # step time: data, dispatch, compute (not eval or saves)
        local = next(batches)
        if step + 1 in nan_steps:  # test hook: out-of-range ids make the loss NaN
            local = np.full_like(local, -(2**30))
        batch = jax.make_array_from_process_local_data(batch_sharding, local, global_shape)
        state, m = train_step(state, batch)
        m = jax.device_get(m)
        done = step + 1
        if step > start:  # the first step of a process includes compilation
            window_tokens += tokens_per_step
            window_time += time.perf_counter() - t_step

        if not m["applied"]:
            say(
                f"\nstep {done}: loss {m['loss']} / grad norm {m['grad_norm']} not finite; "
                f"update skipped ({m['bad_streak']} in a row)"
            )

        is_last = done == tcfg.steps
        if tcfg.eval_every and val_batches and (done % tcfg.eval_every == 0 or is_last):
            val_loss = _evaluate(eval_step, state["params"], val_batches, mesh, M, model_cfg)
        elif is_last and val_batches:
            val_loss = _evaluate(eval_step, state["params"], val_batches, mesh, M, model_cfg)

        first = step == start
        if (
            done % tcfg.log_every == 0
            or first
            or is_last
            or val_loss is not None
            or not m["applied"]
        ):
            if not tcfg.peak_flops and not first:
                # the best matmul rate seen so far: on a shared machine a busy moment at start
                # would otherwise overstate MFU
                peak = max(peak, measure_matmul_flops(mesh, reps=2))
            tps = window_tokens / window_time if window_time > 0 else float("nan")
            record = {
                "step": done,
                "loss": float(m["loss"]),
                "grad_norm": float(m["grad_norm"]),
                "lr": float(lr_schedule(done - 1)),
                "tokens_per_s": tps,
                "mfu": tps * flops_per_token / peak,
                "applied": bool(m["applied"]),
                "tokens": done * tokens_per_step,
            }
            if val_loss is not None:
                record["val_loss"] = val_loss
            metrics.write({k: _json_num(v) for k, v in record.items()})
            post = {"loss": f"{record['loss']:.3f}", "tok/s": f"{tps:,.0f}"}
            post["mfu"] = f"{record['mfu']:.1%}"
            if val_loss is not None:
                post["val"] = f"{val_loss:.3f}"
            bar.set_postfix(post, refresh=False)
            val_loss = None
            window_tokens, window_time = 0, 0.0
        bar.update(1)

        if m["bad_streak"] >= tcfg.max_bad_steps:
            ckpt.wait()
            last_good = ckpt.all_steps()[-1] if ckpt.all_steps() else None
            say(
                f"\nstopping: {m['bad_streak']} non-finite steps in a row "
                f"(max_bad_steps={tcfg.max_bad_steps}); last good checkpoint: "
                f"{ckpt_dir / str(last_good) if last_good is not None else 'none'}"
            )
            status = 2
            break

        if (done % tcfg.ckpt_every == 0 or is_last) and m["bad_streak"] == 0:
            ckpt.save(done, state["params"], state["opt_state"], batches.get_state(), meta)

        if args.debug_sigkill_at_step == done:
            os.kill(os.getpid(), signal.SIGKILL)
    bar.close()
    ckpt.close()
    metrics.close()

    if status == 0 and tcfg.sample_tokens and tokenizer_src is not None:
        params = state["params"]
        if nproc > 1:  # the params span several hosts: gather a full copy (a collective)
            from jax.experimental import multihost_utils

            params = multihost_utils.process_allgather(params, tiled=True)
        if main_proc:
            print_sample(params, model_cfg, tokenizer_src, tcfg)
    return status


def _evaluate(eval_step, params, val_batches, mesh, M, cfg) -> float:
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    losses = [
        eval_step(params, jax.make_array_from_process_local_data(sharding, b, (M, cfg.seq_len + 1)))
        for b in val_batches
    ]
    return float(np.mean(jax.device_get(losses)))


def print_sample(params, cfg, tokenizer_path, tcfg) -> None:
    from tokenizers import Tokenizer

    from laplace_jax.generate import greedy_generate

    tok = Tokenizer.from_file(str(tokenizer_path))
    prompt = tok.encode(tcfg.sample_prompt, add_special_tokens=False).ids or [0]
    new = greedy_generate(params, cfg, np.array(prompt, np.int32), tcfg.sample_tokens)
    text = tok.decode(list(prompt) + [int(t) for t in new])
    print(f"greedy sample ({tcfg.sample_tokens} tokens):\n{text}")


def _json_num(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    try:
        status = run(args)
    except (ConfigError, ConfigMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if jax.process_index() == 0:
        print(f"wall time {time.perf_counter() - t0:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
