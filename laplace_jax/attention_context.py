"""Causal softmax attention across context slices, a block of keys at a time (docs/design.md s13).

A hybrid's attention layers (`attention_every`, laplace_spec/config.py) under context
parallelism: inside `shard_map`, the devices of the `context` axis hold consecutive slices of
each sequence (laplace_jax/context_parallel.py). Each device's queries need the keys and values
of its own and every earlier slice, so, one layer at a time, as Llama 3's context parallelism:

    K, V     = all_gather over the context axis of every slice's k, v   [b, S T_l, H, K|V]
               (the backward: its transpose, a reduce-scatter of dK, dV back to the slices)
    o_t      = sum_{s allowed} softmax_s(scale q_t . k_s) v_s
    allowed  = pos_s <= pos_t (global positions) and doc_s == doc_t (documents start anywhere,
               their ids the running count of document starts over the whole sequence)

The scores are taken KEY_BLOCK keys at a time with FlashAttention's online softmax (a running
maximum m, denominator and unnormalised output per query), so no [queries, keys] buffer larger
than [T_l, KEY_BLOCK] per head is live: at 128k tokens over 16 devices one head's whole scores
would be 8,192 x 131,072 x 4 B = 4.3 GB. The backward (`jax.custom_vjp`) recomputes each block's
probabilities from the saved log-sum-exp and takes dQ, dK, dV a block at a time too; autodiff of
the forward scan would store every block's probabilities, the whole square again.

Both loops are `lax.scan`s with a static trip count (Neuron-clean: no `lax.cond`, no
data-dependent loop); blocks wholly in a device's future are computed and masked, not skipped,
so every device runs the same program. `laplace_jax/attention.py`'s `causal_attention` on one
device is the truth this is tested against (tests/test_hybrid.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

f32 = jnp.float32
KEY_BLOCK = 512  # keys per block of scores: [T_l, 512] fp32 per head is live at a time
_NEG = -1e30  # a finite "minus infinity": exp(_NEG - m) is 0, and _NEG - _NEG is not NaN
_NO_POSITION = jnp.iinfo(jnp.int32).max  # padding keys: after every query, never attended


def padded_keys(k, v, k_pos, k_doc, block: int):
    """Keys padded to whole blocks of `block`: the padding keys have no position (after every
    query) and no document, so no query attends to them. Returns the four and the block count."""
    Tk = k.shape[1]
    nb = -(-Tk // block)
    pad = ((0, 0), (0, nb * block - Tk))
    k = jnp.pad(k, (*pad, (0, 0), (0, 0)))
    v = jnp.pad(v, (*pad, (0, 0), (0, 0)))
    k_pos = jnp.pad(k_pos, pad[1], constant_values=_NO_POSITION)
    return k, v, k_pos, jnp.pad(k_doc, pad, constant_values=-1), nb


def _key_block(k, v, k_pos, k_doc, j, block: int):
    """Block j of the (padded) keys, sliced where they lie (no block-major copy of the keys):
    k [b, blk, H, K], v [b, blk, H, V], positions [blk], document ids [b, blk].

    The optimization barrier ties the block's integer positions and ids to its keys. Without it,
    under `jax.checkpoint` (the trainer's per-layer remat), JAX finds the mask a function of
    integers alone, computes it for every block ahead of the loop and keeps all of them for the
    loop: [n_blocks, b, H, T_q, blk] booleans, at 128k tokens over 16 devices 16 GiB a layer."""
    start = j * block
    kj = jax.lax.dynamic_slice_in_dim(k, start, block, axis=1)
    vj = jax.lax.dynamic_slice_in_dim(v, start, block, axis=1)
    pj = jax.lax.dynamic_slice_in_dim(k_pos, start, block)
    dj = jax.lax.dynamic_slice_in_dim(k_doc, start, block, axis=1)
    return jax.lax.optimization_barrier((kj, vj, pj, dj))


def _scores(qh, kj, q_pos, q_doc, pj, dj):
    """One block's scores [b, H, T_q, blk] fp32 and where they are allowed [b, 1, T_q, blk]."""
    s = jnp.einsum("bhtk,bshk->bhts", qh, kj.astype(f32))
    causal = pj[None, :] <= q_pos[:, None]  # [T_q, blk]
    same_doc = dj[:, None, :] == q_doc[:, :, None]  # [b, T_q, blk]
    return s, (causal[None] & same_doc)[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def blockwise_attention(q, k, v, q_pos, k_pos, q_doc, k_doc, scale: float, block: int):
    """Softmax attention of queries over keys, a block of keys at a time, masked by position and
    document.

    q: [b, T_q, H, K]; k: [b, T_k, H, K]; v: [b, T_k, H, V]; q_pos [T_q], k_pos [T_k] int32
    global positions; q_doc [b, T_q], k_doc [b, T_k] int32 document ids. Key s is allowed for
    query t when k_pos[s] <= q_pos[t] and their documents are the same; every query must allow
    at least one key (its own). Returns o [b, T_q, H, V] fp32."""
    return _forward(q, k, v, q_pos, k_pos, q_doc, k_doc, scale, block)[0]


def empty_stats(b: int, H: int, Tq: int, V: int):
    """The online softmax's running (maximum m, denominator, unnormalised output) before any key:
    [b, H, T_q], [b, H, T_q], [b, H, T_q, V] fp32."""
    return (
        jnp.full((b, H, Tq), _NEG, f32),
        jnp.zeros((b, H, Tq), f32),
        jnp.zeros((b, H, Tq, V), f32),
    )


def softmax_blocks(stats, qh, q_pos, q_doc, keys, nb: int, block: int):
    """The online softmax of queries qh [b, H, T_q, K] (fp32, scale applied) over the padded
    keys (`padded_keys`'s k, v, k_pos, k_doc, nb blocks), from the running `stats` (`empty_stats`);
    returns them after the last block."""

    def one_block(carry, j):  # the online softmax over block j of the keys
        m, denom, acc = carry  # [b, H, T_q], [b, H, T_q], [b, H, T_q, V]
        kj, vj, pj, dj = _key_block(*keys, j, block)
        s, allowed = _scores(qh, kj, q_pos, q_doc, pj, dj)
        m_new = jnp.maximum(m, jnp.where(allowed, s, _NEG).max(-1))
        p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)  # [b, H, T_q, blk]
        alpha = jnp.exp(m - m_new)  # rescales what the earlier blocks summed
        denom = alpha * denom + p.sum(-1)
        acc = alpha[..., None] * acc + jnp.einsum("bhts,bshv->bhtv", p, vj.astype(f32))
        return (m_new, denom, acc), None

    stats, _ = jax.lax.scan(one_block, stats, jnp.arange(nb))
    return stats


def gradient_blocks(qh, doh, lse, delta, q_pos, q_doc, keys, nb: int, block: int, dtype):
    """The backward of `softmax_blocks` for queries qh [b, H, T_q, K] (fp32, scale applied) over
    the padded keys: dO [b, H, T_q, V], the forward's log-sum-exp and delta = sum_v dO o, both
    [b, H, T_q]. Returns dQ [b, H, T_q, K] fp32 without the scale (the caller applies it) and
    the padded keys' dK [b, nb blk, H, K], dV [b, nb blk, H, V] in `dtype`."""

    def one_block(carry, j):  # block j's dK, dV whole (every query at once), dQ summed
        dq, dk, dv = carry
        kj, vj, pj, dj = _key_block(*keys, j, block)
        s, allowed = _scores(qh, kj, q_pos, q_doc, pj, dj)
        p = jnp.where(allowed, jnp.exp(s - lse[..., None]), 0.0)  # the forward's softmax
        dvj = jnp.einsum("bhts,bhtv->bshv", p, doh)  # [b, blk, H, V]
        dp = jnp.einsum("bhtv,bshv->bhts", doh, vj.astype(f32))
        ds = p * (dp - delta[..., None])  # the softmax's backward, [b, H, T_q, blk]
        dq = dq + jnp.einsum("bhts,bshk->bhtk", ds, kj.astype(f32))
        dkj = jnp.einsum("bhts,bhtk->bshk", ds, qh)  # [b, blk, H, K] (qh carries the scale)
        dk = jax.lax.dynamic_update_slice_in_dim(dk, dkj.astype(dtype), j * block, axis=1)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, dvj.astype(dtype), j * block, axis=1)
        return (dq, dk, dv), None

    k, v = keys[0], keys[1]
    init = (
        jnp.zeros((*qh.shape[:3], k.shape[-1]), f32),
        jnp.zeros(k.shape, dtype),
        jnp.zeros(v.shape, dtype),
    )
    (dq, dk, dv), _ = jax.lax.scan(one_block, init, jnp.arange(nb))
    return dq, dk, dv


