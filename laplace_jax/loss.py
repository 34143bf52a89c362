"""The training objective: next-token cross-entropy of the model's logits (the one loss).

    tokens [B, T + 1]: inputs tokens[:, :-1], targets tokens[:, 1:]
    ce[b, t] = -log softmax(logits[b, t])[targets[b, t]]                       [B, T], fp32

Evaluation, the FSDP training step (laplace_jax/fsdp.py, which adds its target mask and the
share of the global mean) and the tests all take it from here.
"""

from __future__ import annotations

import optax

from laplace_jax.model import LaplaceLM, reset_after_eot


def next_token_losses(model: LaplaceLM, params, tokens, eot_id: int | None = None, layers=None):
    """ce [B, T] of tokens [B, T + 1]. `eot_id`: packed documents, the model resets its state at
    the token after each end-of-text. `layers`: as in `LaplaceLM.__call__` (FSDP's gathered
    decoder layers; `params` then holds only the top-level weights)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # [B, T]
    reset = None if eot_id is None else reset_after_eot(inputs, eot_id)  # [B, T] bool
    logits, _ = model.apply({"params": params}, inputs, reset=reset, layers=layers)  # [B, T, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def next_token_loss(model: LaplaceLM, params, tokens, eot_id: int | None = None):
    """The mean of `next_token_losses`: a scalar."""
    return next_token_losses(model, params, tokens, eot_id).mean()
