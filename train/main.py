"""Train a Laplace model: `python -m train.main [--config PRESET|file.json] [key=value ...]`.

With no arguments: the `small` preset on the embedded default corpus (the interpreter's standard
library, BPE-tokenised and cached on first use), on every device JAX sees, for a few minutes on
a CPU; it ends by printing a greedy sample. A run directory (default `runs/default`) holds
`metrics.jsonl`, `checkpoints/`, `config.json` and `tokenizer.json`; running again with the same
directory resumes from its newest good checkpoint on exactly the next batch. What a crashed run
logged after that checkpoint is moved from `metrics.jsonl` to `metrics.superseded.jsonl` (each
line with `superseded_at`), so `metrics.jsonl` is one clean curve and no logged line is lost.

When no checkpoint can be restored (every one corrupt) the run stops with status 2 and changes
nothing; `--restart` starts over at step 0 after moving the checkpoints and metrics into
`RUN_DIR/restarted-<time>/`.

`key=value` overrides go to the model config (LaplaceConfig), the optimizer config
(OptimizerConfig) or the training config (TrainConfig), whichever has the key; prefix it with
`model.`, `optim.` or `train.` when a name is ambiguous. Unknown keys are errors. Whatever the
trainer chooses for the user (presets of a JSON model, the schedule fitted to the run, parameters
replicated because they do not divide over the mesh) is printed as a `note:` line at start-up.

`--task NAME[:key=value,...]` trains on a synthetic retrieval task instead of token shards
(train/tasks.py): `mqar[:num_pairs=4,vocab_size=V,power_a=0.01]` or
`passkey[:depth=0.5,vocab_size=V,num_digits=5]`, at the model's seq_len, vocab_size defaulting
to the model's. Batches are generated from (seed, step, process), so a resumed run continues the
same sequence; the loss counts the answer positions only; there is no validation loss or sample.

Several hosts: set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (or pass
`--distributed` where JAX detects the cluster itself, e.g. SLURM or Cloud TPU); each process reads
its own share of the data windows.

Tests and tools drive the loop in-process through `Hooks` (`main(argv, hooks=...)`), which are
not on the command line.
"""

from __future__ import annotations

from absl import logging as absl_logging

absl_logging.set_verbosity(absl_logging.ERROR)  # grain and orbax are chatty at import

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from tqdm import tqdm  # noqa: E402

from laplace_jax.sharding import (  # noqa: E402
    DATA,
    FSDP,
    abstract_with_shardings,
    logical_sharding,
)
from laplace_spec.config import ConfigError  # noqa: E402
from train import config as train_config  # noqa: E402
from train.checkpoint import (  # noqa: E402
    Checkpointer,
    DiskFull,
    NoUsableCheckpoint,
    RestoreError,
    config_diff,
    is_disk_full,
)
from train.config import RunConfigs, batch_layout  # noqa: E402
from train.metrics import Metrics, json_number  # noqa: E402
from train.preemption import PREEMPTED_EXIT, PreemptionWatch  # noqa: E402
from train.step import EVAL_BATCH_AXES, TRAIN_BATCH_AXES  # noqa: E402

PEAK_REMEASURE_S = 60.0  # measure the matmul rate (MFU's denominator) again at most this often


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
    ap.add_argument(
        "--task",
        metavar="NAME[:key=value,...]",
        help="train on a synthetic retrieval task instead of token shards, generated on the fly "
        "from (seed, step): mqar[:num_pairs=4,vocab_size=V,power_a=0.01] or "
        "passkey[:depth=0.5,vocab_size=V,num_digits=5]; seq_len is the model's, vocab_size "
        "defaults to it; the loss counts the answer positions only (train/tasks.py)",
    )
    ap.add_argument("--tokenizer", help="tokenizer.json of --data (for the sample, copied to run)")
    ap.add_argument("--steps", type=int, help="train until this step")
    ap.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step")
    ap.add_argument(
        "--mesh", help=f"{FSDP}=N (N devices) or {DATA}=D,{FSDP}=F (default: all, {FSDP})"
    )
    ap.add_argument("--run-dir", default="runs/default", help="run directory")
    ap.add_argument("--ckpt-dir", help="checkpoint directory (default: RUN_DIR/checkpoints)")
    ap.add_argument("--ckpt-every", type=int, help="steps between checkpoints")
    ap.add_argument("--log-every", type=int, help="steps between metrics lines")
    ap.add_argument(
        "--restart",
        action="store_true",
        help="start over at step 0, first moving the checkpoints and metrics of the run "
        "directory into RUN_DIR/restarted-<time>/",
    )
    ap.add_argument("--distributed", action="store_true", help="jax.distributed.initialize()")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap.parse_intermixed_args(argv)