def _forward(q, k, v, q_pos, k_pos, q_doc, k_doc, scale, block):
    b, Tq, H, _ = q.shape
    qh = q.transpose(0, 2, 1, 3).astype(f32) * scale  # [b, H, T_q, K]
    *keys, nb = padded_keys(k, v, k_pos, k_doc, block)  # keys: the padded k, v, k_pos, k_doc
    stats = empty_stats(b, H, Tq, v.shape[-1])
    m, denom, acc = softmax_blocks(stats, qh, q_pos, q_doc, keys, nb, block)
    o = (acc / denom[..., None]).transpose(0, 2, 1, 3)  # [b, T_q, H, V]
    lse = m + jnp.log(denom)  # [b, H, T_q]: log sum_s exp(s_ts), what the backward recomputes with
    return o, (q, k, v, q_pos, k_pos, q_doc, k_doc, o, lse)


def _backward(scale, block, res, do):  # do: [b, T_q, H, V] fp32
    q, k, v, q_pos, k_pos, q_doc, k_doc, o, lse = res
    Tk = k.shape[1]
    qh = q.transpose(0, 2, 1, 3).astype(f32) * scale  # [b, H, T_q, K]
    doh = do.astype(f32).transpose(0, 2, 1, 3)  # [b, H, T_q, V]
    delta = jnp.sum(doh * o.transpose(0, 2, 1, 3), -1)  # [b, H, T_q]: sum_v dO o = sum_s P dP
    *keys, nb = padded_keys(k, v, k_pos, k_doc, block)  # keys: the padded k, v, k_pos, k_doc
    dq, dk, dv = gradient_blocks(qh, doh, lse, delta, q_pos, q_doc, keys, nb, block, k.dtype)
    return (
        (dq * scale).transpose(0, 2, 1, 3).astype(q.dtype),
        dk[:, :Tk],
        dv[:, :Tk],
        None,  # positions and document ids: integers, no cotangent
        None,
        None,
        None,
    )


