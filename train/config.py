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
from pathlib import Path
from typing import Any

from laplace_jax import optim
from laplace_jax.attention_ring import odd_slice
from laplace_jax.fsdp import REMAT_POLICIES
from laplace_jax.model import ATTENTION_CONTEXT, ATTENTION_CONTEXT_FORMS
from laplace_spec.config import (
    PRESETS,
    ConfigError,
    LaplaceConfig,
    parse_overrides,
    setting,
)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = setting(120, "optimizer steps of the run (the end step when resuming)")
    global_batch_tokens: int = setting(
        4_096,
        "tokens per optimizer step, all devices and hosts together",
    )
    micro_batch_size: int = setting(
        0,
        "sequences per accumulation step, all devices; 0 = whole batch",
    )
    seed: int = setting(0, "parameter init and data order")
    log_every: int = setting(10, "steps between metrics.jsonl lines (and progress-bar updates)")
    eval_every: int = setting(40, "steps between validation losses; 0 = only at the end")
    eval_batches: int = setting(4, "validation batches (of the micro-batch size) per evaluation")
    ckpt_every: int = setting(40, "steps between checkpoints (and one at the end)")
    keep_checkpoints: int = setting(3, "checkpoints kept: the newest N")
    async_checkpoints: bool = setting(True, "save in the background while training goes on")
    grad_clip: float = setting(1.0, "clip the global gradient norm; 0 = off")
    max_bad_steps: int = setting(5, "stop after this many non-finite steps in a row")
    scan_unroll: bool = setting(False, "static unroll of the GLA chunk scan (set on Neuron)")
    remat: str = setting(
        "none",
        "what the backward recomputes: none | layer | dots (fsdp.REMAT_POLICIES)",
    )
    # docs/design.md s13.3
    attention_context: str = setting(
        ATTENTION_CONTEXT,
        "a hybrid's attention layers on a context axis: ring or gather",
    )
    peak_flops: float = setting(
        0.0,
        "MFU denominator in FLOP/s; 0 = the device's published peak (train/peak.py), or for a "
        "device the table lacks a matmul rate measured at start",
    )
    # Neuron: RNG init compiles slowly on the device
    init_on_host: bool = setting(
        False,
        "initialise parameters on the host CPU, then place the shards (Neuron)",
    )
    sample_tokens: int = setting(48, "greedy tokens printed at the end; 0 = none")
    sample_prompt: str = setting("def ", "prompt of the greedy sample")
    # packed documents: reset the GLA state and conv window at the token after each end-of-text
    # token (laplace_jax/fsdp.py). auto: on when the data's EOT id is known (eot_id, or the
    # eot_id of the shards' meta.json, as train/prepare.py writes it); on (an EOT id required);
    # off. eot_id: -1 = from the data.
    doc_reset: str = setting(
        "auto",
        "reset the GLA state after each end-of-text token: auto (when the id is known), on, off",
    )
    eot_id: int = setting(-1, "the end-of-text id of doc_reset; -1 = from the shards' meta.json")

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
    """The three configs of a run: `config` is a preset or a config file (train/config_files.py:
    YAML or JSON, a run's own config.json among them), `overrides` the `key=value` strings,
    `train_flags` the TrainConfig fields given as command-line flags (they win over overrides,
    which win over the file)."""
    from train.config_files import typed_fields

    routed = split_overrides(overrides)
    start = starting_point(config)
    model_dict = {
        **start.model_base,
        **typed_fields(LaplaceConfig, start.sections["model"], config),
    }
    read = LaplaceConfig.from_saved if start.saved_model else LaplaceConfig.from_dict
    try:
        model_cfg = read(model_dict)
    except ConfigError as e:  # the file's model is malformed (a preset's never is)
        raise ConfigError(f"{config}: {e}") from None
    model_cfg = model_cfg.with_overrides(routed["model"])
    changes = typed_fields(TrainConfig, start.sections["train"], config)
    changes.update(parse_overrides(routed["train"], TrainConfig))
    changes.update({k: v for k, v in train_flags.items() if v is not None})
    train_cfg = dataclasses.replace(train_preset(start.preset), **changes)
    opt_fields = typed_fields(optim.OptimizerConfig, start.sections["optimizer"], config)
    opt_cfg, note = optimizer_config(start.preset, opt_fields, routed["optim"], train_cfg.steps)
    return RunConfigs(model_cfg, opt_cfg, train_cfg, start.notices + ((note,) if note else ()))


@dataclasses.dataclass(frozen=True)
class StartingPoint:
    """What `--config` gives before `key=value` and the flags."""

    preset: str  # the training and optimizer presets the unset fields come from
    model_base: dict[str, Any]  # the model's fields before the file's ({}: LaplaceConfig's own)
    sections: dict[str, dict[str, Any]]  # the file's "model", "optimizer", "train" fields
    saved_model: bool  # a run's config.json: its model section is a saved config
    notices: tuple[str, ...] = ()