def resolve_configs(args) -> RunConfigs:
    flags = ("steps", "global_batch_tokens", "ckpt_every", "log_every")
    return train_config.resolve(
        args.config, args.overrides, {name: getattr(args, name) for name in flags}
    )


def mesh_from_flag(spec: str | None):
    """`--mesh fsdp=F` or `--mesh data=D,fsdp=F` (D x F devices); default: every device, FSDP."""
    from laplace_jax.sharding import make_mesh

    if spec is None:
        return make_mesh()
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        key, sep, value = part.strip().partition("=")
        if key not in (DATA, FSDP) or not sep or not value.isdigit() or key in sizes:
            raise ConfigError(f"--mesh expects {FSDP}=N or {DATA}=D,{FSDP}=F, got {spec!r}")
        sizes[key] = int(value)
    if FSDP not in sizes:
        raise ConfigError(f"--mesh needs {FSDP}=F, got {spec!r}")
    data = sizes.get(DATA, 1)
    try:
        return make_mesh(data * sizes[FSDP], data=data)
    except ValueError as e:
        raise ConfigError(f"--mesh {spec}: {e}") from e


def mesh_text(mesh) -> str:
    """`fsdp=8`, or `data=2 x fsdp=4`."""
    return " x ".join(f"{k}={v}" for k, v in mesh.shape.items())


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


@dataclasses.dataclass
class Hooks:
    """In-process hooks into the loop (not on the command line; for tests and tools).

    `batch(step, tokens)` returns the host batch [A, M, T + 1] that step `step` (1-based) trains
    on instead of `tokens` (with `--task`, `tokens` and the result are pairs (tokens, answer mask
    [A, M, T])); `after_step(step)` runs once step `step` is logged and its checkpoint
    (if any) started.
    """

    batch: Callable[[int, np.ndarray], np.ndarray] | None = None
    after_step: Callable[[int], None] | None = None


# ---- set-up ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Trainer:
    """Everything the loop needs, built by `set_up`."""

    cfg: RunConfigs
    mesh: Any
    say: Callable[..., None]
    main_proc: bool
    ckpt_dir: Path
    layout: tuple[int, int, int]  # (global sequences B, accumulation steps A, micro-batch M)
    batches: Any  # train.data.BatchIterator
    val_batches: list
    tokenizer_src: Path | None
    train_step: Callable
    eval_step: Callable
    state: dict
    start: int
    ckpt: Checkpointer
    metrics: Metrics
    meta: dict
    flops_per_token: float
    peak: float  # matmul FLOP/s of the mesh, the MFU denominator (the best seen so far)
    peak_measured_at: float = dataclasses.field(default_factory=time.perf_counter)
    no_bar: bool = False

    @property
    def tokens_per_step(self) -> int:
        return self.layout[0] * self.cfg.model.seq_len


