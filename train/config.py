"""Training hyperparameters: one frozen dataclass, defaults per model preset.

The model's shape lives in `LaplaceConfig`, the optimizer's in `OptimizerConfig`
(laplace_jax/optim.py); this is the rest: how long, how big a batch, how often to log, evaluate
and checkpoint, and the guards. Every field can be set as `key=value` on the command line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from laplace_jax.config import ConfigError


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
    peak_flops: float = 0.0  # MFU denominator in FLOP/s; 0 = measure the matmul rate now
    sample_tokens: int = 48  # greedy tokens printed at the end; 0 = none
    sample_prompt: str = "def "  # prompt of that sample

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", "float") and v < 0:
                raise ConfigError(f"{f.name} must be >= 0, got {v!r}")
        for name in ("steps", "global_batch_tokens", "log_every", "keep_checkpoints"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")

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
    ),
}


def train_preset(model_preset: str) -> TrainConfig:
    return TRAIN_PRESETS.get(model_preset, TrainConfig())


def batch_layout(
    cfg: TrainConfig, seq_len: int, n_devices: int, n_processes: int = 1
) -> tuple[int, int, int]:
    """(global sequences B, accumulation steps A, micro-batch M) with B = A * M; checked."""
    if cfg.global_batch_tokens % seq_len:
        raise ConfigError(
            f"global_batch_tokens ({cfg.global_batch_tokens}) must be a multiple of seq_len "
            f"({seq_len})"
        )
    B = cfg.global_batch_tokens // seq_len
    M = cfg.micro_batch_size or B
    if B % M:
        raise ConfigError(f"micro_batch_size ({M}) must divide the global batch ({B} sequences)")
    if M % n_devices:
        raise ConfigError(
            f"the micro-batch ({M} sequences) must divide over the {n_devices} devices of the "
            f"mesh: set micro_batch_size or global_batch_tokens accordingly"
        )
    if M % n_processes:
        raise ConfigError(f"the micro-batch ({M}) must divide over {n_processes} processes")
    return B, B // M, M
