"""The training objective: next-token cross-entropy of the model's logits (the one loss).

    tokens [B, T + 1]: inputs tokens[:, :-1], targets tokens[:, 1:]
    ce[b, t] = -log softmax(logits[b, t])[targets[b, t]]                       [B, T], fp32

The head and the cross-entropy are applied `block_tokens` tokens at a time (a `lax.map` over
blocks of the flattened [B T] tokens, each block a `jax.checkpoint`): at most one block's
[block_tokens, V] fp32 logits are live, in the forward and in the backward, which recomputes
them. At 16,384 tokens on a device and the 3B vocabulary, whole logits would be 3.3 GB (and as
much for their gradient); a block of 2,048 is 412 MB. The result is the same cross-entropy.

With sequences split over a context axis (docs/design.md s11), every device of a context group
holds the group's whole token windows [b, T + 1] (a few bytes per token) and cuts its own slice
of inputs, targets and document starts from them (`next_token_slice`): the target of a slice's
last token is the next slice's first token, and whether a document starts at a slice's first
token is read from the last input of the slice before. No collective is involved.

Evaluation, the FSDP training step (laplace_jax/fsdp.py, which adds its target mask and the
share of the global mean, and on a context axis hands each device its slice of inputs and
targets) and the tests all take it from here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from laplace_jax.generate import greedy_token
from laplace_jax.model import LaplaceLM, reset_after_eot

# Tokens whose logits are computed at once ([LOSS_BLOCK_TOKENS, V] fp32 is the largest).
LOSS_BLOCK_TOKENS = 2048


def over_token_blocks(fn, params, x, targets, block_tokens: int = LOSS_BLOCK_TOKENS):
    """fn(params, x [N, D], targets [N]) -> per-token arrays [N] (a tuple of them allowed),
    applied to x [B, T, D] and targets [B, T] `block_tokens` tokens at a time -> [B, T] each."""
    B, T, D = x.shape
    n = B * T
    if n <= block_tokens:  # one block: the plain computation
        out = fn(params, x.reshape(n, D), targets.reshape(n))
        return jax.tree.map(lambda y: y.reshape(B, T), out)
    blocks = -(-n // block_tokens)
    pad = blocks * block_tokens - n  # the last block is padded; its padding is cut off below
    xb = jnp.pad(x.reshape(n, D), ((0, pad), (0, 0))).reshape(blocks, block_tokens, D)
    tb = jnp.pad(targets.reshape(n), (0, pad)).reshape(blocks, block_tokens)

    @jax.checkpoint  # the backward recomputes the block's logits instead of keeping them
    def block(xt):  # x [block_tokens, D], targets [block_tokens] -> [block_tokens] each
        return fn(params, *xt)

    out = jax.lax.map(block, (xb, tb))  # [blocks, block_tokens] each
    return jax.tree.map(lambda y: y.reshape(blocks * block_tokens)[:n].reshape(B, T), out)


def blocked_cross_entropy(logits_fn, params, x, targets, block_tokens: int = LOSS_BLOCK_TOKENS):
    """ce [B, T] fp32 of logits_fn(params, x) [B, T, V] against targets [B, T], computed a block
    of `block_tokens` tokens at a time (x: [B, T, D], what the head reads)."""

    def ce(p, x_block, t_block):
        return optax.softmax_cross_entropy_with_integer_labels(logits_fn(p, x_block), t_block)

    return over_token_blocks(ce, params, x, targets, block_tokens)


def _head(model: LaplaceLM):
    def logits(p, x_block):  # [..., D] -> [..., V] fp32
        return model.apply({"params": p}, x_block, method=LaplaceLM.logits)

    return logits


def token_losses(
    model: LaplaceLM,
    params,
    inputs,
    targets,
    reset=None,
    layers=None,
    block_tokens: int = LOSS_BLOCK_TOKENS,
):
    """ce [B, T] of the next-token `targets` [B, T] of `inputs` [B, T]. `reset` [B, T] bool or
    None: document starts (`reset_after_eot`). `layers`: as in `LaplaceLM.__call__` (FSDP's
    gathered decoder layers; `params` then holds only the top-level weights)."""
    x = model.apply(
        {"params": params}, inputs, reset=reset, layers=layers, method=LaplaceLM.hidden
    )  # [B, T, D]
    return blocked_cross_entropy(_head(model), params, x, targets, block_tokens)


def token_scores(model: LaplaceLM, params, inputs, targets, reset=None, layers=None):
    """What evaluation reads at every position, a block of tokens at a time: (ce [B, T] fp32,
    the greedy next token [B, T] int32, `generate.greedy_token`'s Neuron-clean argmax)."""
    x = model.apply(
        {"params": params}, inputs, reset=reset, layers=layers, method=LaplaceLM.hidden
    )  # [B, T, D]
    logits_fn = _head(model)

    def scores(p, x_block, t_block):
        logits = logits_fn(p, x_block)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, t_block)
        return ce, greedy_token(logits)

    return over_token_blocks(scores, params, x, targets)


def next_token_losses(model: LaplaceLM, params, tokens, eot_id: int | None = None, layers=None):
    """ce [B, T] of tokens [B, T + 1]. `eot_id`: packed documents, the model resets its state at
    the token after each end-of-text. `layers`: as in `token_losses`."""
    inputs, targets, reset = next_token_slice(tokens, eot_id, None)  # [B, T] each
    return token_losses(model, params, inputs, targets, reset, layers)


def next_token_slice(tokens, eot_id: int | None, axis: str | None):
    """Whole token windows tokens [b, T + 1] -> this device's slice of (inputs, targets, reset),
    each [b, T / S]: positions [i L, (i + 1) L) of the whole sequences' inputs tokens[:, :-1],
    targets tokens[:, 1:] and `reset_after_eot(inputs, eot_id)` (None without `eot_id`), for
    device i of `axis` (S devices; None: the whole sequence, S = 1)."""
    T = tokens.shape[1] - 1
    S = 1 if axis is None else jax.lax.axis_size(axis)
    L = T // S
    start = 0 if axis is None else jax.lax.axis_index(axis) * L
    window = jax.lax.dynamic_slice_in_dim(tokens, start, L + 1, axis=1)  # [b, L + 1]
    inputs, targets = window[:, :-1], window[:, 1:]
    if eot_id is None:
        return inputs, targets, None
    # the input before the slice (a clamped read on the first device, where nothing precedes)
    before = jax.lax.dynamic_slice_in_dim(tokens, jnp.maximum(start - 1, 0), 1, axis=1)
    reset = reset_after_eot(jnp.concatenate([before, inputs], axis=1), eot_id)[:, 1:]
    return inputs, targets, reset.at[:, 0].set(reset[:, 0] & (start > 0))  # [b, L] each


def next_token_loss(model: LaplaceLM, params, tokens, eot_id: int | None = None):
    """The mean of `next_token_losses`: a scalar."""
    return next_token_losses(model, params, tokens, eot_id).mean()