def set_up(args) -> Trainer:
    """Configs, data, model, optimizer and state (restored or new), then the run files; prints
    the start-up lines. Nothing in the run directory changes before the restore has succeeded
    (but for what --restart moves aside, and corrupt checkpoints set aside by a restore)."""
    maybe_initialize_distributed(args.distributed)
    if jax.default_backend() == "neuron":
        jax.config.update("jax_default_prng_impl", "rbg")  # Threefry is not fully supported
    from laplace_jax.accounting import training_flops_per_token
    from laplace_jax.sharding import replicated_fallbacks
    from train.step import measure_matmul_flops

    cfg = resolve_configs(args)
    main_proc = jax.process_index() == 0
    say = print if main_proc else (lambda *a, **k: None)
    run_dir = Path(args.run_dir)
    ckpt_dir = Path(args.ckpt_dir) if args.ckpt_dir else run_dir / "checkpoints"
    task = parse_task_flag(args, cfg.model)
    if task is None:
        train_paths, val_paths, tokenizer_src = open_data(args, cfg.model, main_proc)
    else:
        train_paths, val_paths, tokenizer_src = [], [], None
    mesh = mesh_from_flag(args.mesh)
    cfg = with_table_peak(cfg, mesh)
    layout = batch_layout(cfg.train, cfg.model.seq_len, mesh.size, jax.process_count())
    if task is None:
        batches, val_batches, train_tokens = build_pipeline(cfg, layout, train_paths, val_paths)
    else:
        batches, val_batches, train_tokens = task_pipeline(cfg, layout, task)
    eot_id = doc_reset_eot(cfg.train, train_paths, task is not None, say)
    parts = build_model(cfg, mesh, masked=task is not None, eot_id=eot_id)
    if args.restart:  # asked for, and the rest of the set-up is valid
        restart_aside(run_dir, ckpt_dir, say)
    ckpt = Checkpointer(ckpt_dir, cfg.train.keep_checkpoints, cfg.train.async_checkpoints)
    try:
        state, start, notes = restore_or_init(cfg, parts, ckpt, batches)
    except BaseException:
        ckpt.close()
        raise

    run_dir.mkdir(parents=True, exist_ok=True)
    data = {"train": train_paths, "val": val_paths, "train_tokens": train_tokens}
    if task is not None:
        data = {"task": task[0], "task_params": task[1], "train_tokens": train_tokens}
    meta = write_run_files(args, cfg, run_dir, tokenizer_src, mesh, layout, data)
    metrics = Metrics(run_dir, start, main_proc)
    if metrics.superseded:
        notes.append(
            f"note: {metrics.superseded} lines of metrics.jsonl after step {start} (logged by an "
            f"earlier run past its last checkpoint) moved to metrics.superseded.jsonl"
        )
    fallbacks = replicated_fallbacks(cfg.model, mesh)
    if fallbacks:
        notes.append(replication_notice(fallbacks, mesh.shape[FSDP]))
    t = Trainer(
        cfg=cfg, mesh=mesh, say=say, main_proc=main_proc, ckpt_dir=ckpt_dir, layout=layout,
        batches=batches, val_batches=val_batches, tokenizer_src=tokenizer_src,
        train_step=parts["train_step"], eval_step=parts["eval_step"], state=state, start=start,
        ckpt=ckpt, metrics=metrics, meta=meta,
        flops_per_token=training_flops_per_token(cfg.model),
        peak=cfg.train.peak_flops or measure_matmul_flops(mesh), no_bar=args.no_progress,
    )  # fmt: skip
    announce(t, args.config, train_tokens, [*cfg.notices, *notes])
    return t


def with_table_peak(cfg: RunConfigs, mesh) -> RunConfigs:
    """On Neuron with `peak_flops=0`: the mesh's peak from the table in train/neuron.py (the
    matmul probe would time the compiled fp32 matmul, not the bf16 peak), with a note line.
    Elsewhere, or for a device kind the table lacks (noted), the probe stays."""
    from train.neuron import DEVICE_KINDS, mesh_peak_flops

    device = mesh.devices.flat[0]
    if cfg.train.peak_flops or device.platform != "neuron":
        return cfg
    peak = mesh_peak_flops(mesh)
    if peak is None:
        note = (
            f"note: Neuron device kind {device.device_kind!r} is not in the peak table "
            f"({', '.join(DEVICE_KINDS)}): MFU uses a measured matmul rate; set peak_flops=F"
        )
        return dataclasses.replace(cfg, notices=(*cfg.notices, note))
    note = (
        f"note: peak_flops={peak:.4g} FLOP/s (the MFU denominator): {mesh.size} x "
        f"{device.device_kind} from the Neuron peak table (train/neuron.py); set peak_flops=F"
    )
    train = dataclasses.replace(cfg.train, peak_flops=peak)
    return dataclasses.replace(cfg, train=train, notices=(*cfg.notices, note))


