"""The run's three configs: model (`LaplaceConfig`), optimizer (`OptimizerConfig`, in
laplace_jax/optim.py) and training (`TrainConfig`, here: how long, how big a batch, how often to
log, evaluate and checkpoint, and the guards), resolved from a preset or JSON file and
`key=value` overrides, plus the optax transformation the trainer builds from them.

Whatever is chosen for the user rather than by them comes back as a notice line (`RunConfigs.
notices`) that the trainer prints at start-up: a JSON model's training/optimizer presets, and the
learning-rate schedule fitted to the run's length.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from laplace_jax import optim
from laplace_jax.attention_ring import odd_slice
from laplace_jax.fsdp import REMAT_POLICIES
from laplace_jax.model import ATTENTION_CONTEXT, ATTENTION_CONTEXT_FORMS
from laplace_spec.config import PRESETS, ConfigError, LaplaceConfig, get_config, parse_overrides


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 120  # optimizer steps of the run (the end step when resuming)
    global_batch_tokens: int = 4_096  # tokens per optimizer step, all devices and hosts together
    micro_batch_size: int = 0  # sequences per accumulation step, all devices; 0 = whole batch
    seed: int = 0  # parameter init and data order
    log_every: int = 10  # steps between metrics.jsonl lines (and progress-bar updates)
    eval_every: int = 40  # steps between validation losses; 0 = only at the end
    eval_batches: int = 4  # validation batches (of the micro-batch size) per evaluation
    ckpt_every: int = 40  # steps between checkpoints (and one at the end)
    keep_checkpoints: int = 3  # keep the last N
    async_checkpoints: bool = True  # save in the background while training goes on
    grad_clip: float = 1.0  # clip the global gradient norm; 0 = off
    max_bad_steps: int = 5  # stop after this many non-finite steps in a row
    scan_unroll: bool = False  # static unroll of the GLA chunk scan (set on Neuron)
    remat: str = "none"  # what the backward recomputes: none | layer | dots (fsdp.REMAT_POLICIES)
    # a hybrid's attention layers on a context axis: ring | gather (docs/design.md s13.3)
    attention_context: str = ATTENTION_CONTEXT
    peak_flops: float = 0.0  # MFU denominator in FLOP/s; 0 = measure the matmul rate now
    # (on Neuron: 0 = the peak table of train/peak.py)
    # initialise parameters on the host CPU, then place the shards (Neuron: RNG init compiles
    # slowly on the device)
    init_on_host: bool = False
    sample_tokens: int = 48  # greedy tokens printed at the end; 0 = none
    sample_prompt: str = "def "  # prompt of that sample
    # packed documents: reset the GLA state and conv window at the token after each end-of-text
    # token (laplace_jax/fsdp.py). auto: on when the data's EOT id is known (eot_id, or the
    # eot_id of the shards' meta.json, as train/prepare.py writes it); on (an EOT id required);
    # off. eot_id: -1 = from the data.
    doc_reset: str = "auto"
    eot_id: int = -1

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", "float") and v < 0 and f.name != "eot_id":
                raise ConfigError(f"{f.name} must be >= 0, got {v!r}")
        for name in ("steps", "global_batch_tokens", "log_every", "keep_checkpoints"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.doc_reset not in ("auto", "on", "off"):
            raise ConfigError(f"doc_reset must be auto, on or off, got {self.doc_reset!r}")
        if self.eot_id < -1:
            raise ConfigError(f"eot_id must be >= 0 (or -1: from the data), got {self.eot_id}")
        if self.remat not in REMAT_POLICIES:
            raise ConfigError(f"remat must be one of {tuple(REMAT_POLICIES)}, got {self.remat!r}")
        if self.attention_context not in ATTENTION_CONTEXT_FORMS:
            raise ConfigError(
                f"attention_context must be one of {tuple(ATTENTION_CONTEXT_FORMS)}, got "
                f"{self.attention_context!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Defaults by model preset: `small` is the default run (a few minutes on a 2-core CPU);
# `laplace-3b` is the write-up's recipe (524,288 tokens = 256 x 2,048 per step, 190,735 steps;
# set micro_batch_size to what fits, e.g. 64 on 64 NeuronCores for 4 accumulation steps).
TRAIN_PRESETS: dict[str, TrainConfig] = {
    "small": TrainConfig(),
    "tiny": TrainConfig(
        steps=40, global_batch_tokens=8 * 64, log_every=1, eval_every=20, ckpt_every=20
    ),
    "laplace-3b": TrainConfig(
        steps=190_735,
        global_batch_tokens=524_288,
        log_every=10,
        eval_every=1_000,
        eval_batches=8,
        ckpt_every=1_000,
        sample_tokens=64,
        remat="layer",  # one layer's activations and weights at a time (docs/design.md s8)
    ),
}

DEFAULT_PRESET = "small"  # the training and optimizer presets of a model given as a JSON file


def train_preset(model_preset: str) -> TrainConfig:
    return TRAIN_PRESETS.get(model_preset, TRAIN_PRESETS[DEFAULT_PRESET])


@dataclasses.dataclass(frozen=True)
class RunConfigs:
    model: LaplaceConfig
    optim: optim.OptimizerConfig
    train: TrainConfig
    notices: tuple[str, ...] = ()  # what was chosen for the user, one line each


def resolve(config: str, overrides: list[str], train_flags: dict[str, Any]) -> RunConfigs:
    """The three configs of a run: `config` is a model preset or JSON file, `overrides` the
    `key=value` strings, `train_flags` the TrainConfig fields given as command-line flags (they
    win over overrides)."""
    routed = split_overrides(overrides)
    model_cfg = get_config(config, routed["model"])
    notices = []
    preset = config
    if config not in PRESETS:
        preset = DEFAULT_PRESET
        notices.append(
            f"note: {config} is a model file, not a preset ({', '.join(PRESETS)}): the training "
            f"and optimizer settings are the {DEFAULT_PRESET!r} presets' unless set as key=value"
        )
    changes = parse_overrides(routed["train"], TrainConfig)
    changes.update({k: v for k, v in train_flags.items() if v is not None})
    train_cfg = dataclasses.replace(train_preset(preset), **changes)
    opt_cfg, note = optimizer_config(preset, routed["optim"], train_cfg.steps)
    return RunConfigs(model_cfg, opt_cfg, train_cfg, tuple(notices + ([note] if note else [])))


def split_overrides(items: list[str]) -> dict[str, list[str]]:
    """Route `key=value` strings to the model, optimizer and training configs (`model.`,
    `optim.`, `train.` prefixes settle a name that two of them have)."""
    model_fields = {f.name for f in dataclasses.fields(LaplaceConfig)}
    opt_fields = {f.name for f in dataclasses.fields(optim.OptimizerConfig)}
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


def optimizer_config(
    preset: str, overrides: list[str], train_steps: int
) -> tuple[optim.OptimizerConfig, str | None]:
    """The preset's OptimizerConfig with `key=value` overrides, and a notice when the schedule
    was fitted to the run.

    Unless `total_steps` is overridden the schedule spans the run: total_steps = the run's steps,
    and (unless `warmup_steps` is overridden) warmup at most a tenth of them. The 3B preset
    already matches its run, so it gets no notice.
    """
    base = optim.OPTIMIZER_PRESETS[preset]
    try:
        changes = parse_overrides(overrides, optim.OptimizerConfig)
        fitted = {}
        if "total_steps" not in changes:
            fitted["total_steps"] = train_steps
            if "warmup_steps" not in changes:
                fitted["warmup_steps"] = min(base.warmup_steps, max(train_steps // 10, 1))
        cfg = dataclasses.replace(base, **changes, **fitted)
    except ValueError as e:  # the dataclass validates itself
        raise ConfigError(f"optimizer config: {e}") from e
    if all(getattr(base, k) == v for k, v in fitted.items()):
        return cfg, None

    def why(key, value):
        preset = getattr(base, key)
        if key == "total_steps":
            return f"the run's steps; preset {preset}"
        return "the preset's" if value == preset else f"a tenth of the run; preset {preset}"

    chosen = ", ".join(f"{k}={v} ({why(k, v)})" for k, v in fitted.items())
    return cfg, (
        f"note: the learning-rate schedule is fitted to this run: {chosen}; "
        f"set {' / '.join(f'{k}=N' for k in fitted)} to choose"
    )


def build_optimizer(opt_cfg: optim.OptimizerConfig, params_like, param_shardings, mesh):
    """(optax transformation, learning-rate schedule, optimizer-state shardings).

    `params_like` should carry the parameter shardings, so Muon sees how each matrix is split.
    """
    tx = optim.make_optimizer(opt_cfg, params_like, mesh=mesh)
    shardings = optim.opt_state_shardings(tx, params_like, param_shardings)
    return tx, optim.learning_rate_schedule(opt_cfg), shardings


def batch_layout(
    cfg: TrainConfig,
    seq_len: int,
    n_devices: int,
    n_processes: int = 1,
    context: int = 1,
    attention: bool = False,
) -> tuple[int, int, int]:
    """(global sequences B, accumulation steps A, micro-batch M) with B = A * M; checked. With a
    context axis of `context` devices, each sequence is split over one context group, so the
    micro-batch divides over the n_devices / context groups (and with `attention` layers in
    the ring form, each slice into two halves)."""
    if cfg.global_batch_tokens % seq_len:
        raise ConfigError(
            f"global_batch_tokens ({cfg.global_batch_tokens}) must be a multiple of seq_len "
            f"({seq_len})"
        )
    if seq_len % context:
        raise ConfigError(
            f"seq_len ({seq_len}) must divide into context={context} equal slices, one per "
            "device of a context group"
        )
    ring = attention and context > 1 and cfg.attention_context == "ring"
    if ring and odd_slice(seq_len, context):
        raise ConfigError(odd_slice(seq_len, context))
    B = cfg.global_batch_tokens // seq_len
    M = cfg.micro_batch_size or B
    groups = n_devices // context
    where = (
        f"{n_devices} devices of the mesh"
        if context == 1
        else (f"{groups} context groups of the mesh ({n_devices} devices / context={context})")
    )
    if B % M:
        raise ConfigError(f"micro_batch_size ({M}) must divide the global batch ({B} sequences)")
    if M % groups:
        raise ConfigError(
            f"the micro-batch ({M} sequences) must divide over the {where}: set "
            "micro_batch_size or global_batch_tokens accordingly"
            + ("" if context > 1 else ", or split each sequence with --mesh ...,context=S")
        )
    if M % n_processes:
        raise ConfigError(f"the micro-batch ({M}) must divide over {n_processes} processes")
    return B, B // M, M
