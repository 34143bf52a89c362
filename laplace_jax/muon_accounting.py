"""Muon's cost, counted from shapes: collective bytes per device and Newton-Schulz FLOPs.

`bench/muon.py` checks these counts against the collectives of the compiled program.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from laplace_jax.muon import MuonPlan
from laplace_jax.muon_tiles import TilePool


def ns_flops(shape: tuple[int, int], steps: int = 5) -> int:
    """FLOPs of Newton-Schulz on one matrix: per step X X^T, A A and B X on the wide form."""
    r, c = sorted(shape)
    return steps * (4 * r * r * c + 2 * r**3)


def gather_bytes_per_device(shapes: dict[str, tuple[int, int]], n: int, itemsize: int) -> int:
    """all-gather of every gradient: (n-1)/n of the whole sent and as much received."""
    total = sum(math.prod(s) for s in shapes.values())
    return 2 * (n - 1) * total * itemsize // n


def a2a_bytes_per_device(pools: list[TilePool], itemsize: int) -> int:
    """Two all_to_all of [n, T, s w / n] each: (n-1)/n sent and as much received, twice."""
    return sum(
        4 * (p.n_devices - 1) * p.tile_slots * p.short_side * p.tile_width * itemsize // p.n_devices
        for p in pools
    )


def bytes_per_device(plan: MuonPlan) -> int:
    """Collective bytes (sent + received) per device per step of `plan` in its mode."""
    item = jnp.dtype(plan.dtype).itemsize
    sharded = {p: s for p, s in plan.shapes.items() if p in plan.sharded}
    if plan.n == 1:
        return 0
    if plan.mode in ("single", "gather"):  # single: XLA all-gathers the shards into whole ones
        return gather_bytes_per_device(sharded, plan.n, item)
    pools, rest = plan.pools()
    rest_shapes = {p: sharded[p] for p in rest}
    return a2a_bytes_per_device(pools, item) + gather_bytes_per_device(rest_shapes, plan.n, item)


def ns_flops_per_device(plan: MuonPlan) -> int:
    """Newton-Schulz FLOPs one device executes (the SPMD program, empty slots included)."""
    steps = plan.ns_steps
    if plan.mode in ("single", "gather"):
        return sum(ns_flops(s, steps) for s in plan.shapes.values())
    pools, rest = plan.pools()
    flops = sum(ns_flops(plan.shapes[p], steps) for p in plan.shapes if p not in plan.sharded)
    flops += sum(ns_flops(plan.shapes[p], steps) for p in rest)
    for p in pools:
        s, w = p.short_side, p.tile_width
        flops += steps * (4 * p.tile_slots * s * s * w + 2 * p.matrix_slots * s**3)
    return flops
