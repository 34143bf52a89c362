"""Causal softmax attention across context slices as a ring (docs/design.md s13.3).

The ring form of laplace_jax/attention_context.py's gather form: the same attention (global
positions, documents that start anywhere), but no device ever holds more than its own and one
other slice's keys. Inside `shard_map` over `axis` (S devices), with L = T / S tokens a slice and
h = L / 2:

Zig-zag. The GLA layers keep device i on the contiguous slice i, the halves (2i, 2i + 1) of h
tokens. For an attention layer, q, k, v and the document ids are permuted so that device i
holds the halves (i, 2S - 1 - i), one early and one late (Llama 3's and Megatron's load
balancing), and the output is permuted back: two `ppermute`s each way, of half a slice each.

Ring. Queries stay on their device and the keys and values travel: at ring step r = 0 .. S - 1
device i holds device j = (i - r) mod S's halves (a `ppermute` i -> i + 1 between steps, S - 1 of
them). Of the four pairs (query half, key half), "lo" the early half and "hi" the late one:

    j = i:  (lo, lo) causal   (hi, lo) whole   (hi, hi) causal   (lo, hi) wholly future
    j < i:  (lo, lo) whole    (hi, lo) whole   the key's hi half is after both query halves
    j > i:  (hi, lo) whole    (hi, hi) whole   the key's halves are both after the query's lo

so every step after the first scores (hi, lo) and (x, x) with x = [j > i]: two pairs of h x h,
the same work on every device and at every step. The pair is picked by an index (the offset
x h of a `dynamic_slice`), not by a branch: the program has no `lax.cond` and no loop whose trip
count depends on data (Neuron-clean), and no device computes a block of wholly future keys. A
device scores (2 S + 1) h^2 pairs a layer against the gather form's S L^2 = 4 S h^2, the
causal half and one diagonal's worth more.

Each pair is laplace_jax/attention_context.py's blockwise online softmax over KEY_BLOCK keys at a
time, carrying (m, denominator, output) across pairs and ring steps. The backward (a custom VJP)
recomputes the probabilities from the saved log-sum-exp and sends the keys and values round
the ring again, each with its dK, dV travelling beside it in fp32 (S - 1 additions of partial
sums: the keys' bf16 would round each of them); one more `ppermute` after the last step brings
each slice's dK, dV home. `attention_context_parallel` (the gather form) is its reference.

The pairs do the same work when the key block divides h (KEY_BLOCK = 512 and h = 4,096 or more at
3B's long rows); otherwise each pair's last block is padded and masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from laplace_jax.attention_context import (
    KEY_BLOCK,
    empty_stats,
    gradient_blocks,
    padded_keys,
    softmax_blocks,
)

f32 = jnp.float32
OWN_PAIRS = ((0, 0), (1, 0), (1, 1))  # ring step 0: (query half, key half) of its own keys


def odd_slice(seq_len: int, context: int) -> str | None:
    """What is wrong with slices of seq_len / context tokens for the ring, or None: it cuts each
    slice into two halves."""
    L = seq_len // context
    if L % 2 == 0:
        return None
    return (
        f"ring attention cuts each slice into two halves: slices of {L} tokens (seq_len "
        f"{seq_len} over context={context}) must be even; make seq_len a multiple of 2 x "
        "context, or set attention_context=gather"
    )


def _half_destination(half: int, n: int) -> int:
    """The device of half `half` (of 2n) in the zig-zag: device i holds halves i and 2n - 1 - i."""
    return half if half < n else 2 * n - 1 - half


def _zigzag_pairs(n: int):
    """The ppermute pairs taking each device's first half (2j) and second half (2j + 1) to their
    zig-zag devices; each is a permutation of the n devices."""
    first = [(j, _half_destination(2 * j, n)) for j in range(n)]
    second = [(j, _half_destination(2 * j + 1, n)) for j in range(n)]
    return first, second


def to_zigzag(x, axis: str):
    """x [b, L, ...], this device's contiguous slice (halves 2i, 2i + 1) -> [b, L, ...], its
    zig-zag halves (i, 2S - 1 - i). A device of even index receives its early half from a first
    half and its late half from a second half; one of odd index the other way round."""
    n, h = jax.lax.axis_size(axis), x.shape[1] // 2
    first, second = _zigzag_pairs(n)
    a = jax.lax.ppermute(x[:, :h], axis, first)
    b = jax.lax.ppermute(x[:, h:], axis, second)
    even = jax.lax.axis_index(axis) % 2 == 0
    return jnp.where(even, jnp.concatenate([a, b], 1), jnp.concatenate([b, a], 1))


def from_zigzag(x, axis: str):
    """The inverse of `to_zigzag`: [b, L, ...] zig-zag halves -> this device's contiguous slice."""
    n, h = jax.lax.axis_size(axis), x.shape[1] // 2
    first, second = _zigzag_pairs(n)
    even = jax.lax.axis_index(axis) % 2 == 0
    a = jnp.where(even, x[:, :h], x[:, h:])  # what came as a first half goes back as one
    b = jnp.where(even, x[:, h:], x[:, :h])
    a = jax.lax.ppermute(a, axis, [(dst, src) for src, dst in first])
    b = jax.lax.ppermute(b, axis, [(dst, src) for src, dst in second])
    return jnp.concatenate([a, b], 1)


