"""The model of a run: its shardings, abstract state, optimizer and jitted steps (`build_model`),
then its state, restored from the newest good checkpoint or initialised (on the devices, or on
the host CPU with `init_on_host=true`, or with `--init-from` from another run's parameters)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from laplace_jax.sharding import abstract_with_shardings
from laplace_spec.config import ConfigError
from train import config as train_config
from train.checkpoint import (
    Checkpointer,
    CheckpointReader,
    ReadError,
    RestoreError,
    config_diff,
)
from train.config import RunConfigs


def build_model(
    cfg: RunConfigs, mesh, masked: bool = False, eot_id: int | None = None
) -> dict[str, Any]:
    """The model's shardings, abstract state, optimizer and the jitted steps (`eot_id`: reset
    the state after each such token, packed documents)."""
    from laplace_jax.model import LaplaceLM, abstract_params
    from laplace_jax.sharding import param_shardings
    from train.step import make_eval_step, make_train_step

    unroll = cfg.train.scan_unroll or jax.default_backend() == "neuron"
    model = LaplaceLM(cfg.model, unroll=unroll, attention_context=cfg.train.attention_context)
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


def restore_or_init(
    cfg: RunConfigs, parts, ckpt: Checkpointer, batches, init_from: str | None = None
):
    """(train state, start step, notice lines): the newest good checkpoint, or a new state when
    there is none, its parameters read from `init_from` when given (`params_from`). Raises
    RestoreError (nothing changed) when checkpoints exist but none can be restored, or when they
    belong to another model or layout, or when `init_from` cannot be read or holds another
    model."""
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
        if init_from is not None:
            params, where = params_from(init_from, cfg.model, parts["abs_params"])
            notes.append(f"initialised from the parameters of {where} (a fresh optimizer)")
        elif cfg.train.init_on_host:
            params = init_params_on_host(cfg.model, cfg.train.seed, parts["p_shard"])
        else:
            key = jax.random.key(cfg.train.seed)
            init = jax.jit(lambda k: init_params(cfg.model, k), out_shardings=parts["p_shard"])
            params = init(key)
        opt_state = jax.jit(parts["tx"].init, out_shardings=parts["o_shard"])(params)
    bad_streak = jax.device_put(jnp.zeros((), jnp.int32), parts["state_shard"]["bad_streak"])
    return {"params": params, "opt_state": opt_state, "bad_streak": bad_streak}, start, notes


def params_from(path: str, model_cfg, abs_params) -> tuple[dict, Path]:
    """`--init-from PATH` (a run, its checkpoint directory or one step's directory; the newest
    step unless a step is named): (its parameters placed as `abs_params` says, the step's
    directory). The model must be this run's but for `seq_len`: that is how a model trained on
    short sequences goes on at longer ones (docs/design.md s11). RestoreError names what differs."""
    from laplace_spec.config import LaplaceConfig

    p = Path(path).absolute()
    step = None
    if p.name.isdigit() and (p / "params").is_dir():
        p, step = p.parent, int(p.name)
    elif (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    try:
        with CheckpointReader(p) as reader:
            step = reader.step(step)
            meta = reader.meta(step) or {}
            try:
                saved = LaplaceConfig.from_saved(meta["model"])
            except (KeyError, TypeError, ValueError, ConfigError) as e:
                raise RestoreError(f"--init-from {path}: no valid model config ({e})") from e
            differs = config_diff(
                saved.replace(seq_len=model_cfg.seq_len).to_dict(), model_cfg.to_dict()
            )
            if differs:
                raise RestoreError(
                    f"--init-from {p / str(step)} holds another model (only seq_len may differ): "
                    + "; ".join(differs)
                )
            return reader.params(step, abs_params), p / str(step)
    except ReadError as e:
        raise RestoreError(f"--init-from {path}: {e}") from e


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
