"""Simple Gated Linear Attention (fixed per-head decay): three forms of one function.

Layout and conventions follow flash-linear-attention's `simple_gla` ops, so the results can be
checked against its naive PyTorch references:

    q, k: [B, T, H, K]    v: [B, T, H, V]    log_decay: [H] (natural log of lambda_h, <= 0)
    state S: [B, H, K, V] in fp32

    S_t = exp(log_decay) * S_{t-1} + k_t v_t^T
    o_t = (scale * q_t)^T S_t            scale defaults to K ** -0.5

- `gla_recurrent`: the definition, one token at a time (the reference).
- `gla_chunked`: docs/design.md section 3, a `lax.scan` over chunks (training, prefill).
- `gla_step`: one token (decoding).

Document boundaries and padding (optional, all three forms; None: the plain recurrence above,
computed exactly as without these arguments):

    reset: [B, T] bool   True where a new document starts: the state before that token is zeroed
    valid: [B, T] bool   False at padding: the token neither adds k v^T nor decays the state

    S_t = a_t S_{t-1} + valid_t k_t v_t^T,   a_t = 0 if reset_t, else lambda if valid_t, else 1

so a packed sequence of documents gives each document exactly what a separate run from a zero
state gives it, and a padded step passes the state through unchanged, decay included (masking
only the values is flash-linear-attention issue 1272). Left padding before a document can
equally be a reset at the document's first token (when there is no initial state to keep).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

f32 = jnp.float32


def _scale(q: jax.Array, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def _zero_state(q: jax.Array, v: jax.Array) -> jax.Array:
    B, H, K, V = q.shape[0], q.shape[-2], q.shape[-1], v.shape[-1]
    return jnp.zeros((B, H, K, V), f32)


# ---- the definition -----------------------------------------------------------------------


def gla_step(q, k, v, log_decay, state, *, scale=None, reset=None, valid=None):
    """One token. q, k: [B, H, K]; v: [B, H, V]; state: [B, H, K, V] -> (o [B, H, V], state).

    reset, valid: [B] bool or None (module docstring): zero the state before this token / a
    padded token (no k v^T, no decay)."""
    lam = jnp.exp(log_decay.astype(f32))[None, :, None, None]  # [1, H, 1, 1]
    kv = jnp.einsum("bhk,bhv->bhkv", k.astype(f32), v.astype(f32))  # k_t v_t^T
    if reset is None and valid is None:
        state = lam * state.astype(f32) + kv  # S_t = lambda S_{t-1} + k_t v_t^T
    else:
        B = q.shape[0]
        r = jnp.zeros((B,), bool) if reset is None else reset
        m = jnp.ones((B,), bool) if valid is None else valid
        a = jnp.where(r[:, None, None, None], 0.0, jnp.where(m[:, None, None, None], lam, 1.0))
        state = a * state.astype(f32) + jnp.where(m[:, None, None, None], kv, 0.0)
    o = jnp.einsum("bhk,bhkv->bhv", _scale(q, scale) * q.astype(f32), state)  # (scale q_t)^T S_t
    return o.astype(v.dtype), state


def gla_recurrent(q, k, v, log_decay, *, scale=None, initial_state=None, reset=None, valid=None):
    """The reference: `gla_step` scanned over T. Returns (o [B, T, H, V], final state).

    reset, valid: [B, T] bool or None, document starts and padding (module docstring)."""
    state = _zero_state(q, v) if initial_state is None else initial_state.astype(f32)
    masked = reset is not None or valid is not None
    if masked:
        B, T = q.shape[:2]
        reset = jnp.zeros((B, T), bool) if reset is None else reset.astype(bool)
        valid = jnp.ones((B, T), bool) if valid is None else valid.astype(bool)

    def step(state, xs_t):
        q_t, k_t, v_t, *rm = xs_t
        r_t, m_t = rm if masked else (None, None)
        o_t, state = gla_step(q_t, k_t, v_t, log_decay, state, scale=scale, reset=r_t, valid=m_t)
        return state, o_t

    # scan over time: move T to the front, [T, B, H, *] (and [T, B] for reset, valid)
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v))
    xs += (reset.T, valid.T) if masked else ()
    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1), state


# ---- the chunked form (docs/design.md section 3) -----------------------------------------------


def gla_chunked(
    q,
    k,
    v,
    log_decay,
    *,
    chunk_size=128,
    scale=None,
    initial_state=None,
    unroll=False,
    reset=None,
    valid=None,
):
    """Chunked GLA: intra-chunk products batched over all chunks, a `lax.scan` carries the state.

    Any T: the input is zero-padded to a multiple of `chunk_size`, and the state carry of the last
    chunk only counts its valid tokens, so the final state is exactly S_T. `unroll=True` unrolls
    the scan statically (the Neuron compiler needs the whole backward graph at trace time).
    reset, valid: [B, T] bool or None, document starts and padding (module docstring; both None:
    the computation below, unchanged). Returns (o [B, T, H, V] in v's dtype, final state
    [B, H, K, V] fp32).
    """
    if reset is not None or valid is not None:
        return _gla_chunked_masked(
            q, k, v, log_decay, chunk_size, scale, initial_state, unroll, reset, valid
        )
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    N = -(-T // C)  # number of chunks
    pad = N * C - T
    scale = _scale(q, scale)
    state0 = _zero_state(q, v) if initial_state is None else initial_state.astype(f32)
    gamma = log_decay.astype(f32)[:, None, None]  # [H, 1, 1], gamma = ln(lambda) <= 0

    # Chunks first, [N, B, H, C, X]: every product below is batched over (n, b, h) in that order,
    # and the state scan runs over the leading axis, so no operand needs a transpose.
    def to_chunks(x):  # [B, T, H, X] -> [N, B, H, C, X]
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
        return x.reshape(B, N, C, H, x.shape[-1]).transpose(1, 0, 3, 2, 4)

    qc, kc, vc = to_chunks(q), to_chunks(k), to_chunks(v)
    i = jnp.arange(C, dtype=f32)[:, None]  # local query position
    j = jnp.arange(C, dtype=f32)[None, :]  # local key position

    # Intra-chunk: O_c = scale ((Q_c K_c^T) * M) V_c, M_ij = lambda^(i-j) for i >= j.
    # exp(gamma (i - j)) is evaluated on the lower triangle only: never lambda^(-j).
    causal = i >= j  # [C, C]
    M = jnp.where(causal, jnp.exp(gamma * jnp.where(causal, i - j, 0.0)), 0.0)  # [H, C, C]
    A = jnp.einsum("nbhik,nbhjk->nbhij", qc, kc, preferred_element_type=f32)  # [N,B,H,C,C]
    A = scale * A * M
    o_intra = jnp.einsum("nbhij,nbhjv->nbhiv", A.astype(v.dtype), vc, preferred_element_type=f32)

    # State carry: S_c = lambda^(L_c) S_{c-1} + (K_c * lambda^(L_c-1-j))^T V_c, where L_c = C
    # except for a padded last chunk (its padded keys are zero and get no decay weight).
    valid = jnp.full((N,), C, f32).at[-1].set(C - pad)  # L_c, valid tokens per chunk
    L = valid[:, None]  # [N, 1]
    key_live = j[0][None, :] < L  # [N, C]
    k_decay = jnp.where(
        key_live[:, None],
        jnp.exp(gamma[None, :, 0] * jnp.where(key_live, L - 1 - j, 0.0)[:, None]),
        0.0,
    )  # [N, H, C], lambda^(L_c - 1 - j)
    kv = jnp.einsum(
        "nbhjk,nbhjv->nbhkv",
        kc * k_decay[:, None, :, :, None].astype(kc.dtype),
        vc,
        preferred_element_type=f32,
    )  # [N, B, H, K, V], each chunk's contribution to the state
    chunk_decay = jnp.exp(gamma[None, :, 0, 0] * valid[:, None])  # [N, H], lambda^(L_c)

    def carry(state, xs):  # state: S_{c-1} [B, H, K, V]
        kv_c, decay_c = xs
        new_state = decay_c[None, :, None, None] * state + kv_c
        return new_state, state  # emit S_{c-1}, the state the chunk's queries read

    final_state, prev_states = jax.lax.scan(
        carry, state0, (kv, chunk_decay), unroll=N if unroll else 1
    )  # prev_states: [N, B, H, K, V]

    # Inter-chunk: O_c += scale (Q_c * lambda^(i+1)) S_{c-1}
    q_decay = jnp.exp(gamma[:, 0, 0][:, None] * (i[:, 0] + 1.0)[None, :])  # [H, C]
    o_inter = jnp.einsum(
        "nbhik,nbhkv->nbhiv", (scale * qc.astype(f32)) * q_decay[:, :, None], prev_states
    )
    o = (o_intra + o_inter).transpose(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T]
    return o.astype(v.dtype), final_state


def _gla_chunked_masked(q, k, v, log_decay, C, scale, initial_state, unroll, reset, valid):
    """`gla_chunked` with per-token resets and padding, exact (no decay crosses a reset).

    Per chunk and sequence, local positions i, j: p_i = number of valid tokens in [0, i] (the
    decays applied from the chunk start through token i; i + 1 without padding) and
    g_i = number of resets in [0, i] (the token's segment within the chunk). Then

    - intra: M_ij = lambda^(p_i - p_j) where i >= j and g_i == g_j (no reset in (j, i]), else 0
    - inter: O_c += scale (Q_c * lambda^(p_i) * [g_i == 0]) S_{c-1}
    - carry: S_c = lambda^(p_last) [g_last == 0] S_{c-1}
                   + (K_c * lambda^(p_last - p_j) [g_j == g_last])^T (V_c * valid)

    Exponents are differences of counts, never negative: exp() of the masked entries only.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = -(-T // C)  # number of chunks
    pad = N * C - T
    scale = _scale(q, scale)
    state0 = _zero_state(q, v) if initial_state is None else initial_state.astype(f32)
    gamma = log_decay.astype(f32)  # [H]
    reset = jnp.zeros((B, T), bool) if reset is None else reset.astype(bool)
    valid = jnp.ones((B, T), bool) if valid is None else valid.astype(bool)
    v = jnp.where(valid[:, :, None, None], v, jnp.zeros((), v.dtype))  # padding adds no k v^T
    # the chunk padding is padding too: no value, no decay, no reset
    reset = jnp.pad(reset, ((0, 0), (0, pad)))
    valid = jnp.pad(valid, ((0, 0), (0, pad)))

    def to_chunks(x):  # [B, T, H, X] -> [N, B, H, C, X]
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
        return x.reshape(B, N, C, H, x.shape[-1]).transpose(1, 0, 3, 2, 4)

    qc, kc, vc = to_chunks(q), to_chunks(k), to_chunks(v)
    p = jnp.cumsum(valid.reshape(B, N, C).transpose(1, 0, 2), -1, dtype=f32)  # [N, B, C]
    g = jnp.cumsum(reset.reshape(B, N, C).transpose(1, 0, 2), -1, dtype=jnp.int32)  # [N, B, C]
    gam = gamma[None, None, :, None]  # [1, 1, H, 1]

    # Intra-chunk, the decay matrix masked by causality and by segment.
    i = jnp.arange(C)[:, None]
    j = jnp.arange(C)[None, :]
    same = (i >= j) & (g[..., :, None] == g[..., None, :])  # [N, B, C, C]
    dp = jnp.where(same, p[..., :, None] - p[..., None, :], 0.0)  # [N, B, C, C], >= 0
    M = jnp.where(same[:, :, None], jnp.exp(gam[..., None] * dp[:, :, None]), 0.0)  # [N,B,H,C,C]
    A = jnp.einsum("nbhik,nbhjk->nbhij", qc, kc, preferred_element_type=f32)  # [N,B,H,C,C]
    A = scale * A * M
    o_intra = jnp.einsum("nbhij,nbhjv->nbhiv", A.astype(v.dtype), vc, preferred_element_type=f32)

    # State carry: only keys after the chunk's last reset, decayed to the chunk's end.
    p_last, g_last = p[..., -1:], g[..., -1:]  # [N, B, 1]
    k_live = (g == g_last)[:, :, None]  # [N, B, 1, C]
    k_decay = jnp.where(
        k_live, jnp.exp(gam * jnp.where(k_live, (p_last - p)[:, :, None], 0.0)), 0.0
    )  # [N, B, H, C], lambda^(p_last - p_j) [g_j == g_last]
    kv = jnp.einsum(
        "nbhjk,nbhjv->nbhkv",
        kc * k_decay[..., None].astype(kc.dtype),
        vc,
        preferred_element_type=f32,
    )  # [N, B, H, K, V]
    chunk_decay = jnp.where(
        g_last == 0, jnp.exp(gamma[None, None, :] * p_last), 0.0
    )  # [N, B, H], lambda^(p_last) or 0 after a reset in the chunk

    def carry(state, xs):  # state: S_{c-1} [B, H, K, V]
        kv_c, decay_c = xs
        return decay_c[:, :, None, None] * state + kv_c, state

    final_state, prev_states = jax.lax.scan(
        carry, state0, (kv, chunk_decay), unroll=N if unroll else 1
    )  # prev_states: [N, B, H, K, V]

    # Inter-chunk: queries before the chunk's first reset read the carried state.
    q_live = (g == 0)[:, :, None]  # [N, B, 1, C]
    q_decay = jnp.where(q_live, jnp.exp(gam * p[:, :, None]), 0.0)  # [N, B, H, C]
    o_inter = jnp.einsum(
        "nbhik,nbhkv->nbhiv", (scale * qc.astype(f32)) * q_decay[..., None], prev_states
    )
    o = (o_intra + o_inter).transpose(1, 0, 3, 2, 4).reshape(B, N * C, H, V)[:, :T]
    return o.astype(v.dtype), final_state
