"""Greedy generation with the JAX model: chunked prefill, then the O(1) decode step (the
attention baseline, which has no state, recomputes the whole prefix for every token).

The greedy token is chosen without `argmax`, which lowers to a variadic (value, index) reduce
that the Neuron plugin does not support (docs/design.md s1): `greedy_token` uses two plain
reductions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax.model import LaplaceLM
from laplace_spec.config import LaplaceConfig


def greedy_token(logits):
    """logits [..., V] -> the first index of the largest logit [...], exactly `argmax`'s choice
    for finite logits, from a max and a min (single-operand reductions)."""
    V = logits.shape[-1]
    best = jnp.max(logits, axis=-1, keepdims=True)
    index = jnp.arange(V, dtype=jnp.int32)
    return jnp.min(jnp.where(logits == best, index, V - 1), axis=-1)


@functools.partial(jax.jit, static_argnums=0)
def prefill(config, params, tokens):
    """The prompt's last greedy token and the state after it (one program for all layers)."""
    logits, state = LaplaceLM(config).apply({"params": params}, tokens)
    return greedy_token(logits[:, -1]), state


@functools.partial(jax.jit, static_argnums=0)
def decode(config, params, token, state):
    """One token in, the next greedy token and the state after it out."""
    logits, state = LaplaceLM(config).apply(
        {"params": params}, token, state, method=LaplaceLM.decode_step
    )
    return greedy_token(logits), state


@functools.partial(jax.jit, static_argnums=0)
def next_token_by_recompute(config, params, tokens, position):
    logits, _ = LaplaceLM(config).apply({"params": params}, tokens)  # [B, T + n, V]
    return greedy_token(jnp.take(logits, position, axis=1))  # the prediction after `position`


def _greedy_by_recompute(params, config, prompt, max_new_tokens) -> np.ndarray:
    """For the attention baseline, which keeps no state: every step runs the whole causal model
    over a fixed [B, T + n] buffer (one compiled shape; what follows `position` cannot reach it)."""
    B, T = prompt.shape
    buf = np.zeros((B, T + max_new_tokens), np.int32)
    buf[:, :T] = prompt
    for i in range(max_new_tokens):
        token = next_token_by_recompute(config, params, jnp.asarray(buf), T - 1 + i)
        buf[:, T + i] = np.asarray(token)
    return buf[:, T:]


def greedy_generate(
    params: dict, config: LaplaceConfig, prompt_ids, max_new_tokens: int
) -> np.ndarray:
    """prompt_ids: [B, T] (or [T]) ints, all prompts of one length -> new tokens [B, n] (or [n])."""
    prompt = np.asarray(prompt_ids, np.int32)
    single = prompt.ndim == 1
    prompt = prompt[None] if single else prompt
    if prompt.shape[1] == 0:
        raise ValueError("greedy_generate needs a prompt of at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if "attention" in config.layer_mixers:  # no decode step: the whole sequence each token
        new = _greedy_by_recompute(params, config, prompt, max_new_tokens)
        return new[0] if single else new
    token, state = prefill(config, params, jnp.asarray(prompt))
    out = [token]
    for _ in range(max_new_tokens - 1):
        token, state = decode(config, params, token, state)
        out.append(token)
    new = np.asarray(jnp.stack(out, axis=1))  # [B, max_new_tokens]
    return new[0] if single else new
