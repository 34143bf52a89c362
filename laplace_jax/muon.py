"""Muon: Newton-Schulz orthogonalised momentum for the 2-D weight matrices (DESIGN.md s4).

Three ways to run the same update, chosen by `mode`:

- `single`: whole matrices, no explicit collectives (one device, or let XLA partition it).
- `gather`: inside `jax.shard_map`, all-gather every gradient (grouped by shape), every device
  orthogonalises every matrix, each keeps its own rows. The baseline: each device sends and
  receives 2 (n-1)/n of the whole bf16 gradient.
- `a2a`: inside `jax.shard_map`, one `all_to_all` hands each device whole matrices, every device
  runs Newton-Schulz on its own, a second `all_to_all` returns the row shards.

The a2a layout ("tiles"). Every Laplace Muon matrix, turned wide (rows <= cols), has the short
side D and a long side that is a multiple of w = gcd(long sides) (1,024 for 3B). Newton-Schulz
on X = [X_1 .. X_k] (column tiles of width w) only needs the Gram A = sum_t X_t X_t^T of each
matrix; B = b A + c A A is per matrix and X_t <- a X_t + B X_t is per tile. So a device's work
is a fixed number T of (D x w) tile slots plus M matrix slots, the same on every device (SPMD:
one program, no `lax.cond`), while which matrix a tile belongs to is data (a one-hot [M, T] table
row picked by `axis_index`). Matrices are packed whole onto devices by first-fit-decreasing on
their tile counts into n bins of capacity T (T = the smallest capacity that fits; for 3B on 64
devices T = 16, set by W_12, the largest matrix), all static.

Each device's row shard of a matrix cuts every tile into n equal pieces of D w / n elements:
a wide kernel [D, c] sharded on rows gives (D/n x w) pieces; a tall kernel [c, D] (W_3) sharded
on its rows gives (w/n x D) pieces, i.e. X^T's columns interleaved across devices: tile t of a
tall matrix is the column set {i c/n + t w/n + q}, a column permutation, which Newton-Schulz
commutes with (Gram and norm are invariant, B X permutes alike). The send buffer is
[n, T, D w / n]: piece (owner, slot) in a static layout, empty slots zero. Bytes per device per
all_to_all: (n-1)/n T D w sent and as many received, so in total 4 (n-1)/n T D w * itemsize.
Padding is never computed on within a tile (tiles are exact); a device whose bin is not full
runs its empty tile slots on zeros, which costs no step time because the fullest device sets
the pace (the program is the same everywhere).

Why not 32x for 3B: the ideal 4 S / n (S = the whole gradient) needs every device to hold 1/n of
the elements, but one W_12 (50.3M elements) is larger than 1/64 of all Muon elements (42.5M), and
whole matrices are what Newton-Schulz needs. The bound with whole matrices is
gather / a2a = 2 S / (4 max_load) = 2,717,908,992 / (2 x 50,331,648) = 27.0x, which this layout
reaches.

Numerics are the same in all modes: the Nesterov direction is cast to `ns_dtype` (that is what
travels), normalised by its Frobenius norm computed in fp32, and the Gram matrices accumulate in
fp32 before being rounded to `ns_dtype`. `gather` is bit-identical to `single`; `a2a` sums each
Gram over column tiles (in a permuted column order for W_3), so it agrees with `single` to fp32
reassociation, which bf16 rounding can amplify by an ulp (tests/test_muon.py states the bound).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec

f32 = jnp.float32

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic (a, b, c) of Keller Jordan's Muon
NS_EPS = 1e-7
MODES = ("single", "gather", "a2a")
SHAPE_FACTORS = ("max_ratio", "adamw_rms")
NS_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


# ---- the maths on one matrix ------------------------------------------------------------------


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


def _mm(x, y):
    """Matmul of `ns_dtype` operands with fp32 accumulation and an fp32 result."""
    return jnp.matmul(x, y, preferred_element_type=f32)


def _gram(x):
    """x x^T of [..., r, c] in fp32 accumulation, rounded to x's dtype."""
    return _mm(x, jnp.swapaxes(x, -1, -2)).astype(x.dtype)