def restart_aside(run_dir: Path, ckpt_dir: Path, say) -> None:
    """--restart: move the checkpoints and metrics into RUN_DIR/restarted-<time>/ (process 0)."""
    names = ("metrics.jsonl", "metrics.superseded.jsonl", "tensorboard")
    corrupt = ckpt_dir.with_name(ckpt_dir.name + "-corrupt")
    found = [p for p in (ckpt_dir, corrupt, *(run_dir / n for n in names)) if p.exists()]
    if found and jax.process_index() == 0:
        dest = run_dir / f"restarted-{time.strftime('%Y%m%d-%H%M%S')}"
        while dest.exists():
            dest = dest.with_name(dest.name + "+")
        dest.mkdir(parents=True)
        for p in found:
            shutil.move(str(p), str(dest / p.name))
        say(f"restart: moved {', '.join(p.name for p in found)} into {dest}; starting at step 0")
    multihost_utils.sync_global_devices("laplace: restart")


def open_data(args, model_cfg, main_proc: bool):
    """(training shard paths, validation shard paths, tokenizer.json or None), checked."""
    from train import data as data_lib

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
    return train_paths, val_paths, tokenizer_src


def build_pipeline(cfg: RunConfigs, layout, train_paths, val_paths):
    """(training BatchIterator, validation batches, training tokens) of this process."""
    from train import data as data_lib

    B, A, M = layout
    proc, nproc = jax.process_index(), jax.process_count()
    train_src = data_lib.TokenWindows(train_paths, cfg.model.seq_len)
    dataset = data_lib.train_dataset(train_src, B // nproc, cfg.train.seed, proc, nproc)
    val_batches = []
    if val_paths:
        val_src = data_lib.TokenWindows(val_paths, cfg.model.seq_len)
        n = cfg.train.eval_batches
        val_batches = data_lib.eval_batches(val_src, M // nproc, n, proc, nproc)
    return data_lib.BatchIterator(dataset, A), val_batches, train_src.num_tokens


def parse_task_flag(args, model_cfg) -> tuple[str, dict] | None:
    """`--task NAME[:key=value,...]` -> (name, parameters), checked; None without --task."""
    if not args.task:
        return None
    from train import tasks

    if args.data or args.val_data:
        raise ConfigError("--task generates its own data: drop --data / --val-data")
    try:
        return tasks.parse_task(args.task, model_cfg.vocab_size)
    except tasks.TaskError as e:
        raise ConfigError(str(e)) from e


def task_pipeline(cfg: RunConfigs, layout, task):
    """(TaskBatches, no validation batches, tokens the run trains on) of this process."""
    from train import tasks

    B, A, M = layout
    proc, nproc = jax.process_index(), jax.process_count()
    try:
        batches = tasks.TaskBatches(
            task[0], task[1], cfg.model.seq_len, B // nproc, A, cfg.train.seed, proc
        )
    except tasks.TaskError as e:
        raise ConfigError(f"--task {task[0]}: {e}") from e
    return batches, [], cfg.train.steps * B * cfg.model.seq_len


def doc_reset_eot(train_cfg, train_paths, is_task: bool, say=print) -> int | None:
    """The end-of-text id the model resets its state after (TrainConfig doc_reset, eot_id), or
    None: no resets. An eot_id of -1 is read from meta.json beside the first training shard
    (train/prepare.py writes it; the default corpus has one)."""
    if train_cfg.doc_reset == "off" or is_task:  # task sequences are single documents
        return None
    eot = train_cfg.eot_id if train_cfg.eot_id >= 0 else None
    if eot is None and train_paths:
        meta = Path(train_paths[0]).parent / "meta.json"
        try:
            eot = json.loads(meta.read_text()).get("eot_id")
        except (OSError, ValueError):
            eot = None
    if eot is None:
        if train_cfg.doc_reset == "on":
            raise ConfigError("doc_reset=on needs an EOT id: set eot_id=N (no meta.json eot_id)")
        return None
    say(f"note: document resets on: state zeroed after each end-of-text token (id {eot})")
    return int(eot)


def build_model(
    cfg: RunConfigs, mesh, masked: bool = False, eot_id: int | None = None
) -> dict[str, Any]:
    """The model's shardings, abstract state, optimizer and the jitted steps (`eot_id`: reset
    the state after each such token, packed documents)."""
    from laplace_jax.model import LaplaceLM, abstract_params
    from laplace_jax.sharding import param_shardings
    from train.step import make_eval_step, make_train_step

    unroll = cfg.train.scan_unroll or jax.default_backend() == "neuron"
    model = LaplaceLM(cfg.model, unroll=unroll)
    p_shard = param_shardings(cfg.model, mesh)
    abs_params = abstract_with_shardings(abstract_params(cfg.model), p_shard)
    tx, lr_schedule, o_shard = train_config.build_optimizer(cfg.optim, abs_params, p_shard, mesh)
    abs_opt = abstract_with_shardings(jax.eval_shape(tx.init, abs_params), o_shard)
    train_step, state_shard = make_train_step(
        model,
        tx,
        mesh,
        p_shard,
        o_shard,
        cfg.train.grad_clip,
        lr_schedule=lr_schedule,
        remat=cfg.train.remat,
        masked=masked,
        eot_id=eot_id,
    )
    return {
        "tx": tx,
        "p_shard": p_shard,
        "o_shard": o_shard,
        "state_shard": state_shard,
        "abs_params": abs_params,
        "abs_opt": abs_opt,
        "train_step": train_step,
        "eval_step": make_eval_step(model, mesh, p_shard, eot_id),
    }


def restore_or_init(cfg: RunConfigs, parts, ckpt: Checkpointer, batches):
    """(train state, start step, notice lines): the newest good checkpoint, or a new state when
    there is none. Raises RestoreError (nothing changed) when checkpoints exist but none can be
    restored, or when they belong to another model or layout."""
    from laplace_jax.model import init_params

    proc = jax.process_index()
    nproc = jax.process_count()
    tag = "warning" if nproc == 1 else f"warning (process {proc})"
    restored = ckpt.restore_latest(
        parts["abs_params"],
        parts["abs_opt"],
        {"model": cfg.model.to_dict()},
        warn=lambda message: print(f"{tag}: {message}", file=sys.stderr),
    )
    notes = []
    if restored is not None:
        start = restored["step"]
        params, opt_state = restored["params"], restored["opt_state"]
        try:
            batches.set_state(restored["data"])
        except ValueError as e:  # train/tasks.py: the checkpoint was trained on other data
            raise RestoreError(f"{ckpt.directory / str(restored['step'])}: {e}") from e
        for line in config_diff(restored["meta"].get("optimizer", {}), cfg.optim.to_dict()):
            notes.append(f"note: optimizer config changed since the checkpoint: {line}")
        notes.append(f"resumed from {ckpt.directory / str(start)} at step {start}")
    else:
        start = 0
        if cfg.train.init_on_host:
            params = init_params_on_host(cfg.model, cfg.train.seed, parts["p_shard"])
        else:
            key = jax.random.key(cfg.train.seed)
            init = jax.jit(lambda k: init_params(cfg.model, k), out_shardings=parts["p_shard"])
            params = init(key)
        opt_state = jax.jit(parts["tx"].init, out_shardings=parts["o_shard"])(params)
    bad_streak = jax.device_put(jnp.zeros((), jnp.int32), parts["state_shard"]["bad_streak"])
    return {"params": params, "opt_state": opt_state, "bad_streak": bad_streak}, start, notes


def init_params_on_host(model_cfg, seed: int, shardings) -> dict:
    """`init_on_host=true`: the parameters initialised by a jitted function on the host CPU, then
    placed onto `shardings`; each process places only its addressable shards (with
    `jax.make_array_from_callback`), so it works with several processes.

    With the same seed and PRNG implementation these are the bits the on-device init gives on
    CPU (the Threefry keys are partitionable, so sharding does not change the numbers). On
    Neuron (rbg keys) the numbers are the host's: RngBitGenerator's bits are backend-defined.
    """
    from laplace_jax.model import init_params

    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError as e:
        raise ConfigError(
            f"init_on_host=true needs JAX's CPU backend ({e}); include cpu in JAX_PLATFORMS, "
            "e.g. JAX_PLATFORMS=neuron,cpu, or set init_on_host=false"
        ) from e
    with jax.default_device(cpu):
        key = jax.device_put(jax.random.key(seed), cpu)
        host = jax.device_get(jax.jit(lambda k: init_params(model_cfg, k))(key))
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda index: x[index]),
        host,
        shardings,
    )


