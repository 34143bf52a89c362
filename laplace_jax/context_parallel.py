"""Context parallelism: one sequence split over the devices of a mesh axis (docs/design.md s11).

The two token mixers of a layer that reach across tokens, the GLA and the causal conv, each
exchange one small thing per layer between the slices; everything else in a layer is per token.

GLA.

Called inside `jax.shard_map`, where mesh axis `axis` (size S) splits every sequence of T tokens
into S contiguous slices of L = T / S tokens, device i holding slice i. For each head (decay
lambda, gamma = ln lambda) and each sequence:

    1. local scan   o_loc, S_loc_i = gla_chunked(slice i, zero state)        (laplace_jax/gla.py)
    2. exchange     all_gather over `axis` of S_loc_j, j = 0 .. S - 1
                    S_in_i = sum_{j < i} c_ij S_loc_j,  c_ij = prod_{j < m < i} a_m
                    a_m = lambda^(valid tokens of slice m), 0 if a document starts in it
    3. correction   o_t = o_loc_t + scale q_t^T (d_t S_in_i)
                    d_t = lambda^(valid tokens in [0, t]), 0 from the slice's first reset on

which is exactly the chunked form run over the whole sequence (S_in_i unrolls the recurrence
S_in_i = a_{i-1} S_in_{i-1} + S_loc_{i-1} from S_in_0 = 0: the state entering slice i is the
recurrence's S at the end of slice i - 1, and d_t is how much of it survives to token t, the
inter-chunk factor of the single-device kernel). Resets and padding follow laplace_jax/gla.py: a
document may start anywhere, at a slice's first token included, and a padded token neither adds
nor decays.

The decay schedule is the same in every layer, so everything that depends on positions, resets
and padding only (d_t, the slices' a_m, gathered over `axis`, and the weights c_ij) is
`slice_decays`, computed once per step outside the layer scan and handed to every layer; a layer
exchanges its S_loc only. The weights make the fold one contraction over the S slices (no loop,
no conditional: Neuron-clean), and the backward is autodiff's (the all_gather of S_loc
transposes to a reduce-scatter; the decays hold no parameter and have no backward). The
incoming state is named (`CONTEXT_STATE`) so a rematerialised layer keeps it and exchanges once
each way per layer.

Per layer and sequence each device receives the S - 1 states of the other slices,
(S - 1) x H x d_k x d_v x 4 bytes, however long the slice; per step it also receives the other
slices' a_m once (S - 1 x H x 4 bytes per sequence).

Conv. Output t of the depth-wise conv reads inputs t - W + 1 .. t, so a slice's first W - 1
outputs need the last inputs of the slice before: each device sends its last W inputs (those
before the last document start of its slice zeroed, as `laplace_jax.model.trailing_window`
keeps them for a prefill) one step along the axis with a `ppermute`; the first slice receives
zeros, the empty window of a sequence's start. A document starting at a slice's first token is a
reset there (read from the last input of the slice before), which discards that window. The
window received is named (`CONTEXT_WINDOW`) so a rematerialised layer keeps it too.

Targets: laplace_jax/loss.py's `next_token_slice` cuts each device's slice of inputs, targets
and document starts from the whole token windows, with no collective.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from laplace_jax.gla import _scale, gla_chunked

f32 = jnp.float32

# The name scopes of the collectives between slices, each holding EXCHANGE (train.plan counts them
# as one collective kind, and each by name), and the names of what a rematerialised layer keeps.
EXCHANGE = "context_exchange"
EXCHANGE_STATE = "context_exchange_state"  # each layer's S_loc
EXCHANGE_DECAY = "context_exchange_decay"  # the slices' a_m, once per step
EXCHANGE_CONV = "context_exchange_conv"  # each layer's conv window
CONTEXT_STATE = "context_state"
CONTEXT_WINDOW = "context_window"


def window_from_previous_slice(window, axis: str):
    """[B, W, D]: the previous slice's trailing conv window (`window`, this slice's own, is
    what the next device receives); zeros on the first device of `axis`. Named CONTEXT_WINDOW
    for the remat policies (a recomputed layer does not exchange again)."""
    n = jax.lax.axis_size(axis)
    with jax.named_scope(EXCHANGE_CONV):
        received = jax.lax.ppermute(window, axis, [(i, i + 1) for i in range(n - 1)])
    return checkpoint_name(received, CONTEXT_WINDOW)


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


class SliceDecays(NamedTuple):
    """What the slices' exchange needs that depends on positions, resets and padding only."""

    d: jax.Array  # [B, L, H]: d_t of this device's slice
    carry: jax.Array  # [S, B, H]: c_ij, the share of slice j's final state reaching slice i = me


def slice_decays(log_decay, axis: str, batch: int, length: int, reset=None, valid=None):
    """`SliceDecays` of this device's slice (once per step: the decay schedule is every layer's).
    log_decay [H]; reset, valid [B, L] or None."""
    d = slice_decay(log_decay, batch, length, reset, valid)  # [B, L, H]
    with jax.named_scope(EXCHANGE_DECAY):
        a = jax.lax.all_gather(d[:, -1], axis)  # [S, B, H]: a_m, each slice's whole decay
    S, me = a.shape[0], jax.lax.axis_index(axis)
    j = jnp.arange(S)
    between = (j[:, None] < j[None, :]) & (j[None, :] < me)  # [S (j), S (m)]: j < m < me
    factors = jnp.where(between[:, :, None, None], a[None], 1.0)  # [S, S, B, H]
    carry = jnp.where((j < me)[:, None, None], jnp.prod(factors, axis=1), 0.0)  # [S, B, H]
    return SliceDecays(d, carry)


def incoming_state(s_loc, carry, axis: str):
    """S_in [B, H, K, V] of this device's slice from every slice's S_loc [B, H, K, V] and the
    weights c_ij (`SliceDecays.carry`), named `CONTEXT_STATE` for the remat policies
    (laplace_jax/fsdp.py keeps it, so a recomputed layer does not exchange again)."""
    with jax.named_scope(EXCHANGE_STATE):
        s_all = jax.lax.all_gather(s_loc, axis)  # [S, B, H, K, V]
    s_in = jnp.einsum("sbh,sbhkv->bhkv", carry, s_all)
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
    decays: SliceDecays | None = None,
):
    """This device's slice of GLA over sequences split along `axis` (inside `shard_map`).

    q, k: [B, L, H, K]; v: [B, L, H, V]; reset, valid: [B, L] bool or None (laplace_jax/gla.py),
    all this device's slice; `decays`: `slice_decays` of the same slice, reset and valid (made
    here when None). Returns (o [B, L, H, V] in v's dtype, the state [B, H, K, V] fp32 at the
    end of this slice: the whole sequence's final state on the last device).
    """
    B, L = q.shape[:2]
    scale = _scale(q, scale)
    kw = {"chunk_size": chunk_size, "scale": scale, "unroll": unroll}
    o_loc, s_loc = gla_chunked(q, k, v, log_decay, reset=reset, valid=valid, **kw)  # zero state
    if decays is None:
        decays = slice_decays(log_decay, axis, B, L, reset, valid)
    s_in = incoming_state(s_loc, decays.carry, axis)  # [B, H, K, V]
    q_in = scale * q.astype(f32) * decays.d[..., None]  # [B, L, H, K]
    o = o_loc.astype(f32) + jnp.einsum("blhk,bhkv->blhv", q_in, s_in)
    return o.astype(v.dtype), decays.d[:, -1][..., None, None] * s_in + s_loc