blockwise_attention.defvjp(
    lambda q, k, v, qp, kp, qd, kd, scale, block: _forward(q, k, v, qp, kp, qd, kd, scale, block),
    _backward,
)


def attention_context_parallel(q, k, v, reset, axis: str, scale: float, block: int = KEY_BLOCK):
    """This slice's causal attention over its own and the earlier slices' keys, inside
    `shard_map` over `axis`. q, k: [b, T_l, H, K]; v: [b, T_l, H, V]; reset [b, T_l] bool or
    None (document starts). Returns o [b, T_l, H, V] fp32, as `causal_attention` of the whole
    sequence gives this slice."""
    b, Tl = q.shape[:2]
    n, i = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    k_all = jax.lax.all_gather(k, axis, axis=1, tiled=True)  # [b, n T_l, H, K]
    v_all = jax.lax.all_gather(v, axis, axis=1, tiled=True)  # [b, n T_l, H, V]
    k_pos = jnp.arange(n * Tl, dtype=jnp.int32)  # global positions
    q_pos = i * Tl + jnp.arange(Tl, dtype=jnp.int32)
    if reset is None:
        k_doc = jnp.zeros((b, n * Tl), jnp.int32)
    else:  # document ids over the whole sequence: the running count of its document starts
        starts = jax.lax.all_gather(reset.astype(jnp.int32), axis, axis=1, tiled=True)
        k_doc = jnp.cumsum(starts, 1, dtype=jnp.int32)  # [b, n T_l]
    q_doc = jax.lax.dynamic_slice_in_dim(k_doc, i * Tl, Tl, axis=1)  # [b, T_l]
    return blockwise_attention(q, k_all, v_all, q_pos, k_pos, q_doc, k_doc, scale, block)