def write_run_files(args, cfg, run_dir, tokenizer_src, mesh, layout, data: dict):
    """config.json and the tokenizer copy (process 0); the checkpoint meta they share."""
    tokenizer_ref = None
    main_proc = jax.process_index() == 0
    if tokenizer_src is not None:
        tokenizer_ref = str((run_dir / "tokenizer.json").absolute())
        if main_proc and Path(tokenizer_src).resolve() != Path(tokenizer_ref).resolve():
            shutil.copyfile(tokenizer_src, tokenizer_ref)
    B, A, M = layout
    run_config = {
        "model": cfg.model.to_dict(),
        "optimizer": cfg.optim.to_dict(),
        "train": cfg.train.to_dict(),
        "data": data,
        "tokenizer": tokenizer_ref,
        "tokenizer_source": str(tokenizer_src) if tokenizer_src else None,
        "mesh": dict(mesh.shape),
        "processes": jax.process_count(),
        "batch": {"sequences": B, "accum_steps": A, "micro_batch": M},
    }
    if main_proc:
        (run_dir / "config.json").write_text(json.dumps(run_config, indent=2))
    meta = {k: run_config[k] for k in ("model", "optimizer", "train", "tokenizer")}
    meta["tokenizer_source"] = run_config["tokenizer_source"]
    meta["config"] = meta["model"]  # the name export/ looks for first
    return meta


