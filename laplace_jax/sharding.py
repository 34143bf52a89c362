"""Sharding as a rules table: logical axis names (from the model) -> mesh axes.

The model tags every parameter with logical axes (`("embed", "mlp")`); this module alone decides
where they go. Changing the parallelism changes `LOGICAL_RULES`, never the model.

FSDP over one mesh axis `fsdp`: the first axis of every matrix is split over the devices (so each
Muon matrix is sharded on dim 0 of its stored kernel), the batch too; 1-D parameters and any
axis that does not divide by the mesh size stay replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from laplace_jax.config import LaplaceConfig
from laplace_jax.model import abstract_params, param_logical_axes

FSDP = "fsdp"

# (logical axis, mesh axis or None). A logical axis takes its mesh axis only if that mesh axis is
# not already used by an earlier dimension of the same array and divides the dimension.
LOGICAL_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", FSDP),
    ("vocab", FSDP),
    ("embed", FSDP),
    ("attn", FSDP),
    ("mlp", FSDP),
    ("qkvg", None),
    ("heads", None),
    ("head_k", None),
    ("head_v", None),
    ("tiers", None),
    ("conv", None),
    ("norm", None),
    ("length", None),
)


def make_mesh(n_devices: int | None = None, devices=None) -> Mesh:
    """A 1-D mesh with axis `fsdp` over the first `n_devices` devices (default: all)."""
    devices = jax.devices() if devices is None else devices
    n = len(devices) if n_devices is None else n_devices
    if not 1 <= n <= len(devices):
        raise ValueError(f"mesh of {n} devices requested, {len(devices)} available")
    return Mesh(np.asarray(devices[:n]), (FSDP,))


def logical_to_spec(
    axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh, rules=LOGICAL_RULES
) -> PartitionSpec:
    """Resolve one array's logical axes to a PartitionSpec under `rules`."""
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name, size in zip(axes, shape, strict=True):
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no rule in the sharding table")
        mesh_axis = table[name]
        if mesh_axis is not None and mesh_axis not in used and size % mesh.shape[mesh_axis] == 0:
            used.add(mesh_axis)
            spec.append(mesh_axis)
        else:
            spec.append(None)
    return PartitionSpec(*spec)


def param_specs(config: LaplaceConfig, mesh: Mesh, rules=LOGICAL_RULES) -> dict:
    """PartitionSpec of every parameter, shaped like the params dict."""
    shapes = abstract_params(config)
    axes = param_logical_axes(config)
    return jax.tree.map(
        lambda a, s: logical_to_spec(a, s.shape, mesh, rules),
        axes,
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def param_shardings(config: LaplaceConfig, mesh: Mesh, rules=LOGICAL_RULES) -> dict:
    """NamedSharding of every parameter, shaped like the params dict."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        param_specs(config, mesh, rules),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Token batches [B, T]: sequences split over `fsdp`."""
    return NamedSharding(mesh, PartitionSpec(FSDP, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
