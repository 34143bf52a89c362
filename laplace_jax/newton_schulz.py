"""Newton-Schulz orthogonalisation (docs/design.md s4): one arithmetic for every layout.

Five quintic iterations on X = G / (||G||_F + eps), turned wide (rows <= cols):
A = X X^T; B = b A + c A A; X = a X + B X. Operands are in `dtype` (bf16 by default, what the
distributed form's collectives carry); every matmul accumulates in fp32.

Muon runs this iteration on one device, on every device after an all-gather, or on whole matrices
that an all_to_all hands out as column tiles (laplace_jax/muon_tiles.py). So that all three do
the same operations in the same order, the iteration is always computed on the same column
tiles, G = [G_1 .. G_k] of width w (`tile_widths`: one width per short side, fixed by the
model's shapes alone), and every sum that spans tiles is added left to right in column order:

    P       = (G_1 G_1^T + G_2 G_2^T) + ... + G_k G_k^T       the first Gram, in fp32
    r       = 1 / (sqrt(trace P) + eps)                        trace P = ||G||_F^2
    X_t     = r G_t;   A = r^2 P                               the first step's X and A
    then per step: B = b A + c A A per matrix; X_t <- a X_t + B X_t per tile;
    A = (X_1 X_1^T + X_2 X_2^T) + ... + X_k X_k^T

Every matmul then has one shape, (s x w) tiles and (s x s) Grams, whatever the layout, and the
sums over tiles have one order. The norm comes from the first Gram's trace: a reduction such as
sum(G^2) is added in an order that follows how XLA lays out and fuses its operand, which differs
between layouts, while a matmul's is fixed by its shapes. `newton_schulz` is the whole-matrix
definition, the reference the tiled form is held to (up to fp32 rounding) in tests/test_muon.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax.numpy as jnp

f32 = jnp.float32

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic (a, b, c) of Keller Jordan's Muon
NS_EPS = 1e-7
NS_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def _mm(x, y):
    """Matmul of `ns_dtype` operands with fp32 accumulation and an fp32 result."""
    return jnp.matmul(x, y, preferred_element_type=f32)


def _trace(m):
    """Trace of m [M, s, s], its diagonal added pairwise in a fixed order (adds of slices, not a
    reduction: XLA orders a reduction's terms by how it lays out and fuses the operand)."""
    d = m.reshape(m.shape[0], -1)[:, :: m.shape[1] + 1]  # [M, s]: the diagonal
    while d.shape[1] > 1:
        half = d.shape[1] // 2
        rest = d[:, 2 * half :]
        d = d[:, :half] + d[:, half : 2 * half]
        if rest.shape[1]:
            d = jnp.concatenate([d, rest], axis=1)
    return d[:, 0]


def _gram(x):
    """x x^T of [..., r, c] in fp32 accumulation, rounded to x's dtype."""
    return _mm(x, jnp.swapaxes(x, -1, -2)).astype(x.dtype)


def newton_schulz(g, steps: int = 5, dtype=jnp.bfloat16, eps: float = NS_EPS):
    """Orthogonalise g [..., r, c] (batched over leading axes) on whole matrices: the definition.

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


def tile_widths(shapes) -> dict[int, int]:
    """Short side s -> tile width w: the gcd of the long sides of every matrix with short side s
    (1,024 for every Laplace 3B matrix). It depends on the model's shapes alone, never on the
    device count or on which matrices are sharded."""
    long_sides: dict[int, list[int]] = {}
    for shape in shapes:
        long_sides.setdefault(min(shape), []).append(max(shape))
    return {s: math.gcd(*longs) for s, longs in long_sides.items()}


def _iterate(g, matrix_sum: Callable, tile_copy: Callable, steps: int, dtype, eps: float):
    """The quintic on tiles g [T, s, w] (in `dtype`). `matrix_sum` maps [T, ...] -> [M, ...] (each
    matrix's tiles added left to right in column order), `tile_copy` [M, ...] -> [T, ...] (each
    tile gets its matrix's value, exactly). The norm is the first Gram's trace (module doc)."""
    a, b, c = NS_COEFFS
    gram = matrix_sum(_mm(g, jnp.swapaxes(g, -1, -2)))  # [M, s, s]: G G^T in fp32
    scale = 1.0 / (jnp.sqrt(_trace(gram)) + eps)  # [M]
    x = (g.astype(f32) * tile_copy(scale)[:, None, None]).astype(dtype)  # X = G / ||G||
    A = (gram * jnp.square(scale)[:, None, None]).astype(dtype)  # X X^T
    for step in range(steps):  # static unroll: no data-dependent loop
        if step:
            A = matrix_sum(_mm(x, jnp.swapaxes(x, -1, -2))).astype(dtype)  # [M, s, s]
        B = (b * A.astype(f32) + c * _mm(A, A)).astype(dtype)  # [M, s, s]
        x = (a * x.astype(f32) + _mm(tile_copy(B), x)).astype(dtype)  # [T, s, w]
    return x


def newton_schulz_tiled(g, tile_width: int, steps: int = 5, dtype=jnp.bfloat16, eps=NS_EPS):
    """`newton_schulz` of g [B, r, c] (B matrices of one shape) in the tiled arithmetic."""
    x = jnp.asarray(g).astype(dtype)
    n_mats, r, c = x.shape
    tall = r > c
    if tall:
        x = jnp.swapaxes(x, -1, -2)
    s, length = x.shape[1:]
    k = length // tile_width  # tiles per matrix, in column order
    tiles = x.reshape(n_mats, s, k, tile_width).transpose(0, 2, 1, 3)
    tiles = tiles.reshape(n_mats * k, s, tile_width)  # [B k, s, w], matrix-major

    def matrix_sum(v):  # [B k, ...] -> [B, ...]: tile 1 + tile 2 + ... + tile k
        v = v.reshape((n_mats, k) + v.shape[1:])
        total = v[:, 0]
        for t in range(1, k):
            total = total + v[:, t]
        return total

    def tile_copy(u):  # [B, ...] -> [B k, ...]
        return jnp.repeat(u, k, axis=0)

    y = _iterate(tiles, matrix_sum, tile_copy, steps, dtype, eps)
    y = y.reshape(n_mats, k, s, tile_width).transpose(0, 2, 1, 3).reshape(n_mats, s, length)
    return jnp.swapaxes(y, -1, -2) if tall else y


def newton_schulz_tiles(x, seg, steps: int, dtype, eps: float = NS_EPS):
    """Newton-Schulz on tile slots x [T, s, w] holding M matrices; seg [M, T] one-hot (fp32)
    says which matrix each tile belongs to (an empty slot belongs to none and stays zero).

    A matrix's tiles sit in consecutive slots in column order, so the left-to-right sum over all
    T slots, each masked to one matrix, adds that matrix's tiles in `newton_schulz_tiled`'s order
    (the other slots add exact zeros): the same bits as on one device.
    """
    n_slots = x.shape[0]

    def matrix_sum(v):  # [T, ...] -> [M, ...]
        mask = seg.reshape(seg.shape + (1,) * (v.ndim - 1))
        total = mask[:, 0] * v[0]
        for t in range(1, n_slots):
            total = total + mask[:, t] * v[t]
        return total

    def tile_copy(u):  # [M, ...] -> [T, ...]; one-hot: exact
        return jnp.einsum("mt,m...->t...", seg, u.astype(f32)).astype(u.dtype)

    return _iterate(x, matrix_sum, tile_copy, steps, dtype, eps)
