"""Context-parallel GLA (laplace_jax/context_parallel.py) against the recurrent definition.

Sequences split over a `context` mesh axis of 2, 4 and 8 simulated devices give the outputs,
final state and gradients of `gla_recurrent` over the whole sequence (fp32: 1e-5 of the largest
entry), with documents crossing slice boundaries, a document starting exactly at a slice's first
token, back-to-back one-token documents, padding (inside a sequence, at a slice's end and at the
sequence's end), and slices of one chunk.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from laplace_jax.context_parallel import gla_context_parallel
from laplace_jax.gla import gla_recurrent

B, H, K, V, C = 2, 3, 4, 5, 4
LOG_DECAY = jnp.log(jnp.asarray([0.5, 0.9, 0.999], jnp.float32))


def inputs(T, seed=0):
    rng = np.random.default_rng(seed)
    q, k = (jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32)
    return q, k, v


def masks(T, L):
    """Document starts: one crossing a slice boundary, one exactly at slice 1's first token,
    back-to-back one-token documents; padding at the end of sequence 1, and inside sequence 0
    (its second token, and slice 0's last token: a slice ending on padding)."""
    reset = np.zeros((B, T), bool)
    reset[0, L + L // 2 + 1] = True  # inside slice 1: the document runs on into slice 2
    reset[1, L] = True  # exactly at slice 1's first token
    reset[1, T - 3 : T - 1] = True  # one-token documents
    valid = np.ones((B, T), bool)
    valid[1, T - 2 :] = False  # padding (a reset on a padded token still zeroes)
    valid[0, [1, L - 1]] = False  # padding inside a sequence, at a slice's end too
    return jnp.asarray(reset), jnp.asarray(valid)


def context_gla(S, q, k, v, reset=None, valid=None):
    """gla_context_parallel over S devices of a `context` axis: (o, the sequence's final state)."""
    mesh = Mesh(np.asarray(jax.devices()[:S]), ("context",))
    seq, st = PartitionSpec(None, "context"), PartitionSpec("context")
    masks = {n: m for n, m in (("reset", reset), ("valid", valid)) if m is not None}

    def body(q, k, v, *given):
        kw = dict(zip(masks, given, strict=True))
        o, state = gla_context_parallel(q, k, v, LOG_DECAY, axis="context", chunk_size=C, **kw)
        return o, state[None]  # [1, B, H, K, V]: this slice's final state

    specs = (seq,) * (3 + len(masks))
    fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(seq, st), check_vma=False)
    o, states = fn(q, k, v, *masks.values())
    return o, states[-1]  # the last slice's final state is the sequence's


@pytest.mark.parametrize("S,L", [(2, 8), (4, 4), (8, 4)])  # L = C: slices of one chunk
def test_outputs_and_final_state_equal_the_recurrence(S, L):
    T = S * L
    q, k, v = inputs(T)
    reset, valid = masks(T, L)
    o, state = jax.jit(functools.partial(context_gla, S))(q, k, v, reset, valid)
    ref_o, ref_state = gla_recurrent(q, k, v, LOG_DECAY, reset=reset, valid=valid)
    np.testing.assert_allclose(o, ref_o, atol=1e-5 * float(jnp.abs(ref_o).max()))
    np.testing.assert_allclose(state, ref_state, atol=1e-5 * float(jnp.abs(ref_state).max()))


def test_gradients_with_and_without_resets_and_padding():
    S, L = 4, 8
    T = S * L
    q, k, v = inputs(T, seed=1)
    reset, valid = masks(T, L)
    w = jnp.asarray(np.random.default_rng(2).standard_normal((B, T, H, V)), jnp.float32)

    def loss(fn, q, k, v):  # a weighted sum of the outputs plus the final state's
        o, state = fn(q, k, v)
        return jnp.sum(o * w) + jnp.sum(state)

    for r, m in ((None, None), (reset, valid)):
        cp = functools.partial(context_gla, S, reset=r, valid=m)
        ref = functools.partial(gla_recurrent, log_decay=LOG_DECAY, reset=r, valid=m)
        got = jax.jit(jax.grad(functools.partial(loss, cp), argnums=(0, 1, 2)))(q, k, v)
        want = jax.jit(jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2)))(q, k, v)
        for g, e in zip(got, want, strict=True):
            np.testing.assert_allclose(g, e, atol=1e-5 * float(jnp.abs(e).max()))


def test_the_step_has_no_conditionals_or_loops_of_unknown_length():
    """Neuron (docs/design.md s1): no cond, no data-dependent while, no host callbacks."""
    S, L = 4, 8
    q, k, v = inputs(S * L)
    reset, valid = masks(S * L, L)
    grad = jax.grad(lambda q: context_gla(S, q, k, v, reset, valid)[0].sum())
    text = jax.jit(grad).lower(q).as_text()
    for bad in ("stablehlo.case", "stablehlo.if", "custom_call @xla_python"):
        assert bad not in text, bad
