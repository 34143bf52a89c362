"""Distributed Muon: the a2a tile layout and the `shard_map` executor (gather and a2a modes).

The a2a layout ("tiles"). Every Laplace Muon matrix, turned wide (rows <= cols), has the short
side D and a long side that is a multiple of w = gcd(long sides) (1,024 for 3B: `tile_widths`).
Newton-Schulz on X = [X_1 .. X_k] (column tiles of width w) only needs the Gram
A = X_1 X_1^T + ... + X_k X_k^T of each matrix; B = b A + c A A is per matrix and
X_t <- a X_t + B X_t is per tile. That is how every mode computes it
(laplace_jax/newton_schulz.py), so a device's work is a fixed number T of (D x w) tile slots
plus M matrix slots, the same on every device (SPMD: one program, no `lax.cond`), while which
matrix a tile belongs to is data (a one-hot [M, T] table row picked by `axis_index`). Matrices
are packed whole onto devices by first-fit-decreasing on their tile counts into n bins of
capacity T (T = the smallest capacity that fits; for 3B on 64 devices T = 16, set by W_12, the
largest matrix), all static; a matrix's tiles take consecutive slots in column order.

Each device's row shard of a matrix is cut into n equal pieces of D w / n elements per tile:
a wide kernel [D, c] sharded on rows gives (D/n x w) pieces, tile t's rows from every device;
a tall kernel [c, D] (W_3) sharded on its rows gives (w/n x D) blocks of its own c/n
consecutive rows. The send buffer is [n, T, D w / n]: piece (owner, slot) in a static layout,
empty slots zero. The owner stacks a wide tile's n pieces, and reorders a tall matrix's n k
blocks (a gather by a static per-device table) so that tile t is the kernel's rows
t w .. (t+1) w - 1: the same tiles, in the same column order, as on one device. Bytes per
device per all_to_all: (n-1)/n T D w sent and as many received, so in total
4 (n-1)/n T D w * itemsize. Padding is never computed on within a tile (tiles are exact); a
device whose bin is not full runs its empty tile slots on zeros, which costs no step time
because the fullest device sets the pace (the program is the same everywhere).

Why not 32x for 3B: the ideal 4 S / n (S = the whole gradient) needs every device to hold 1/n of
the elements, but one W_12 (50.3M elements) is larger than 1/64 of all Muon elements (42.5M), and
whole matrices are what Newton-Schulz needs. The bound with whole matrices is
gather / a2a = 2 S / (4 max_load) = 2,717,908,992 / (2 x 50,331,648) = 27.0x, which this layout
reaches.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from laplace_jax.newton_schulz import newton_schulz_tiled, newton_schulz_tiles
from laplace_jax.sharding import axis_size

# ---- the a2a layout: whole matrices packed onto devices as column tiles ---------------------


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
    """One a2a layout for matrices sharing their short side (all of Laplace's: D)."""

    n_devices: int  # n, the mesh axis size
    short_side: int  # s: rows of the wide form of every matrix in the pool
    tile_width: int  # w: columns of one tile (`tile_widths`)
    tile_slots: int  # T: tile slots per device (the bin capacity)
    matrix_slots: int  # M: matrix slots per device (most matrices one device holds)
    matrices: tuple[TileMatrix, ...]

    @property
    def piece(self) -> int:
        """Elements of one device's piece of one tile: s w / n."""
        return self.short_side * self.tile_width // self.n_devices

    def seg_table(self) -> np.ndarray:
        """[n, M, T] one-hot: tile slot -> matrix slot, per device."""
        seg = np.zeros((self.n_devices, self.matrix_slots, self.tile_slots), np.float32)
        for m in self.matrices:
            seg[m.owner, m.local, m.first_slot : m.first_slot + m.n_tiles] = 1.0
        return seg

    def tall_table(self) -> np.ndarray:
        tall = np.zeros((self.n_devices, self.tile_slots), bool)
        for m in self.matrices:
            tall[m.owner, m.first_slot : m.first_slot + m.n_tiles] = m.tall
        return tall

    def tall_sources(self) -> np.ndarray:
        """[n, T, n] per owner device: for each tile slot, the received blocks it is stacked
        from, as flat indices source * T + slot into the [n, T] received pieces. A wide slot
        takes its own slot from every source; a tall matrix's k tiles take its n k blocks (block
        b = source * k + t holds the kernel's rows b w/n .. (b+1) w/n) n at a time, in order."""
        n, T = self.n_devices, self.tile_slots
        src = np.tile(np.arange(n)[None, None, :] * T + np.arange(T)[None, :, None], (n, 1, 1))
        for m in self.matrices:
            if m.tall:
                b = np.arange(m.n_tiles * n)  # tile t' is blocks t' n .. t' n + n - 1
                flat = (b // m.n_tiles) * T + m.first_slot + b % m.n_tiles
                src[m.owner, m.first_slot : m.first_slot + m.n_tiles] = flat.reshape(-1, n)
        return src

    def tall_returns(self) -> np.ndarray:
        """[n, n, T] per owner device: the inverse of `tall_sources`, for the way back: for
        each (destination, slot) piece, the flat index slot * n + position of its block in the
        orthogonalised tiles."""
        n, T = self.n_devices, self.tile_slots
        ret = np.tile(np.arange(T)[None, None, :] * n + np.arange(n)[None, :, None], (n, 1, 1))
        for m in self.matrices:
            if m.tall:
                dest, t = np.divmod(np.arange(n * m.n_tiles), m.n_tiles)
                b = dest * m.n_tiles + t
                ret[m.owner, dest, m.first_slot + t] = (m.first_slot + b // n) * n + b % n
        return ret

    def loads(self) -> list[int]:
        """Tiles really used on each device."""
        out = [0] * self.n_devices
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


def plan_tiles(
    shapes: dict[str, tuple[int, int]], n: int, widths: dict[int, int]
) -> tuple[list[TilePool], list[str]]:
    """Pack row-sharded matrices into a2a tile pools of the tile widths `widths` (short side ->
    w, `tile_widths` of every Muon matrix); returns (pools, paths left for gather)."""
    by_s: dict[int, list[str]] = {}
    for path, shape in shapes.items():
        by_s.setdefault(min(shape), []).append(path)
    pools, rest = [], []
    for s, paths in sorted(by_s.items()):
        w = widths[s]
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
        pools.append(TilePool(n, s, w, cap, M, tuple(mats)))  # M: see TilePool
    return pools, rest


# ---- the executor ----------------------------------------------------------------------------


def _groups(shapes: dict[str, tuple[int, ...]]) -> dict[tuple[int, ...], list[str]]:
    out: dict[tuple[int, ...], list[str]] = {}
    for path in sorted(shapes):
        out.setdefault(tuple(shapes[path]), []).append(path)
    return out


def ns_grouped(
    mats: dict[str, jax.Array], widths: dict[int, int], steps, dtype
) -> dict[str, jax.Array]:
    """Newton-Schulz on whole matrices, batched over matrices of one shape."""
    out = {}
    for shape, paths in _groups({p: m.shape for p, m in mats.items()}).items():
        stack = jnp.stack([mats[p] for p in paths])
        y = newton_schulz_tiled(stack, widths[min(shape)], steps, dtype)
        out.update({p: y[i] for i, p in enumerate(paths)})
    return out


def _a2a_pool(pool: TilePool, local: dict[str, jax.Array], axis: str, steps, dtype):
    """Inside shard_map: row shards of the pool's matrices -> their orthogonalised row shards."""
    n, s, w, T = pool.n_devices, pool.short_side, pool.tile_width, pool.tile_slots
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
    if tall_tab.any():  # (w/n x s) row blocks of the kernel -> (s x w) columns of X, in order
        blocks = recv.reshape(n * T, w // n, s)
        src = jax.lax.dynamic_index_in_dim(jnp.asarray(pool.tall_sources()), me, keepdims=False)
        tall_x = jnp.take(blocks, src.reshape(-1), axis=0, mode="clip")
        tall_x = tall_x.reshape(T, w, s).transpose(0, 2, 1)
    if tall_x is None:
        x = wide_x
    elif tall_tab.all():
        x = tall_x
    else:
        mask = jax.lax.dynamic_index_in_dim(jnp.asarray(tall_tab), me, keepdims=False)
        x = jnp.where(mask[:, None, None], tall_x, wide_x)
    seg = jax.lax.dynamic_index_in_dim(jnp.asarray(pool.seg_table()), me, keepdims=False)
    y = newton_schulz_tiles(x, seg, steps, dtype)
    # 4. back to pieces in the same layout, second all_to_all, unpack the own rows
    wide_back = y.reshape(T, n, s // n, w).transpose(1, 0, 2, 3).reshape(n, T, pool.piece)
    if tall_x is None:
        out_send = wide_back
    else:
        blocks = y.transpose(0, 2, 1).reshape(T * n, w // n, s)
        ret = jax.lax.dynamic_index_in_dim(jnp.asarray(pool.tall_returns()), me, keepdims=False)
        tall_back = jnp.take(blocks, ret.reshape(-1), axis=0, mode="clip")
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


def rows_split(spec: PartitionSpec, axis) -> bool:
    """Whether a matrix placed as `spec` has its rows split over mesh axis `axis` (one axis, or
    a tuple of them)."""
    return bool(spec) and spec[0] == axis


def orthogonalize_sharded(
    grads: dict[str, jax.Array],
    *,
    mode: str,
    mesh: Mesh,
    axis: str,
    specs: dict[str, PartitionSpec],
    widths: dict[int, int],
    steps: int,
    dtype,
) -> dict[str, jax.Array]:
    """Muon's Newton-Schulz inside `jax.shard_map` over `axis`: path -> Nesterov direction
    (whole arrays placed as `specs` says, the parameters' PartitionSpecs from the rules table:
    rows over `axis`, or whole) -> path -> orthogonalised, in `dtype`.

    `single`: every matrix whole on every device (XLA all-gathers the row shards on the way in).
    `gather` and `a2a`: replicated matrices are orthogonalised on every device; `rest` (gather
    mode, and sharded matrices the tile layout cannot take) are all-gathered per shape group,
    each device keeping its own rows; the a2a pools go through `_a2a_pool`. All three run the
    tiled arithmetic of laplace_jax/newton_schulz.py on the tiles of `widths`.
    """
    paths = sorted(grads)
    if mode == "single":
        spec = {p: PartitionSpec() for p in paths}
    else:
        spec = {p: specs.get(p, PartitionSpec()) for p in paths}
    sharded = {p for p in paths if rows_split(spec[p], axis)}
    if mode == "a2a":
        pools, rest = plan_tiles(
            {p: tuple(grads[p].shape) for p in paths if p in sharded},
            axis_size(mesh, axis),
            widths,
        )
    else:
        pools, rest = [], [p for p in paths if p in sharded]

    def body(*local):
        local = dict(zip(paths, local, strict=True))
        out = ns_grouped({p: local[p] for p in paths if p not in sharded}, widths, steps, dtype)
        me = jax.lax.axis_index(axis)
        for shape, group in _groups({p: local[p].shape for p in rest}).items():
            stack = jnp.stack([local[p].astype(dtype) for p in group])
            full = jax.lax.all_gather(stack, axis, axis=1, tiled=True)
            y = newton_schulz_tiled(full, widths[min(full.shape[1:])], steps, dtype)
            y = jax.lax.dynamic_slice_in_dim(y, me * shape[0], shape[0], axis=1)
            out.update({p: y[i] for i, p in enumerate(group)})
        for pool in pools:
            out.update(_a2a_pool(pool, local, axis, steps, dtype))
        return tuple(out[p] for p in paths)

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(spec[p] for p in paths),
        out_specs=tuple(spec[p] for p in paths),
    )
    res = fn(*(grads[p].astype(dtype) for p in paths))
    return dict(zip(paths, res, strict=True))
