"""The trainer's command line: `python -m train.main`'s flags, the configs they resolve to, and
the flags parsed into values (`--mesh`, `--task`, `--profile-steps`).

`train.main`, the Neuron launcher (`train.neuron`) and `train.plan` read the same flags through
this module. Importing it imports no JAX (`train.plan --devices` must set the device count
before JAX starts); a bad value is a ConfigError naming the flag (`error: ...`, exit 2).
"""

from __future__ import annotations

import argparse

from laplace_spec.config import ConfigError
from train.lost_peer import DEFAULT_HEARTBEAT_TIMEOUT_S, LOST_PEER_EXIT


class _Parser(argparse.ArgumentParser):
    """`--help` ends with every `key=value` setting, its default and its meaning (built only
    when asked for: it imports the configs, and with them JAX)."""

    def format_help(self) -> str:
        from train.config import settings_help

        return super().format_help() + "\n" + settings_help()


def parse_args(argv=None) -> argparse.Namespace:
    from laplace_jax.sharding import CONTEXT, DATA, FSDP
    from train.backend import PLATFORMS

    ap = _Parser(
        prog="python -m train.main",
        description="Train a Laplace GLA language model (defaults: small preset, stdlib corpus).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "overrides", nargs="*", metavar="key=value", help="settings (listed below), over --config"
    )
    ap.add_argument(
        "--config",
        default="small",
        help="a preset (tiny, small, laplace-3b), a YAML or JSON config file, or a run's own "
        "config.json (docs/training.md, Configs)",
    )
    ap.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved settings as a YAML config file (that --config reads) and exit",
    )
    ap.add_argument(
        "--platform",
        choices=sorted(PLATFORMS),
        help="the JAX backend to train on (default: JAX's, or JAX_PLATFORMS); one this JAX cannot "
        "start stops the run with the install that brings it",
    )
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
    ap.add_argument(
        "--tokenizer",
        help="the tokenizer of --data: a tokenizer.json or a tokenizer folder (default: the "
        "tokenizer.json train.prepare wrote beside the shards); copied into the run for the "
        "sample and the export",
    )
    ap.add_argument("--steps", type=int, help="train until this step")
    ap.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step")
    ap.add_argument(
        "--mesh",
        help=f"{FSDP}=N (N devices), or {DATA}=D,{FSDP}=F,{CONTEXT}=S (D x F x S devices; "
        f"{DATA} and {CONTEXT} optional): each sequence is split into S slices, one per device "
        f"of a context group (default: all devices, {FSDP})",
    )
    ap.add_argument("--run-dir", default="runs/default", help="run directory")
    ap.add_argument(
        "--init-from",
        metavar="DIR",
        help="start from the parameters of another run's checkpoint (its run, checkpoints or "
        "step directory; the newest step unless a step is named): the same model but for "
        "seq_len, e.g. to go on at longer sequences; the optimizer, data and step start fresh. "
        "Ignored when this run resumes from its own checkpoint",
    )
    ap.add_argument("--ckpt-dir", help="checkpoint directory (default: RUN_DIR/checkpoints)")
    ap.add_argument("--ckpt-every", type=int, help="steps between checkpoints")
    ap.add_argument("--log-every", type=int, help="steps between metrics lines")
    ap.add_argument(
        "--profile-steps",
        metavar="A:B",
        help="capture a jax.profiler trace of steps A..B (1 <= A <= B) into RUN_DIR/profile/, "
        "for TensorBoard's profile plugin or Perfetto (perfetto_trace.json.gz); main process "
        "only",
    )
    ap.add_argument(
        "--restart",
        action="store_true",
        help="start over at step 0, first moving the checkpoints and metrics of the run "
        "directory into RUN_DIR/restarted-<time>/",
    )
    ap.add_argument("--distributed", action="store_true", help="jax.distributed.initialize()")
    ap.add_argument(
        "--heartbeat-timeout",
        type=int,
        default=DEFAULT_HEARTBEAT_TIMEOUT_S,
        metavar="S",
        help="several processes: seconds without a process's heartbeat before it counts as lost "
        f"and the others stop with exit status {LOST_PEER_EXIT} (default "
        f"{DEFAULT_HEARTBEAT_TIMEOUT_S})",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_intermixed_args(argv)
    if args.heartbeat_timeout < 1:
        ap.error(f"--heartbeat-timeout must be at least 1 second, got {args.heartbeat_timeout}")
    return args


def resolve_configs(args):
    """The run's train.config.RunConfigs from the flags and `key=value` overrides."""
    from train import config as train_config

    flags = ("steps", "global_batch_tokens", "ckpt_every", "log_every")
    return train_config.resolve(
        args.config, args.overrides, {name: getattr(args, name) for name in flags}
    )


def mesh_sizes(spec: str) -> tuple[int, int, int]:
    """`--mesh fsdp=F[,data=D][,context=S]` -> (D, F, S) (1 for an axis not named), checked."""
    from laplace_jax.sharding import CONTEXT, DATA, FSDP

    sizes: dict[str, int] = {}
    usage = f"--mesh expects {FSDP}=F, optionally with {DATA}=D and {CONTEXT}=S"
    for part in spec.split(","):
        key, sep, value = part.strip().partition("=")
        if key not in (DATA, FSDP, CONTEXT) or not sep or not value.isdigit() or key in sizes:
            raise ConfigError(f"{usage} (e.g. {DATA}=2,{FSDP}=4,{CONTEXT}=2), got {spec!r}")
        if int(value) < 1:
            raise ConfigError(f"--mesh {spec}: {key} must be at least 1")
        sizes[key] = int(value)
    if FSDP not in sizes:
        raise ConfigError(f"--mesh needs {FSDP}=F, got {spec!r}")
    return sizes.get(DATA, 1), sizes[FSDP], sizes.get(CONTEXT, 1)


def mesh_from_flag(spec: str | None):
    """`--mesh fsdp=F[,data=D][,context=S]` (D x F x S devices); default: every device, FSDP."""
    from laplace_jax.sharding import make_mesh

    if spec is None:
        return make_mesh()
    data, fsdp, context = mesh_sizes(spec)
    try:
        return make_mesh(data * fsdp * context, data=data, context=context)
    except ValueError as e:
        raise ConfigError(f"--mesh {spec}: {e}") from e


def mesh_text(mesh) -> str:
    """`fsdp=8`, or `data=2 x fsdp=4`."""
    return " x ".join(f"{k}={v}" for k, v in mesh.shape.items())


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


def parse_profile_steps(spec: str | None) -> tuple[int, int] | None:
    """`--profile-steps A:B` -> (A, B), two step numbers with 1 <= A <= B; None without it."""
    if spec is None:
        return None
    first, sep, last = spec.partition(":")
    if sep and first.strip().isdigit() and last.strip().isdigit():
        a, b = int(first), int(last)
        if 1 <= a <= b:
            return a, b
    raise ConfigError(
        f"--profile-steps expects A:B, two step numbers with 1 <= A <= B (e.g. 5:7), got {spec!r}"
    )
