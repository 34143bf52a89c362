"""Context parallelism: one sequence split over the devices of a mesh axis (docs/design.md s11).

The two token mixers of a layer that reach across tokens, the GLA and the causal conv, each
exchange one small thing per layer between the slices; everything else in a layer is per token.

GLA.

Called inside `jax.shard_map`, where mesh axis `axis` (size S) splits every sequence of T tokens
into S contiguous slices of L = T / S tokens, device i holding slice i. For each head (decay
lambda, gamma = ln lambda) and each sequence:

    1. local scan   o_loc, S_loc_i = gla_chunked(slice i, zero state)        (laplace_jax/gla.py)
                    a_i = lambda^(valid tokens of the slice), 0 if a document starts in it
    2. exchange     all_gather over `axis` of (S_loc_j, a_j), j = 0 .. S - 1
                    S_in_0 = 0,  S_in_i = a_{i-1} S_in_{i-1} + S_loc_{i-1}
    3. correction   o_t = o_loc_t + scale q_t^T (d_t S_in_i)
                    d_t = lambda^(valid tokens in [0, t]), 0 from the slice's first reset on

which is exactly the chunked form run over the whole sequence (the state entering slice i is the
recurrence's S at the end of slice i - 1, and d_t is how much of it survives to token t, the
inter-chunk factor of the single-device kernel). Resets and padding follow laplace_jax/gla.py: a
document may start anywhere, at a slice's first token included, and a padded token neither adds
nor decays. The fold of step 2 is a `lax.scan` of static length S whose steps past this device's
index are `jnp.where`-selected away (no conditionals, no data-dependent loops: Neuron-clean), and
the backward is autodiff's (the all_gather transposes to a reduce-scatter; the fold's own
backward needs only the decays, which hold no parameter). The incoming state is named
(`CONTEXT_STATE`) so a rematerialised layer keeps it and exchanges once each way per layer.

Per layer and sequence each device receives the S states, S x H x d_k x d_v x 4 bytes, however
long the slice.

Conv. Output t of the depth-wise conv reads inputs t - W + 1 .. t, so a slice's first W - 1
outputs need the last inputs of the slice before: each device sends its last W inputs (those
before the last document start of its slice zeroed, as `laplace_jax.model.trailing_window`
keeps them for a prefill) one step along the axis with a `ppermute`; the first slice receives
zeros, the empty window of a sequence's start. A document starting at a slice's first token is a
reset there (read from the last input of the slice before), which discards that window.

Targets: laplace_jax/loss.py's `next_token_slice` cuts each device's slice of inputs, targets
and document starts from the whole token windows, with no collective.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from laplace_jax.gla import _scale, gla_chunked

f32 = jnp.float32

# The name scope of the collectives between slices (train.plan counts them as their own kind)
# and the name of the state they deliver (what a rematerialised layer keeps).
EXCHANGE = "context_exchange"
CONTEXT_STATE = "context_state"


def window_from_previous_slice(window, axis: str):
    """[B, W, D]: the previous slice's trailing conv window (`window`, this slice's own, is
    what the next device receives); zeros on the first device of `axis`."""
    n = jax.lax.axis_size(axis)
    with jax.named_scope(EXCHANGE):
        return jax.lax.ppermute(window, axis, [(i, i + 1) for i in range(n - 1)])


def slice_decay(log_decay, batch: int, length: int, reset=None, valid=None):
    """d [B, L, H]: lambda^(valid tokens in [0, t]) while no document has started in [0, t],
    else 0; the share of the state entering the slice that reaches token t."""
    live = jnp.ones((batch, length), f32) if valid is None else valid.astype(f32)
    count = jnp.cumsum(live, axis=1)  # [B, L], valid tokens in [0, t]
    d = jnp.exp(log_decay.astype(f32)[None, None, :] * count[..., None])  # [B, L, H]
    if reset is None:
        return d
    open_ = jnp.cumsum(reset.astype(jnp.int32), axis=1) == 0  # [B, L], no reset in [0, t]
    return jnp.where(open_[..., None], d, 0.0)


def incoming_state(s_loc, a, axis: str):
    """S_in of this device's slice from every slice's (S_loc [B, H, K, V], a [B, H]), named
    `CONTEXT_STATE` for the remat policies (laplace_jax/fsdp.py keeps it, so a recomputed layer
    does not exchange again)."""
    with jax.named_scope(EXCHANGE):
        s_all = jax.lax.all_gather(s_loc, axis)  # [S, B, H, K, V]
        a_all = jax.lax.all_gather(a, axis)  # [S, B, H]
    me = jax.lax.axis_index(axis)

    def fold(s_in, xs):  # S_in_{j+1} = a_j S_in_j + S_loc_j, kept only for j < me
        s_j, a_j, j = xs
        nxt = a_j[..., None, None] * s_in + s_j
        return jnp.where(j < me, nxt, s_in), None

    steps = jnp.arange(s_all.shape[0])
    s_in, _ = jax.lax.scan(fold, jnp.zeros_like(s_loc), (s_all, a_all, steps))
    return checkpoint_name(s_in, CONTEXT_STATE)


def gla_context_parallel(
    q,
    k,
    v,
    log_decay,
    *,
    axis: str,
    chunk_size=128,
    scale=None,
    unroll=False,
    reset=None,
    valid=None,
):
    """This device's slice of GLA over sequences split along `axis` (inside `shard_map`).

    q, k: [B, L, H, K]; v: [B, L, H, V]; reset, valid: [B, L] bool or None (laplace_jax/gla.py),
    all this device's slice. Returns (o [B, L, H, V] in v's dtype, the state [B, H, K, V] fp32
    at the end of this slice: the whole sequence's final state on the last device).
    """
    B, L = q.shape[:2]
    scale = _scale(q, scale)
    kw = {"chunk_size": chunk_size, "scale": scale, "unroll": unroll}
    o_loc, s_loc = gla_chunked(q, k, v, log_decay, reset=reset, valid=valid, **kw)  # zero state
    d = slice_decay(log_decay, B, L, reset, valid)  # [B, L, H]
    s_in = incoming_state(s_loc, d[:, -1], axis)  # [B, H, K, V], a_i = d at the slice's end
    q_in = scale * q.astype(f32) * d[..., None]  # [B, L, H, K]
    o = o_loc.astype(f32) + jnp.einsum("blhk,bhkv->blhv", q_in, s_in)
    return o.astype(v.dtype), d[:, -1][..., None, None] * s_in + s_loc
