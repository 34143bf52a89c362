"""Causal softmax attention: the token mixer of the retrieval baseline (docs/design.md s9).

`token_mixer="attention"` (laplace_spec/config.py) swaps step 4 of the Laplace layer, the GLA,
for softmax attention over the same q, k, v; everything else in the layer (conv, projections,
self-augmentation, head norm, gate, channel mixer) and the parameter tree stay as they are, so
the baseline has Laplace's width, depth, FFN and parameter count exactly, and its 2-D matrices go
to Muon by the same path rule. Attention keeps every key and value instead of a fixed state: it
is the model the fixed state is measured against, for training and full-sequence evaluation
(there is no decode step; serving a transformer is vLLM's business).

    q, k: [B, T, H, K]    v: [B, T, H, V]
    o_t = sum_{s <= t, same document} softmax_s(scale q_t . k_s) v_s,   scale = K ** -0.5

Two forms that must agree:

- `causal_attention_reference`: the definition, all heads at once with the [B, H, T, T] scores.
- `causal_attention`: one head at a time (`lax.map`, a loop with a static trip count), each
  head's scores recomputed in the backward pass instead of stored, as FlashAttention does: at
  T = 8,192 the `small` preset's stored scores would take 4 layers x 6 heads x 268 MB.

`reset` [B, T] bool (optional) marks document starts in a packed sequence, as for the GLA
(`laplace_jax/gla.py`): a token attends only to its own document.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

f32 = jnp.float32


def _allowed(T: int, reset) -> jax.Array:
    """[T, T] (no reset) or [B, T, T] bool: may query t attend to key s?"""
    causal = jnp.tril(jnp.ones((T, T), bool))  # s <= t
    if reset is None:
        return causal
    doc = jnp.cumsum(reset, axis=1, dtype=jnp.int32)  # [B, T] document index of each token
    return causal & (doc[:, :, None] == doc[:, None, :])  # [B, T, T]


def causal_attention_reference(q, k, v, reset=None, scale=None):
    """The definition. q, k: [B, T, H, K]; v: [B, T, H, V] -> o [B, T, H, V] fp32.
    `scale` defaults to K ** -0.5 (the model passes its config's `qk_scale`)."""
    T, K = q.shape[1], q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    s = jnp.einsum("bthk,bshk->bhts", q.astype(f32), k.astype(f32)) * scale  # [B, H, T, T]
    allowed = _allowed(T, reset)
    allowed = allowed[None, None] if reset is None else allowed[:, None]  # [., ., T, T]
    p = jax.nn.softmax(jnp.where(allowed, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshv->bthv", p, v.astype(f32))


def causal_attention(q, k, v, reset=None, scale=None):
    """Head by head, scores recomputed in the backward. Shapes and result as the reference."""
    T, K = q.shape[1], q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    allowed = _allowed(T, reset)  # [T, T] or [B, T, T], broadcast against [B, T, T] scores

    @jax.checkpoint
    def one_head(qkv):  # q, k: [B, T, K]; v: [B, T, V] (one head)
        qh, kh, vh = qkv
        s = jnp.einsum("btk,bsk->bts", qh.astype(f32), kh.astype(f32)) * scale  # [B, T, T]
        p = jax.nn.softmax(jnp.where(allowed, s, -jnp.inf), axis=-1)
        return jnp.einsum("bts,bsv->btv", p, vh.astype(f32))  # [B, T, V]

    heads_first = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731  [B, T, H, X] -> [H, B, T, X]
    o = jax.lax.map(one_head, (heads_first(q), heads_first(k), heads_first(v)))  # [H, B, T, V]
    return jnp.moveaxis(o, 0, 2)