def replication_notice(fallbacks: list[str], n: int, show: int = 4) -> str:
    more = f"; and {len(fallbacks) - show} more" if len(fallbacks) > show else ""
    return (
        f"note: {len(fallbacks)} parameters are replicated, not sharded: their {FSDP} axis does "
        f"not divide by {FSDP}={n} (Muon orthogonalises each whole on every device): "
        + "; ".join(fallbacks[:show])
        + more
    )


def announce(t: Trainer, name: str, train_tokens: int, notes: list[str]) -> None:
    from laplace_jax.accounting import parameter_counts

    m, (B, A, M) = t.cfg.model, t.layout
    for line in notes:
        t.say(line)
    t.say(
        f"model {name}: {m.d_model}d x {m.n_layers}L"
        + (", softmax attention (baseline)" if m.token_mixer == "attention" else "")
        + ", "
        f"{parameter_counts(m)['total_params'] / 1e6:.1f}M params; "
        f"mesh {mesh_text(t.mesh)} ({jax.default_backend()}); "
        f"batch {B} x {m.seq_len} tokens (accum {A} x micro {M}); "
        f"{train_tokens:,} training tokens; matmul peak {t.peak / 1e9:.1f} GFLOP/s"
    )


# ---- the loop -------------------------------------------------------------------------------


