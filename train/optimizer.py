"""The trainer's view of `laplace_jax.optim`: config with overrides, schedule, optax chain."""

from __future__ import annotations

import dataclasses

from laplace_jax import optim
from laplace_jax.config import ConfigError, parse_overrides


def optimizer_config(model_preset: str, overrides: list[str], train_steps: int):
    """The preset's OptimizerConfig (`small`'s for a JSON model) with `key=value` overrides.

    Unless `total_steps` or `warmup_steps` is overridden, the schedule spans the run: total_steps
    = the run's steps, warmup at most a tenth of them (the 3B preset already matches its run).
    """
    base = optim.OPTIMIZER_PRESETS.get(model_preset, optim.OPTIMIZER_PRESETS["small"])
    try:
        changes = parse_overrides(overrides, optim.OptimizerConfig)
        if "total_steps" not in changes:
            changes["total_steps"] = train_steps
            if "warmup_steps" not in changes:
                changes["warmup_steps"] = min(base.warmup_steps, max(train_steps // 10, 1))
        return dataclasses.replace(base, **changes)
    except ValueError as e:  # the dataclass validates itself
        raise ConfigError(f"optimizer config: {e}") from e


def optimizer_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(optim.OptimizerConfig)}


def build(opt_cfg, params_like, param_shardings, mesh):
    """(optax transformation, learning-rate schedule, optimizer-state shardings).

    `params_like` should carry the parameter shardings, so Muon sees how each matrix is split.
    """
    tx = optim.make_optimizer(opt_cfg, params_like, mesh=mesh)
    shardings = optim.opt_state_shardings(tx, params_like, param_shardings)
    return tx, optim.learning_rate_schedule(opt_cfg), shardings
