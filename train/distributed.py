"""Joining a multi-process run: `jax.distributed.initialize` from the environment (what
`train.neuron launch` sets) or, with `--distributed`, from the cluster JAX detects itself."""

from __future__ import annotations

import os

import jax


def maybe_initialize_distributed(force: bool) -> None:
    """JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID when set; else, with `force`
    (`--distributed`), JAX's own cluster detection (SLURM, Cloud TPU); else one process."""
    env = os.environ
    if "JAX_COORDINATOR_ADDRESS" in env:
        jax.distributed.initialize(
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(env.get("JAX_NUM_PROCESSES", "1")),
            process_id=int(env.get("JAX_PROCESS_ID", "0")),
        )
    elif force:
        jax.distributed.initialize()