def newton_schulz(g, steps: int = 5, dtype=jnp.bfloat16, eps: float = NS_EPS):
    """Orthogonalise g [..., r, c] (batched over leading axes): 5 quintic iterations.

    Returns an array of g's shape in `dtype` whose singular values lie near 1 (the quintic does
    not converge to exactly 1: roughly [0.7, 1.2]); a zero matrix gives zeros.
    """
    a, b, c = NS_COEFFS
    x = jnp.asarray(g).astype(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = jnp.swapaxes(x, -1, -2)
    x32 = x.astype(f32)
    norm = jnp.sqrt(jnp.sum(jnp.square(x32), axis=(-2, -1), keepdims=True))
    x = (x32 / (norm + eps)).astype(dtype)
    for _ in range(steps):  # static unroll: no data-dependent loop
        A = _gram(x)
        B = (b * A.astype(f32) + c * _mm(A, A)).astype(dtype)
        x = (a * x.astype(f32) + _mm(B, x)).astype(dtype)
    return jnp.swapaxes(x, -1, -2) if tall else x


def ns_flops(shape: tuple[int, int], steps: int = 5) -> int:
    """FLOPs of Newton-Schulz on one matrix: per step X X^T, A A and B X on the wide form."""
    r, c = sorted(shape)
    return steps * (4 * r * r * c + 2 * r**3)


# ---- the a2a plan ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TileMatrix:
    path: str
    shape: tuple[int, int]  # stored kernel (rows sharded over the mesh)
    tall: bool  # rows > cols: the pieces are (w/n x D) row blocks of the kernel
    n_tiles: int
    owner: int  # device that orthogonalises it
    first_slot: int  # its tiles occupy slots [first_slot, first_slot + n_tiles) of the owner
    local: int  # its matrix slot on the owner


@dataclasses.dataclass(frozen=True)
class TilePool:
    """One a2a layout for matrices sharing the short side `s` (all of Laplace's: D)."""

    n: int
    s: int
    w: int  # tile width (long side)
    T: int  # tile slots per device
    M: int  # matrix slots per device
    matrices: tuple[TileMatrix, ...]

    @property
    def piece(self) -> int:
        return self.s * self.w // self.n

    def seg_table(self) -> np.ndarray:
        """[n, M, T] one-hot: tile slot -> matrix slot, per device."""
        seg = np.zeros((self.n, self.M, self.T), np.float32)
        for m in self.matrices:
            seg[m.owner, m.local, m.first_slot : m.first_slot + m.n_tiles] = 1.0
        return seg

    def tall_table(self) -> np.ndarray:
        tall = np.zeros((self.n, self.T), bool)
        for m in self.matrices:
            tall[m.owner, m.first_slot : m.first_slot + m.n_tiles] = m.tall
        return tall

    def loads(self) -> list[int]:
        """Tiles really used on each device."""
        out = [0] * self.n
        for m in self.matrices:
            out[m.owner] += m.n_tiles
        return out


def _pack(sizes: dict[str, int], n: int, capacity: int, rule: str):
    """Pack whole matrices (sizes in tiles) into n bins: path -> (bin, first slot), or None.

    Largest first; `first_fit` takes the first bin with room, `fewest` the bin with room holding
    the fewest matrices (then the fullest), which keeps the matrix slots per device low.
    """
    free, count = [capacity] * n, [0] * n
    out = {}
    for path in sorted(sizes, key=lambda p: (-sizes[p], p)):
        size = sizes[path]
        fits = [j for j in range(n) if free[j] >= size]
        if not fits:
            return None
        j = fits[0] if rule == "first_fit" else min(fits, key=lambda j: (count[j], free[j], j))
        out[path] = (j, capacity - free[j])
        free[j] -= size
        count[j] += 1
    return out


def _best_packing(sizes: dict[str, int], n: int) -> tuple[int, dict[str, tuple[int, int]]]:
    """The smallest capacity T any rule fits in, then the fewest matrices on one device."""
    cap = max(max(sizes.values()), -(-sum(sizes.values()) // n))
    while True:
        found = [p for rule in ("fewest", "first_fit") if (p := _pack(sizes, n, cap, rule))]
        if found:

            def most(placed):
                return max(np.bincount([j for j, _ in placed.values()], minlength=n))

            return cap, min(found, key=most)
        cap += 1


def plan_tiles(shapes: dict[str, tuple[int, int]], n: int) -> tuple[list[TilePool], list[str]]:
    """Pack row-sharded matrices into a2a tile pools; returns (pools, paths left for gather)."""
    by_s: dict[int, list[str]] = {}
    for path, shape in shapes.items():
        by_s.setdefault(min(shape), []).append(path)
    pools, rest = [], []
    for s, paths in sorted(by_s.items()):
        w = math.gcd(*(max(shapes[p]) for p in paths))
        ok = []
        for p in paths:
            r, c = shapes[p]
            tall = r > c
            # wide: rows (= s) split in n; tall: each tile's w rows split in n.
            if r % n or (tall and w % n) or (not tall and s % n):
                rest.append(p)
            else:
                ok.append(p)
        if not ok:
            continue
        tiles = {p: max(shapes[p]) // w for p in ok}
        cap, placed = _best_packing(tiles, n)
        locals_: dict[int, int] = {}
        mats = []
        for p in ok:
            j, off = placed[p]
            mats.append(
                TileMatrix(
                    p,
                    shapes[p],
                    shapes[p][0] > shapes[p][1],
                    tiles[p],
                    j,
                    off,
                    locals_.setdefault(j, 0),
                )
            )
            locals_[j] += 1
        # matrix slots are numbered in order of placement per device
        M = max(locals_.values())
        pools.append(TilePool(n, s, w, cap, M, tuple(mats)))
    return pools, rest


# ---- traffic and FLOP accounting -----------------------------------------------------------------


def gather_bytes_per_device(shapes: dict[str, tuple[int, int]], n: int, itemsize: int) -> int:
    """all-gather of every gradient: (n-1)/n of the whole sent and as much received."""
    total = sum(math.prod(s) for s in shapes.values())
    return 2 * (n - 1) * total * itemsize // n


def a2a_bytes_per_device(pools: list[TilePool], itemsize: int) -> int:
    """Two all_to_all of [n, T, D w / n] each: (n-1)/n sent and as much received, twice."""
    return sum(4 * (p.n - 1) * p.T * p.s * p.w * itemsize // p.n for p in pools)


# ---- orthogonalisation in the three modes --------------------------------------------------------


def _groups(shapes: dict[str, tuple[int, ...]]) -> dict[tuple[int, ...], list[str]]:
    out: dict[tuple[int, ...], list[str]] = {}
    for path in sorted(shapes):
        out.setdefault(tuple(shapes[path]), []).append(path)
    return out


def _ns_grouped(mats: dict[str, jax.Array], steps, dtype) -> dict[str, jax.Array]:
    """Newton-Schulz on whole matrices, batched over matrices of one shape."""
    out = {}
    for _, paths in _groups({p: m.shape for p, m in mats.items()}).items():
        y = newton_schulz(jnp.stack([mats[p] for p in paths]), steps, dtype)
        out.update({p: y[i] for i, p in enumerate(paths)})
    return out


def _ns_tiles(x, seg, steps: int, dtype, eps: float = NS_EPS):
    """Newton-Schulz on tile slots x [T, s, w] of M matrices, seg [M, T] one-hot (fp32)."""
    a, b, c = NS_COEFFS
    x32 = x.astype(f32)
    sq = jnp.sum(jnp.square(x32), axis=(1, 2))  # [T]
    norm = jnp.sqrt(seg @ sq)  # [M]
    x = (x32 / (seg.T @ norm + eps)[:, None, None]).astype(dtype)
    for _ in range(steps):
        g = jnp.einsum("tiw,tjw->tij", x, x, preferred_element_type=f32)
        A = jnp.einsum("mt,tij->mij", seg, g).astype(dtype)
        B = b * A.astype(f32) + c * _mm(A, A)
        Bt = jnp.einsum("mt,mij->tij", seg, B).astype(dtype)  # exact: one-hot
        x = (a * x.astype(f32) + _mm(Bt, x)).astype(dtype)
    return x


def _a2a_pool(pool: TilePool, local: dict[str, jax.Array], axis: str, steps, dtype):
    """Inside shard_map: row shards of the pool's matrices -> their orthogonalised row shards."""
    n, s, w, T = pool.n, pool.s, pool.w, pool.T
    # 1. cut each local shard into its per-tile pieces [n_tiles, s w / n]
    pieces = {}
    for m in pool.matrices:
        g = local[m.path].astype(dtype)
        if m.tall:  # [c/n, s]: tile t holds rows t w/n .. (t+1) w/n of this shard
            pieces[m.path] = g.reshape(m.n_tiles, pool.piece)
        else:  # [s/n, c]: tile t holds columns t w .. (t+1) w
            pieces[m.path] = (
                g.reshape(s // n, m.n_tiles, w).transpose(1, 0, 2).reshape(m.n_tiles, pool.piece)
            )
    # 2. static send layout [n, T, piece]: owner j, slots of its bin; empty slots are zeros
    by_owner: dict[int, list[TileMatrix]] = {}
    for m in pool.matrices:
        by_owner.setdefault(m.owner, []).append(m)
    rows = []
    for j in range(n):
        parts, used = [], 0
        for m in sorted(by_owner.get(j, []), key=lambda m: m.first_slot):
            parts.append(pieces[m.path])
            used += m.n_tiles
        if used < T:
            parts.append(jnp.zeros((T - used, pool.piece), dtype))
        rows.append(jnp.concatenate(parts) if len(parts) > 1 else parts[0])
    send = jnp.stack(rows)
    recv = jax.lax.all_to_all(send, axis, 0, 0)  # [n sources, T, piece]
    # 3. assemble whole tiles [T, s, w]; which slots hold a tall matrix is per-device data
    me = jax.lax.axis_index(axis)
    tall_tab = pool.tall_table()
    wide_x = recv.reshape(n, T, s // n, w).transpose(1, 0, 2, 3).reshape(T, s, w)
    tall_x = None
    if tall_tab.any():  # (w/n x s) row pieces of the kernel -> (s x w) columns of X
        tall_x = recv.reshape(n, T, w // n, s).transpose(1, 0, 2, 3).reshape(T, w, s)
        tall_x = tall_x.transpose(0, 2, 1)
    if tall_x is None:
        x = wide_x
    elif tall_tab.all():
        x = tall_x
    else:
        mask = jax.lax.dynamic_index_in_dim(jnp.asarray(tall_tab), me, keepdims=False)
        x = jnp.where(mask[:, None, None], tall_x, wide_x)
    seg = jax.lax.dynamic_index_in_dim(jnp.asarray(pool.seg_table()), me, keepdims=False)
    y = _ns_tiles(x, seg, steps, dtype)
    # 4. back to pieces in the same layout, second all_to_all, unpack the own rows
    wide_back = y.reshape(T, n, s // n, w).transpose(1, 0, 2, 3).reshape(n, T, pool.piece)
    if tall_x is None:
        out_send = wide_back
    else:
        tall_back = y.transpose(0, 2, 1).reshape(T, n, w // n, s).transpose(1, 0, 2, 3)
        tall_back = tall_back.reshape(n, T, pool.piece)
        out_send = (
            tall_back if tall_tab.all() else jnp.where(mask[None, :, None], tall_back, wide_back)
        )
    back = jax.lax.all_to_all(out_send, axis, 0, 0)  # [n owners, T, piece]
    out = {}
    for m in pool.matrices:
        p = back[m.owner, m.first_slot : m.first_slot + m.n_tiles]
        r, c = m.shape
        if m.tall:
            out[m.path] = p.reshape(r // n, c)
        else:
            out[m.path] = p.reshape(m.n_tiles, s // n, w).transpose(1, 0, 2).reshape(s // n, c)
    return out


@dataclasses.dataclass(frozen=True)
class MuonPlan:
    """Static description of how the Muon matrices are orthogonalised.

    `shapes`: path -> stored kernel shape of every Muon matrix; `mesh` and `sharded` (the paths
    whose rows are split over `axis`) are needed in `gather` and `a2a` modes.
    """

    shapes: dict[str, tuple[int, int]]
    mode: str = "single"
    ns_steps: int = 5
    ns_dtype: str = "bfloat16"
    shape_factor: str = "adamw_rms"
    mesh: Mesh | None = None
    axis: str = "fsdp"
    sharded: frozenset[str] = frozenset()

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"muon mode must be one of {MODES}, got {self.mode!r}")
        if self.ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {tuple(NS_DTYPES)}, got {self.ns_dtype!r}")
        if self.shape_factor not in SHAPE_FACTORS:
            raise ValueError(f"shape_factor must be one of {SHAPE_FACTORS}")
        if self.mode != "single" and self.mesh is None:
            raise ValueError(f"muon mode {self.mode!r} needs a mesh")

    @property
    def n(self) -> int:
        return 1 if self.mesh is None else self.mesh.shape[self.axis]

    @property
    def dtype(self):
        return NS_DTYPES[self.ns_dtype]

    def pools(self) -> tuple[list[TilePool], list[str]]:
        sharded = {p: s for p, s in self.shapes.items() if p in self.sharded}
        return plan_tiles(sharded, self.n)

    def bytes_per_device(self) -> int:
        """Analytic collective bytes (sent + received) per device per step in this mode."""
        item = jnp.dtype(self.dtype).itemsize
        sharded = {p: s for p, s in self.shapes.items() if p in self.sharded}
        if self.mode == "single" or self.n == 1:
            return 0
        if self.mode == "gather":
            return gather_bytes_per_device(sharded, self.n, item)
        pools, rest = self.pools()
        rest_shapes = {p: sharded[p] for p in rest}
        return a2a_bytes_per_device(pools, item) + gather_bytes_per_device(
            rest_shapes, self.n, item
        )

    def ns_flops_per_device(self) -> int:
        """Newton-Schulz FLOPs one device executes (the SPMD program, empty slots included)."""
        steps = self.ns_steps
        if self.mode == "single" or self.mode == "gather":
            return sum(ns_flops(s, steps) for s in self.shapes.values())
        pools, rest = self.pools()
        flops = sum(ns_flops(self.shapes[p], steps) for p in self.shapes if p not in self.sharded)
        flops += sum(ns_flops(self.shapes[p], steps) for p in rest)
        for p in pools:
            flops += steps * (4 * p.T * p.s * p.s * p.w + 2 * p.M * p.s**3)
        return flops

    # ---- the update ----
    def orthogonalize(self, grads: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """path -> f32 gradient (Nesterov direction) -> path -> f32 scaled orthogonal update."""
        if self.mode == "single" or self.n == 1:
            out = _ns_grouped(grads, self.ns_steps, self.dtype)
        else:
            out = self._distributed(grads)
        return {
            p: out[p].astype(f32) * shape_factor(self.shapes[p], self.shape_factor) for p in grads
        }

    def _distributed(self, grads):
        paths = sorted(grads)
        spec = {
            p: PartitionSpec(self.axis) if p in self.sharded else PartitionSpec() for p in paths
        }
        axis, steps, dtype = self.axis, self.ns_steps, self.dtype
        # replicated matrices: orthogonalised locally; `rest`: all-gathered (gather mode, and
        # sharded matrices the a2a tile layout cannot take)
        pools, rest = (
            self.pools() if self.mode == "a2a" else ([], [p for p in paths if p in self.sharded])
        )

        def body(*local):
            local = dict(zip(paths, local, strict=True))
            out = _ns_grouped({p: local[p] for p in paths if p not in self.sharded}, steps, dtype)
            # gather (and the a2a fallback): all-gather per shape group, keep own rows
            me = jax.lax.axis_index(axis)
            for shape, group in _groups({p: local[p].shape for p in rest}).items():
                stack = jnp.stack([local[p].astype(dtype) for p in group])
                full = jax.lax.all_gather(stack, axis, axis=1, tiled=True)
                y = newton_schulz(full, steps, dtype)
                y = jax.lax.dynamic_slice_in_dim(y, me * shape[0], shape[0], axis=1)
                out.update({p: y[i] for i, p in enumerate(group)})
            for pool in pools:
                out.update(_a2a_pool(pool, local, axis, steps, dtype))
            return tuple(out[p] for p in paths)

        fn = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=tuple(spec[p] for p in paths),
            out_specs=tuple(spec[p] for p in paths),
        )
        res = fn(*(grads[p].astype(dtype) for p in paths))
        return dict(zip(paths, res, strict=True))


# ---- the optax transformation ------------------------------------------------------------------


class ScaleByMuonState(NamedTuple):
    momentum: Any  # fp32, shaped (and sharded) like the Muon parameters


def path_str(key_path) -> str:
    """A pytree key path as the `/`-joined parameter path (`layer_0/qkvg/kernel`)."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in key_path)


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
        paths = [path_str(kp) for kp, _ in leaves]
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
