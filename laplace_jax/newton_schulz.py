"""Newton-Schulz orthogonalisation (docs/design.md s4): on whole matrices, and on column tiles.

Five quintic iterations on X = G / (||G||_F + eps), turned wide (rows <= cols):
A = X X^T; B = b A + c A A; X = a X + B X. Operands are in `dtype` (bf16 by default, what the
distributed form's collectives carry); every matmul accumulates in fp32.

`newton_schulz_tiles` is the same iteration on a matrix held as column tiles X = [X_1 .. X_k]:
the Gram A = sum_t X_t X_t^T is per matrix and X_t <- a X_t + B X_t per tile, so a device can
run several matrices of different widths in one fixed set of tile slots (laplace_jax/muon_tiles.py).
"""

from __future__ import annotations

import jax.numpy as jnp

f32 = jnp.float32

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic (a, b, c) of Keller Jordan's Muon
NS_EPS = 1e-7
NS_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


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


def newton_schulz_tiles(x, seg, steps: int, dtype, eps: float = NS_EPS):
    """Newton-Schulz on tile slots x [T, s, w] holding M matrices; seg [M, T] one-hot (fp32)
    says which matrix each tile belongs to (an empty slot belongs to none and stays zero)."""
    a, b, c = NS_COEFFS
    x32 = x.astype(f32)
    sq = jnp.sum(jnp.square(x32), axis=(1, 2))  # [T]
    norm = jnp.sqrt(seg @ sq)  # [M], each matrix's Frobenius norm
    x = (x32 / (seg.T @ norm + eps)[:, None, None]).astype(dtype)
    for _ in range(steps):
        g = jnp.einsum("tiw,tjw->tij", x, x, preferred_element_type=f32)  # per-tile Grams
        A = jnp.einsum("mt,tij->mij", seg, g).astype(dtype)  # [M, s, s], summed per matrix
        B = b * A.astype(f32) + c * _mm(A, A)
        Bt = jnp.einsum("mt,mij->tij", seg, B).astype(dtype)  # back to tiles; exact: one-hot
        x = (a * x.astype(f32) + _mm(Bt, x)).astype(dtype)
    return x