def document_ids(reset, axis: str, b: int, L: int):
    """[b, L] int32: the document id of each position of this slice, the running count of
    document starts over the whole sequence (the gather form's ids), from each slice's count
    of starts. reset [b, L] bool or None."""
    if reset is None:
        return jnp.zeros((b, L), jnp.int32)
    starts = reset.astype(jnp.int32)
    counts = jax.lax.all_gather(starts.sum(1), axis)  # [S, b]
    before = jnp.arange(counts.shape[0]) < jax.lax.axis_index(axis)  # [S]: the slices before
    offset = jnp.sum(jnp.where(before[:, None], counts, 0), 0)  # [b]
    return offset[:, None] + jnp.cumsum(starts, 1, dtype=jnp.int32)


def _half_start(device, half, n: int, h: int):
    """The global position of the first token of zig-zag half `half` (0: lo, 1: hi) of `device`."""
    return jnp.where(half == 0, device, 2 * n - 1 - device) * h


def _key_half(k, v, doc, device, half, n: int, h: int, block: int):
    """Half `half` of a device's zig-zag keys, padded to whole blocks (`padded_keys`)."""
    k_y = jax.lax.dynamic_slice_in_dim(k, half * h, h, axis=1)  # [b, h, H, K]
    v_y = jax.lax.dynamic_slice_in_dim(v, half * h, h, axis=1)
    doc_y = jax.lax.dynamic_slice_in_dim(doc, half * h, h, axis=1)  # [b, h]
    pos_y = _half_start(device, half, n, h) + jnp.arange(h, dtype=jnp.int32)
    return padded_keys(k_y, v_y, pos_y, doc_y, block)


def _query_positions(i, n: int, h: int):
    """[L] global positions of device i's zig-zag queries: its lo half, then its hi half."""
    return jnp.concatenate([_half_start(i, x, n, h) + jnp.arange(h) for x in (0, 1)])


def _rows(x, half, h: int, axis: int = 2):
    return jax.lax.dynamic_slice_in_dim(x, half * h, h, axis=axis)


def _ring_pairs(n: int):
    return [(j, (j + 1) % n) for j in range(n)]  # device j -> j + 1: the ring


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def ring_attention(q, k, v, doc, axis: str, scale: float, block: int):
    """Causal softmax attention of this device's zig-zag queries over every device's zig-zag
    keys, passed round the ring. q, k: [b, L, H, K]; v: [b, L, H, V]; doc [b, L] int32 document
    ids (`document_ids`, then `to_zigzag`). Returns o [b, L, H, V] fp32, zig-zag order."""
    return _forward(q, k, v, doc, axis, scale, block)[0]


def _forward(q, k, v, doc, axis, scale, block):
    n, i = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    b, L, H, _ = q.shape
    h = L // 2
    blk = min(block, h)
    qh = q.transpose(0, 2, 1, 3).astype(f32) * scale  # [b, H, L, K]
    q_pos = _query_positions(i, n, h)  # [L]

    def attend(stats, x, y, k_j, v_j, doc_j, j):  # query half x, key half y of device j's keys
        *keys, nb = _key_half(k_j, v_j, doc_j, j, y, n, h, blk)
        rows = tuple(_rows(s, x, h) for s in stats)  # [b, H, h] ([b, H, h, V])
        rows = softmax_blocks(
            rows, _rows(qh, x, h), _rows(q_pos, x, h, 0), _rows(doc, x, h, 1), keys, nb, blk
        )
        return tuple(
            jax.lax.dynamic_update_slice_in_dim(s, r, x * h, axis=2)
            for s, r in zip(stats, rows, strict=True)
        )

    stats = empty_stats(b, H, L, v.shape[-1])
    for x, y in OWN_PAIRS:  # ring step 0, this device's own keys
        stats = attend(stats, x, y, k, v, doc, i)

    def ring_step(carry, r):  # device j = i - r's keys arrive; two pairs of halves
        stats, *visiting = carry  # visiting: device j's k, v and document ids
        visiting = jax.lax.ppermute(visiting, axis, _ring_pairs(n))
        j = (i - r) % n
        x = (j > i).astype(jnp.int32)  # 0: the keys' lo half is before both query halves
        stats = attend(stats, 1, 0, *visiting, j)
        stats = attend(stats, x, x, *visiting, j)
        return (stats, *visiting), None

    (stats, *_), _ = jax.lax.scan(ring_step, (stats, k, v, doc), jnp.arange(1, n))
    m, denom, acc = stats
    o = (acc / denom[..., None]).transpose(0, 2, 1, 3)  # [b, L, H, V]
    lse = m + jnp.log(denom)  # [b, H, L]
    return o, (q, k, v, doc, o, lse)