def starting_point(config: str) -> StartingPoint:
    """A preset's, or a config file's (train/config_files.py): without a `preset` the model's
    unset fields are LaplaceConfig's own, as in a model JSON, and the others the `small`
    presets' (a notice says so unless the file sets them all)."""
    from train import config_files

    if config in PRESETS:
        empty = {"model": {}, "optimizer": {}, "train": {}}
        return StartingPoint(config, PRESETS[config].to_dict(), empty, False)
    if not (Path(config).suffix.lower() in (".json", ".yaml", ".yml") or Path(config).is_file()):
        raise ConfigError(
            f"unknown config {config!r}: not a preset ({', '.join(PRESETS)}) nor a YAML or JSON "
            "file"
        )
    file = config_files.read(config)
    if file.preset is not None and file.preset not in PRESETS:
        raise ConfigError(f"{config}: unknown preset {file.preset!r} ({', '.join(PRESETS)})")
    sections = file.sections or _route_flat(file.flat, config)
    if file.preset is not None:
        return StartingPoint(file.preset, PRESETS[file.preset].to_dict(), sections, file.saved)
    complete = all(
        set(sections[name]) >= {f.name for f in dataclasses.fields(cls)}
        for name, cls in (("optimizer", optim.OptimizerConfig), ("train", TrainConfig))
    )
    notice = (
        f"note: {config} names no preset ({', '.join(PRESETS)}): the training and optimizer "
        f"settings it leaves unset are the {DEFAULT_PRESET!r} presets' (set them as key=value, "
        "or in the file)"
    )
    return StartingPoint(DEFAULT_PRESET, {}, sections, file.saved, () if complete else (notice,))


def _route_flat(fields: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """A flat config file's fields, routed to the three configs as `key=value` overrides are."""
    out: dict[str, dict[str, Any]] = {"model": {}, "optimizer": {}, "train": {}}
    for key, value in fields.items():
        try:
            prefix, name = route_key(str(key), value)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        out[SECTION_OF_PREFIX[prefix]][name] = value
    return out


SECTION_OF_PREFIX = {"model": "model", "optim": "optimizer", "train": "train"}


def route_key(key: str, value: Any = "...") -> tuple[str, str]:
    """(the config that has `key`: "model", "optim" or "train"; the field's name). A `model.`,
    `optim.` or `train.` prefix settles a name that two of them have; ConfigError for a name
    none has, or two have without a prefix."""
    prefixes = {
        "model": {f.name for f in dataclasses.fields(LaplaceConfig)},
        "optim": {f.name for f in dataclasses.fields(optim.OptimizerConfig)},
        "train": {f.name for f in dataclasses.fields(TrainConfig)},
    }
    prefix, dot, name = key.partition(".")
    if dot and prefix in prefixes:
        if name not in prefixes[prefix]:
            raise ConfigError(f"unknown {prefix} config key {name!r}")
        return prefix, name
    owners = [p for p, fields in prefixes.items() if key in fields]
    if not owners:
        known = sorted(set().union(*prefixes.values()))
        raise ConfigError(f"unknown config key {key!r} (known: {', '.join(known)})")
    if len(owners) > 1:
        raise ConfigError(
            f"config key {key!r} is ambiguous ({', '.join(owners)}): write e.g. "
            f"{owners[0]}.{key}={value}"
        )
    return owners[0], key


def split_overrides(items: list[str]) -> dict[str, list[str]]:
    """Route `key=value` strings to the model, optimizer and training configs (`route_key`)."""
    routed: dict[str, list[str]] = {"model": [], "optim": [], "train": []}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        prefix, name = route_key(key, value)
        routed[prefix].append(f"{name}={value}")
    return routed


def optimizer_config(
    preset: str, file_fields: dict[str, Any], overrides: list[str], train_steps: int
) -> tuple[optim.OptimizerConfig, str | None]:
    """The preset's OptimizerConfig with a config file's fields and `key=value` overrides, and a
    notice when the schedule was fitted to the run.

    Unless `total_steps` is overridden the schedule spans the run: total_steps = the run's steps,
    and (unless `warmup_steps` is overridden) warmup at most a tenth of them. The 3B preset
    already matches its run, so it gets no notice.
    """
    base = optim.OPTIMIZER_PRESETS[preset]
    try:
        changes = {**file_fields, **parse_overrides(overrides, optim.OptimizerConfig)}
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


def settings_help() -> str:
    """Every `key=value` setting of the three configs with its default and meaning, and the
    presets' own values where they differ (`python -m train.main --help`)."""
    groups = (
        ("model (LaplaceConfig)", LaplaceConfig, PRESETS),
        ("optimizer (OptimizerConfig; key or optim.key)", optim.OptimizerConfig,
         optim.OPTIMIZER_PRESETS),
        ("training (TrainConfig; key or train.key)", TrainConfig, TRAIN_PRESETS),
    )  # fmt: skip
    lines = [
        "settings: key=value after the flags, or in a --config file; the default is the field's, "
        "and [preset: value] where a preset sets another"
    ]
    for title, cls, presets in groups:
        lines.append(f"\n{title}:")
        for f in dataclasses.fields(cls):
            others = [
                f"{name}: {getattr(p, f.name)}"
                for name, p in presets.items()
                if getattr(p, f.name) != f.default
            ]
            shown = (
                repr(f.default) if isinstance(f.default, str) and " " in f.default else f.default
            )
            lines.append(f"  {f.name}={shown}" + (f"  [{'; '.join(others)}]" if others else ""))
            lines.append(f"      {f.metadata['meaning']}")
    return "\n".join(lines) + "\n"


def config_yaml(cfg: RunConfigs) -> str:
    """The run's three configs as a YAML config file (`--config` reads it back to the same
    configs)."""
    import yaml

    sections = {"model": cfg.model.to_dict(), "optimizer": cfg.optim.to_dict()}
    sections["train"] = cfg.train.to_dict()
    return yaml.safe_dump(sections, sort_keys=False)