def train_loop(t: Trainer, hooks: Hooks, watch: PreemptionWatch) -> int:
    """Steps t.start+1 .. steps: train, evaluate, log, checkpoint. 0; 2 after too many
    non-finite steps in a row; PREEMPTED_EXIT after a preemption notice (`watch`), once the
    step it arrived in is checkpointed."""
    tc, (_, A, M) = t.cfg.train, t.layout
    batch_sharding = logical_sharding(t.mesh, TRAIN_BATCH_AXES)
    global_shape = (A, M, t.cfg.model.seq_len + 1)
    bar = tqdm(total=tc.steps, initial=t.start, disable=not t.main_proc or t.no_bar, unit="step")
    window = [0, 0.0]  # tokens and seconds of timed steps since the last metrics line
    for step in range(t.start, tc.steps):
        done = step + 1
        t_step = time.perf_counter()  # step time: data, dispatch, compute (not eval or saves)
        local = next(t.batches)  # tokens, or (tokens, answer mask) with --task
        if hooks.batch is not None:
            local = hooks.batch(done, local)
        if isinstance(local, tuple):  # a task: the loss counts the answer positions only
            tokens, mask = local
            batch = jax.make_array_from_process_local_data(batch_sharding, tokens, global_shape)
            mask_shape = (*global_shape[:2], global_shape[2] - 1)
            mask = jax.make_array_from_process_local_data(batch_sharding, mask, mask_shape)
            t.state, m = t.train_step(t.state, batch, mask)
        else:
            batch = jax.make_array_from_process_local_data(batch_sharding, local, global_shape)
            t.state, m = t.train_step(t.state, batch)
        m = jax.device_get(m)
        if step > t.start:  # the first step of a process includes compilation
            window[0] += t.tokens_per_step
            window[1] += time.perf_counter() - t_step
        if not m["applied"]:
            t.say(
                f"\nstep {done}: loss {m['loss']} / grad norm {m['grad_norm']} not finite; "
                f"update skipped ({m['bad_streak']} in a row)"
            )
        is_last = done == tc.steps
        val_loss = None
        if t.val_batches and (is_last or (tc.eval_every and done % tc.eval_every == 0)):
            val_loss = evaluate(t)
        regular = done % tc.log_every == 0 or step == t.start or is_last
        if regular or val_loss is not None or not m["applied"]:
            log_step(t, done, m, val_loss, window, bar)
            window[:] = [0, 0.0]
        bar.update(1)
        if m["bad_streak"] >= tc.max_bad_steps:
            bar.close()
            stop_on_bad_streak(t, int(m["bad_streak"]))
            return 2
        saved = (done % tc.ckpt_every == 0 or is_last) and m["bad_streak"] == 0
        if saved:
            save_checkpoint(t, done)
        if hooks.after_step is not None:
            hooks.after_step(done)
        if watch.reached(done):
            bar.close()
            return stop_on_preemption(t, done, saved or m["bad_streak"] > 0)
    bar.close()
    return 0


def save_checkpoint(t: Trainer, done: int) -> None:
    params, opt_state = t.state["params"], t.state["opt_state"]
    t.ckpt.save(done, params, opt_state, t.batches.get_state(), t.meta)


def stop_on_preemption(t: Trainer, done: int, saved: bool) -> int:
    """Save step `done` (unless saved already, or its update was skipped as non-finite: then
    the last good checkpoint stays the newest), wait for the write, say where it is."""
    if not saved:
        save_checkpoint(t, done)
    t.ckpt.wait()
    steps = t.ckpt.all_steps()
    who = f" (process {jax.process_index()})" if jax.process_count() > 1 else ""
    if steps:
        saved_to = f"checkpoint saved to {t.ckpt_dir / str(steps[-1])}"
    else:  # every step so far was skipped as non-finite
        saved_to = "no checkpoint (no finite step yet)"
    print(  # every process says it: each saved its part of the same step
        f"\npreempted at step {steps[-1] if steps else done}{who}: {saved_to}; rerun the same "
        f"command to resume (exit status {PREEMPTED_EXIT})",
        flush=True,
    )
    return PREEMPTED_EXIT


def log_step(t: Trainer, done: int, m: dict, val_loss, window, bar) -> None:
    """One metrics.jsonl line; `lr` is the rate optax applied this step (see train/step.py)."""
    from train.step import measure_matmul_flops

    now = time.perf_counter()
    if not t.cfg.train.peak_flops and now - t.peak_measured_at > PEAK_REMEASURE_S:
        # the best matmul rate seen so far: on a shared machine a busy moment at start would
        # otherwise overstate MFU
        t.peak = max(t.peak, measure_matmul_flops(t.mesh, reps=2))
        t.peak_measured_at = now
    tps = window[0] / window[1] if window[1] > 0 else float("nan")
    record = {
        "step": done,
        "loss": float(m["loss"]),
        "grad_norm": float(m["grad_norm"]),
        "lr": float(m["lr"]),
        "tokens_per_s": tps,
        "mfu": tps * t.flops_per_token / t.peak,
        "applied": bool(m["applied"]),
        "tokens": done * t.tokens_per_step,
    }
    if val_loss is not None:
        record["val_loss"] = val_loss
    t.metrics.write({k: json_number(v) for k, v in record.items()})
    post = {"loss": f"{record['loss']:.3f}", "tok/s": f"{tps:,.0f}", "mfu": f"{record['mfu']:.1%}"}
    if val_loss is not None:
        post["val"] = f"{val_loss:.3f}"
    bar.set_postfix(post, refresh=False)