def _backward(axis, scale, block, res, do):  # do: [b, L, H, V] fp32, zig-zag order
    q, k, v, doc, o, lse = res
    n, i = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    L = q.shape[1]
    h = L // 2
    blk = min(block, h)
    qh = q.transpose(0, 2, 1, 3).astype(f32) * scale  # [b, H, L, K]
    doh = do.astype(f32).transpose(0, 2, 1, 3)  # [b, H, L, V]
    delta = jnp.sum(doh * o.transpose(0, 2, 1, 3), -1)  # [b, H, L]
    q_pos = _query_positions(i, n, h)  # [L]

    def grads(acc, x, y, k_j, v_j, doc_j, j):  # query half x, key half y of device j's keys
        dq, dk, dv = acc  # dQ [b, H, L, K] of this device; dK, dV [b, L, H, K|V] of j's keys
        *keys, nb = _key_half(k_j, v_j, doc_j, j, y, n, h, blk)
        dq_x, dk_y, dv_y = gradient_blocks(
            _rows(qh, x, h),
            _rows(doh, x, h),
            _rows(lse, x, h),
            _rows(delta, x, h),
            _rows(q_pos, x, h, 0),
            _rows(doc, x, h, 1),
            keys,
            nb,
            blk,
            f32,
        )
        dq = jax.lax.dynamic_update_slice_in_dim(dq, _rows(dq, x, h) + dq_x, x * h, axis=2)
        dk = jax.lax.dynamic_update_slice_in_dim(dk, _rows(dk, y, h, 1) + dk_y[:, :h], y * h, 1)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, _rows(dv, y, h, 1) + dv_y[:, :h], y * h, 1)
        return dq, dk, dv

    acc = (jnp.zeros(qh.shape, f32), jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32))
    for x, y in OWN_PAIRS:  # ring step 0, this device's own keys
        acc = grads(acc, x, y, k, v, doc, i)
    dq, dk, dv = acc

    def ring_step(carry, r):  # device j = i - r's keys arrive with their dK, dV so far
        dq, dk, dv, *visiting = carry  # visiting: device j's k, v and document ids
        dk, dv, *visiting = jax.lax.ppermute((dk, dv, *visiting), axis, _ring_pairs(n))
        j = (i - r) % n
        x = (j > i).astype(jnp.int32)
        dq, dk, dv = grads((dq, dk, dv), 1, 0, *visiting, j)
        dq, dk, dv = grads((dq, dk, dv), x, x, *visiting, j)
        return (dq, dk, dv, *visiting), None

    (dq, dk, dv, *_), _ = jax.lax.scan(ring_step, (dq, dk, dv, k, v, doc), jnp.arange(1, n))
    dk, dv = jax.lax.ppermute((dk, dv), axis, _ring_pairs(n))  # home: j + (S - 1) + 1 = j
    return (
        (dq * scale).transpose(0, 2, 1, 3).astype(q.dtype),
        dk.astype(k.dtype),
        dv.astype(v.dtype),
        None,  # document ids: integers, no cotangent
    )


ring_attention.defvjp(_forward, _backward)


def attention_ring_parallel(q, k, v, reset, axis: str, scale: float, block: int = KEY_BLOCK):
    """This slice's causal attention over its own and the earlier slices' keys, inside
    `shard_map` over `axis`, as a ring over zig-zag halves. q, k: [b, L, H, K]; v: [b, L, H, V];
    reset [b, L] bool or None (document starts); L even. Returns o [b, L, H, V] fp32, what
    `attention_context_parallel` (the gather form) returns."""
    b, L = q.shape[:2]
    n = jax.lax.axis_size(axis)
    problem = odd_slice(n * L, n)
    if problem:
        raise ValueError(problem)
    doc = document_ids(reset, axis, b, L)
    q, k, v, doc = (to_zigzag(t, axis) for t in (q, k, v, doc))
    return from_zigzag(ring_attention(q, k, v, doc, axis, scale, block), axis)
