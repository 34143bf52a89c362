"""Orbax checkpoints of a training run: save asynchronously, keep the last N, restore safely.

A checkpoint is an orbax Composite of four items (the exporter reads `params` and `meta`):

- `params`: the plain Flax params dict (docs/parameters.md), fp32;
- `opt_state`: the optax optimizer state;
- `data`: the grain iterator state (a small JSON dict), so a resumed run sees the next batch;
- `meta`: JSON with the step, the model config, the optimizer and training configs and the
  tokenizer reference.

Restoring takes target shardings, so a checkpoint written on 8 devices restores onto 4 (or 64).
A checkpoint whose model or optimizer config differs from the requested one is refused, naming
the fields; one that cannot be read (partial, corrupt) is skipped, with a warning, for the
previous one.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)

ITEMS = ("params", "opt_state", "data", "meta")


class ConfigMismatch(ValueError):
    """The checkpoint was written for another model or optimizer configuration."""


def config_diff(saved: dict, requested: dict) -> list[str]:
    """`["d_model: checkpoint 64, requested 128", ...]` for every differing field."""
    out = []
    for key in sorted(set(saved) | set(requested)):
        a, b = saved.get(key, "<absent>"), requested.get(key, "<absent>")
        if a != b:
            out.append(f"{key}: checkpoint {a!r}, requested {b!r}")
    return out


def check_compatible(meta: dict, requested: dict[str, dict], where: str) -> None:
    """Raise ConfigMismatch if any of the `requested` config dicts differs from the saved one."""
    problems = []
    for section, want in requested.items():
        have = meta.get(section)
        if have is None:
            continue
        problems += [f"{section}.{d}" for d in config_diff(have, want)]
    if problems:
        raise ConfigMismatch(
            f"checkpoint {where} was written for a different configuration; differing fields:\n  "
            + "\n  ".join(problems)
            + "\nuse another --run-dir/--ckpt-dir, or the checkpoint's configuration"
        )


class Checkpointer:
    """A thin wrapper over `ocp.CheckpointManager` with the run's four items."""

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=async_save,
                create=True,
            ),
            item_names=ITEMS,
        )

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, params, opt_state, data_state: dict, meta: dict) -> None:
        """Start an asynchronous save (the arrays are copied before this returns)."""
        self.manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave({**meta, "step": step}),
            ),
            force=True,
        )

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]

    def restore_latest(
        self,
        abstract_params,
        abstract_opt_state,
        requested: dict[str, dict] | None = None,
    ) -> dict[str, Any] | None:
        """Newest readable checkpoint as {step, params, opt_state, data, meta}, or None.

        `abstract_*` are pytrees of `jax.ShapeDtypeStruct` carrying the target shardings.
        """
        for step in reversed(self.all_steps()):
            where = str(self.directory / str(step))
            try:
                meta = self.read_meta(step)
            except Exception as e:  # noqa: BLE001 - any unreadable checkpoint is skipped
                _warn(f"checkpoint {where} has no readable meta ({_short(e)}); skipping it")
                continue
            if requested:
                check_compatible(meta, requested, where)  # refuses, never skips
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        params=ocp.args.StandardRestore(abstract_params),
                        opt_state=ocp.args.StandardRestore(abstract_opt_state),
                        data=ocp.args.JsonRestore(),
                    ),
                )
            except Exception as e:  # noqa: BLE001
                _warn(f"checkpoint {where} is corrupt or partial ({_short(e)}); skipping it")
                continue
            return {
                "step": step,
                "params": restored["params"],
                "opt_state": restored["opt_state"],
                "data": restored["data"],
                "meta": meta,
            }
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_with_shardings(tree, shardings):
    """ShapeDtypeStructs of `tree` (arrays or structs) placed with `shardings`."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def _short(e: Exception) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) < 300 else text[:300] + "..."


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    log.warning(message)
