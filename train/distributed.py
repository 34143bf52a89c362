"""Joining a multi-process run: `jax.distributed.initialize` from the environment (what
`train.neuron launch` sets) or, with `--distributed`, from the cluster JAX detects itself; a
process lost later is reported and ends the run (train/lost_peer.py)."""

from __future__ import annotations

import os

from train.lost_peer import DEFAULT_HEARTBEAT_TIMEOUT_S, initialize_distributed


def maybe_initialize_distributed(
    force: bool, heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S
) -> None:
    """JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID when set; else, with `force`
    (`--distributed`), JAX's own cluster detection (SLURM, Cloud TPU); else one process. A
    process silent for `heartbeat_timeout_s` seconds counts as lost."""
    env = os.environ
    if "JAX_COORDINATOR_ADDRESS" in env:
        initialize_distributed(
            heartbeat_timeout_s,
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(env.get("JAX_NUM_PROCESSES", "1")),
            process_id=int(env.get("JAX_PROCESS_ID", "0")),
        )
    elif force:
        initialize_distributed(heartbeat_timeout_s)