def stop_on_bad_streak(t: Trainer, streak: int) -> None:
    t.ckpt.wait()
    steps = t.ckpt.all_steps()
    last_good = t.ckpt_dir / str(steps[-1]) if steps else "none"
    t.say(
        f"\nstopping: {streak} non-finite steps in a row "
        f"(max_bad_steps={t.cfg.train.max_bad_steps}); last good checkpoint: {last_good}"
    )


def evaluate(t: Trainer) -> float:
    M, seq_len = t.layout[2], t.cfg.model.seq_len
    sharding = logical_sharding(t.mesh, EVAL_BATCH_AXES)
    losses = [
        t.eval_step(
            t.state["params"], jax.make_array_from_process_local_data(sharding, b, (M, seq_len + 1))
        )
        for b in t.val_batches
    ]
    return float(np.mean(jax.device_get(losses)))


# ---- the end --------------------------------------------------------------------------------


def finish(t: Trainer, status: int) -> int:
    """Wait for the last checkpoint, close the logs; after a good run, print a greedy sample."""
    t.ckpt.close()
    t.metrics.close()
    tc = t.cfg.train
    if status == 0 and tc.sample_tokens and t.tokenizer_src is not None:
        params = t.state["params"]
        if jax.process_count() > 1:  # the params span several hosts: gather a full copy
            params = multihost_utils.process_allgather(params, tiled=True)
        if t.main_proc:
            print_sample(params, t.cfg.model, t.tokenizer_src, tc)
    return status


def run(args, hooks: Hooks | None = None) -> int:
    t = set_up(args)
    watch = PreemptionWatch(t.ckpt.manager.reached_preemption)
    try:
        return finish(t, train_loop(t, hooks or Hooks(), watch))
    except DiskFull:
        t.ckpt.abandon()
        raise
    except OSError as e:
        if not is_disk_full(e):
            t.ckpt.close()
            raise
        t.ckpt.abandon()
        what = f"writing {t.metrics.path} failed; it keeps every complete line"
        raise DiskFull(what, t.metrics.path.parent, None, t.ckpt.complete_steps()) from None
    except BaseException:
        t.ckpt.close()  # let a started save finish; the exception goes on
        raise
    finally:
        watch.close()


def print_sample(params, cfg, tokenizer_path, tcfg) -> None:
    from tokenizers import Tokenizer

    from laplace_jax.generate import greedy_generate

    tok = Tokenizer.from_file(str(tokenizer_path))
    prompt = tok.encode(tcfg.sample_prompt, add_special_tokens=False).ids or [0]
    new = greedy_generate(params, cfg, np.array(prompt, np.int32), tcfg.sample_tokens)
    text = tok.decode(list(prompt) + [int(t) for t in new])
    print(f"greedy sample ({tcfg.sample_tokens} tokens):\n{text}")


def main(argv=None, hooks: Hooks | None = None) -> int:
    from train.data import ShardError

    args = parse_args(argv)
    t0 = time.perf_counter()
    try:
        status = run(args, hooks)
    except NoUsableCheckpoint as e:
        aside = Path(args.run_dir) / "restarted-<time>"
        print(
            f"error: {e}.\nTo start this run over at step 0, run the same command with "
            f"--restart: the checkpoints and metrics.jsonl are first moved into {aside}/",
            file=sys.stderr,
        )
        return 2
    except (ConfigError, RestoreError, DiskFull, ShardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if jax.process_index() == 0:
        print(f"wall time {time.perf_counter() - t0:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
