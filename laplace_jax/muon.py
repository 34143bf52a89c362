"""Muon: Newton-Schulz orthogonalised momentum for the 2-D weight matrices (docs/design.md s4).

Three ways to run the same update, chosen by `mode`:

- `single`: whole matrices, no explicit collectives; on a mesh every device orthogonalises every
  matrix whole (XLA all-gathers the row shards: `gather`'s traffic).
- `gather`: inside `jax.shard_map`, all-gather every gradient (grouped by shape), every device
  orthogonalises every matrix, each keeps its own rows. The baseline: each device sends and
  receives 2 (n-1)/n of the whole bf16 gradient.
- `a2a`: inside `jax.shard_map`, one `all_to_all` hands each device whole matrices, every device
  runs Newton-Schulz on its own, a second `all_to_all` returns the row shards.

The a2a tile layout and the `shard_map` executor are in `laplace_jax/muon_tiles.py`, Newton-Schulz
itself in `laplace_jax/newton_schulz.py`, the traffic and FLOP counts in
`laplace_jax/muon_accounting.py`.

The three modes perform the same floating-point operations in the same order: the Nesterov
direction is cast to `ns_dtype` (that is what travels), and every mode runs one arithmetic on it
(laplace_jax/newton_schulz.py): column tiles of one width per short side, fixed by the model's
shapes, sums over tiles added left to right in column order, Grams accumulated in fp32 before
being rounded to `ns_dtype`. On a mesh, `single` orthogonalises whole matrices on every device.
So a run can switch modes, or be checked against one device, bit for bit (docs/design.md s4.2).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec

from laplace_jax.muon_tiles import (
    TilePool,
    ns_grouped,
    orthogonalize_sharded,
    plan_tiles,
    rows_split,
)
from laplace_jax.newton_schulz import NS_DTYPES, tile_widths
from laplace_jax.sharding import FSDP, axis_size

f32 = jnp.float32

MODES = ("single", "gather", "a2a")
SHAPE_FACTORS = ("max_ratio", "adamw_rms")


def shape_factor(kernel_shape: tuple[int, int], kind: str) -> float:
    """Update scale of one matrix. `kernel_shape` is the stored (in, out); W = kernel^T.

    - `max_ratio`: max(1, rows/cols) ** 0.5 of W (Keller Jordan's Muon, rows = out features);
    - `adamw_rms`: 0.2 sqrt(max(rows, cols)) (Moonlight): the update's RMS is about 0.2, AdamW's,
      so Muon and AdamW share one learning rate and one weight decay. This is the default.
    """
    fan_in, fan_out = kernel_shape
    if kind == "max_ratio":
        return max(1.0, fan_out / fan_in) ** 0.5
    if kind == "adamw_rms":
        return 0.2 * math.sqrt(max(fan_in, fan_out))
    raise ValueError(f"shape_factor must be one of {SHAPE_FACTORS}, got {kind!r}")


@dataclasses.dataclass(frozen=True)
class MuonPlan:
    """Static description of how the Muon matrices are orthogonalised.

    `shapes`: path -> stored kernel shape of every Muon matrix; `mesh` and `specs` (path -> the
    matrix's PartitionSpec, as the rules table of laplace_jax/sharding.py placed it: rows split
    over `axis`, or whole) are needed in `gather` and `a2a` modes. `axis` is one mesh axis or
    a tuple of them (`("fsdp", "context")` on a mesh with a context axis: the all_to_all then
    runs over both, their devices numbered fsdp-major as the rows are split).
    """

    shapes: dict[str, tuple[int, int]]
    mode: str = "single"
    ns_steps: int = 5
    ns_dtype: str = "bfloat16"
    shape_factor: str = "adamw_rms"
    mesh: Mesh | None = None
    axis: str | tuple[str, ...] = FSDP
    specs: dict[str, PartitionSpec] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"muon mode must be one of {MODES}, got {self.mode!r}")
        if self.ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {tuple(NS_DTYPES)}, got {self.ns_dtype!r}")
        if self.shape_factor not in SHAPE_FACTORS:
            raise ValueError(f"shape_factor must be one of {SHAPE_FACTORS}")
        if self.mode != "single" and self.mesh is None:
            raise ValueError(f"muon mode {self.mode!r} needs a mesh")
        for path, spec in self.specs.items():
            rows, rest = (tuple(spec) + (None,))[0], tuple(spec)[1:]
            if rows not in (None, self.axis) or any(e is not None for e in rest):
                raise ValueError(f"Muon needs ({self.axis}, None) or whole matrices: {path} {spec}")

    @property
    def sharded(self) -> frozenset[str]:
        """The paths whose rows are split over `axis`."""
        return frozenset(p for p, spec in self.specs.items() if rows_split(spec, self.axis))

    @property
    def n(self) -> int:
        return 1 if self.mesh is None else axis_size(self.mesh, self.axis)

    @property
    def dtype(self):
        return NS_DTYPES[self.ns_dtype]

    @property
    def widths(self) -> dict[int, int]:
        """Short side -> tile width of the Newton-Schulz arithmetic (all modes)."""
        return tile_widths(self.shapes.values())

    def pools(self) -> tuple[list[TilePool], list[str]]:
        sharded = {p: s for p, s in self.shapes.items() if p in self.sharded}
        return plan_tiles(sharded, self.n, self.widths)

    # ---- the update ----
    def orthogonalize(self, grads: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """path -> f32 gradient (Nesterov direction) -> path -> f32 scaled orthogonal update."""
        if self.n == 1:
            out = ns_grouped(grads, self.widths, self.ns_steps, self.dtype)
        else:
            out = orthogonalize_sharded(
                grads,
                mode=self.mode,
                mesh=self.mesh,
                axis=self.axis,
                specs=self.specs,
                widths=self.widths,
                steps=self.ns_steps,
                dtype=self.dtype,
            )
        return {
            p: out[p].astype(f32) * shape_factor(self.shapes[p], self.shape_factor) for p in grads
        }


# ---- the optax transformation ------------------------------------------------------------------


class ScaleByMuonState(NamedTuple):
    momentum: Any  # fp32, shaped (and sharded) like the Muon parameters


def scale_by_muon(
    plan: MuonPlan, momentum: float = 0.95, nesterov: bool = True
) -> optax.GradientTransformation:
    """Momentum, Nesterov, Newton-Schulz and the shape factor; no learning rate, no decay.

    Leaves are matched to `plan.shapes` by their `/`-joined path; leaves masked out by
    `optax.partition` (`MaskedNode`) are not leaves and are skipped.
    """

    def init_fn(params):
        return ScaleByMuonState(jax.tree.map(lambda p: jnp.zeros(p.shape, f32), params))

    def update_fn(updates, state, params=None):
        del params
        mom = jax.tree.map(lambda m, g: momentum * m + g.astype(f32), state.momentum, updates)
        if nesterov:
            direction = jax.tree.map(lambda m, g: g.astype(f32) + momentum * m, mom, updates)
        else:
            direction = mom
        leaves, treedef = jax.tree_util.tree_flatten_with_path(direction)
        paths = [jax.tree_util.keystr(kp, simple=True, separator="/") for kp, _ in leaves]
        unknown = [p for p in paths if p not in plan.shapes]
        if unknown:
            raise KeyError(f"Muon got parameters outside its plan: {unknown[:3]}")
        ortho = plan.orthogonalize({p: x for p, (_, x) in zip(paths, leaves, strict=True)})
        new = jax.tree_util.tree_unflatten(treedef, [ortho[p] for p in paths])
        return new, ScaleByMuonState(mom)

    return optax.GradientTransformation(init_fn, update_fn)


def muon(
    learning_rate: float | Callable,
    plan: MuonPlan,
    momentum: float = 0.95,
    nesterov: bool = True,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
    """Muon with decoupled weight decay: p <- p - lr (shape * NS(nesterov(G)) + wd p)."""
    return optax.chain(
        scale_by_muon(plan, momentum, nesterov),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
