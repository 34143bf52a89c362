"""Document boundaries in packed training (issue 10, part 5).

A packed sequence of documents, with a reset at every document start, must give each document
exactly what a separate run of it gives (fp32 rounding): the GLA kernels (chunked against the
recurrent reference), the model's logits and final state (GLA state and conv window), and the
loss gradients of the FSDP training path. Padding masks the decay as well as the values
(flash-linear-attention issue 1272).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from laplace_jax.fsdp import make_loss_and_grad
from laplace_jax.gla import gla_chunked, gla_recurrent
from laplace_jax.loss import next_token_loss
from laplace_jax.model import LaplaceLM, init_params, reset_after_eot
from laplace_jax.sharding import logical_sharding, make_mesh, param_shardings, param_specs
from laplace_spec.config import get_config
from train.step import EVAL_BATCH_AXES

TINY = get_config("tiny")  # seq_len 64, chunk_size 16
EOT = TINY.vocab_size - 1
B, H, K, V = 2, 4, 8, 16
LOG_DECAY = jnp.log(2.0 ** (-1.0 / jnp.array([1.0, 4.0, 16.0, 64.0], jnp.float32)))


def _qkv(T, seed=0, b=B):
    rng = np.random.default_rng(seed)
    q, k = (jnp.asarray(rng.standard_normal((b, T, H, K)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((b, T, H, V)), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((b, H, K, V)), jnp.float32)
    return q, k, v, s0


def _starts(lengths):
    """Document lengths -> their start positions (the first is 0)."""
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int)


def _reset(lengths, b=B, at_zero=False):
    r = np.zeros((b, sum(lengths)), bool)
    r[:, _starts(lengths)] = True
    r[:, 0] = at_zero
    return jnp.asarray(r)


def _maxdiff(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _max_rel(a, b):
    """Largest |a - b| / max|b| over the leaves of two gradient trees."""
    rel = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y))), a, b)
    return max(jax.tree.leaves(rel))


# ---- the kernels --------------------------------------------------------------------------

# chunk 16: (16, 7, 25) ends a document exactly on a chunk boundary, (5, 30, 13) starts and ends
# documents inside chunks and spans one over a whole chunk; T = 45 leaves a padded last chunk.
LAYOUTS = [(16, 7, 25), (5, 30, 13), (20, 25), (3, 1, 41)]


@pytest.mark.parametrize("chunk", [8, 16, 64])
@pytest.mark.parametrize("with_valid", [False, True])
def test_chunked_matches_recurrent_with_resets_and_padding(chunk, with_valid):
    """Random resets and padding, an initial state: outputs, final state and gradients."""
    T = 45
    q, k, v, s0 = _qkv(T)
    rng = np.random.default_rng(7)
    reset = jnp.asarray(rng.random((B, T)) < 0.1).at[0, 0].set(True)
    valid = jnp.asarray(rng.random((B, T)) < 0.8) if with_valid else None
    w = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32)

    def run(fn, **kw):
        def f(q, k, v, s0):
            o, s = fn(q, k, v, LOG_DECAY, initial_state=s0, reset=reset, valid=valid, **kw)
            return jnp.sum(o * w) + jnp.sum(s), (o, s)

        return jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, s0)

    (_, (o1, s1)), g1 = run(gla_chunked, chunk_size=chunk)
    (_, (o2, s2)), g2 = run(gla_recurrent)
    assert _maxdiff(o1, o2) < 1e-5
    assert _maxdiff(s1, s2) < 1e-5
    assert _maxdiff(g1, g2) < 1e-4


@pytest.mark.parametrize("lengths", LAYOUTS)
@pytest.mark.parametrize("fn", [gla_chunked, gla_recurrent], ids=["chunked", "recurrent"])
def test_packed_documents_equal_separate_runs(lengths, fn):
    """Outputs, final state (the last document's) and input gradients of the packed run equal
    those of each document run alone from a zero state."""
    T = sum(lengths)
    q, k, v, _ = _qkv(T, seed=1)
    w = jnp.asarray(np.random.default_rng(2).standard_normal((B, T, H, V)), jnp.float32)
    kw = {"chunk_size": 16} if fn is gla_chunked else {}

    def packed(q, k, v):
        o, s = fn(q, k, v, LOG_DECAY, reset=_reset(lengths), **kw)
        return jnp.sum(o * w), (o, s)

    def separate(q, k, v):
        outs, s = [], None
        for a, n in zip(_starts(lengths), lengths, strict=True):
            o, s = gla_recurrent(q[:, a : a + n], k[:, a : a + n], v[:, a : a + n], LOG_DECAY)
            outs.append(o)
        o = jnp.concatenate(outs, axis=1)
        return jnp.sum(o * w), (o, s)

    (_, (o1, s1)), g1 = jax.value_and_grad(packed, (0, 1, 2), has_aux=True)(q, k, v)
    (_, (o2, s2)), g2 = jax.value_and_grad(separate, (0, 1, 2), has_aux=True)(q, k, v)
    assert _maxdiff(o1, o2) < 1e-5
    assert _maxdiff(s1, s2) < 1e-5
    assert _maxdiff(g1, g2) < 1e-4


@pytest.mark.parametrize("fn", [gla_chunked, gla_recurrent], ids=["chunked", "recurrent"])
def test_reset_at_position_zero_discards_the_initial_state(fn):
    q, k, v, s0 = _qkv(40, seed=3)
    reset = jnp.zeros((B, 40), bool).at[:, 0].set(True)
    o1, s1 = fn(q, k, v, LOG_DECAY, initial_state=s0, reset=reset)
    o2, s2 = gla_recurrent(q, k, v, LOG_DECAY)
    assert _maxdiff(o1, o2) < 1e-5 and _maxdiff(s1, s2) < 1e-5
    # and without the reset the initial state does matter
    o3, _ = fn(q, k, v, LOG_DECAY, initial_state=s0)
    assert _maxdiff(o3, o2) > 1e-2


@pytest.mark.parametrize("fn", [gla_chunked, gla_recurrent], ids=["chunked", "recurrent"])
@pytest.mark.parametrize("where", ["leading", "interior"])
def test_padding_masks_the_decay_as_well_as_the_values(fn, where):
    """fla issue 1272: padded steps (arbitrary content, valid False) pass the state through,
    undecayed. Leading padding before a warm state, or interior padding, changes nothing for
    the real tokens: they equal a run of the real tokens alone."""
    P, R = 11, 29  # padding and real tokens; T = 40 with chunk 16: padding crosses a chunk
    q, k, v, s0 = _qkv(P + R, seed=4)
    pad = np.zeros(P + R, bool)
    pad[:P] = where == "leading"
    if where == "interior":
        pad[9 : 9 + P] = True
    valid = jnp.asarray(np.broadcast_to(~pad, (B, P + R)))
    kw = {"chunk_size": 16} if fn is gla_chunked else {}
    o1, s1 = fn(q, k, v, LOG_DECAY, initial_state=s0, valid=valid, **kw)
    real = np.flatnonzero(~pad)
    o2, s2 = gla_recurrent(q[:, real], k[:, real], v[:, real], LOG_DECAY, initial_state=s0)
    assert _maxdiff(o1[:, real], o2) < 1e-5
    assert _maxdiff(s1, s2) < 1e-5
    # the bug itself: masking only the values decays the state across the padding
    v_only = jnp.where(valid[..., None, None], v, 0.0)
    o3, _ = fn(q, k, v_only, LOG_DECAY, initial_state=s0, **kw)
    assert _maxdiff(o3[:, real], o2) > 1e-2


def test_no_reset_and_no_padding_masks_change_nothing():
    """All-False resets and all-True validity: the masked path equals the plain one."""
    q, k, v, s0 = _qkv(45, seed=5)
    o1, s1 = gla_chunked(q, k, v, LOG_DECAY, chunk_size=16, initial_state=s0)
    o2, s2 = gla_chunked(
        q,
        k,
        v,
        LOG_DECAY,
        chunk_size=16,
        initial_state=s0,
        reset=jnp.zeros((B, 45), bool),
        valid=jnp.ones((B, 45), bool),
    )
    assert _maxdiff(o1, o2) < 1e-5 and _maxdiff(s1, s2) < 1e-5


# ---- the model ----------------------------------------------------------------------------


def _docs(lengths, b, seed):
    """Packed token sequences [b, sum(lengths)]: documents of random tokens, each but the last
    ending in EOT (no EOT elsewhere)."""
    rng = np.random.default_rng(seed)
    t = rng.integers(0, EOT, (b, sum(lengths)))
    t[:, np.cumsum(lengths)[:-1] - 1] = EOT
    return jnp.asarray(t, jnp.int32)


def test_reset_after_eot():
    t = jnp.asarray([[EOT, 3, EOT, EOT, 5, 6]])
    assert reset_after_eot(t, EOT).tolist() == [[False, True, False, True, True, False]]


@pytest.mark.parametrize("lengths", [(16, 21, 27), (5, 40, 19), (64,)])
def test_model_packed_logits_and_state_equal_separate_runs(lengths):
    """Logits, and the final state (GLA and conv window) of the last document."""
    model = LaplaceLM(TINY)
    params = {"params": init_params(TINY, jax.random.key(0))}
    tokens = _docs(lengths, 2, seed=0)
    logits, state = model.apply(params, tokens, reset=reset_after_eot(tokens, EOT))
    outs = []
    for a, n in zip(_starts(lengths), lengths, strict=True):
        lg, ref_state = model.apply(params, tokens[:, a : a + n])
        outs.append(lg)
    assert _maxdiff(logits, jnp.concatenate(outs, 1)) < 2e-5
    assert _maxdiff(state, ref_state) < 2e-5
    # without resets the later documents do see the earlier ones
    if len(lengths) > 1:
        plain, _ = model.apply(params, tokens)
        assert _maxdiff(plain, logits) > 1e-3


def test_model_reset_at_zero_and_eot_padding_then_real_tokens():
    """A reset at position 0 discards a given state (conv window included); EOT padding before
    the real tokens (the fla 1272 layout) leaves the real tokens' logits as if alone."""
    model = LaplaceLM(TINY)
    params = {"params": init_params(TINY, jax.random.key(1))}
    tokens = _docs((64,), 2, seed=1)
    _, warm = model.apply(params, _docs((64,), 2, seed=2))
    reset0 = jnp.zeros((2, 64), bool).at[:, 0].set(True)
    lg, st = model.apply(params, tokens, warm, reset=reset0)
    ref, ref_st = model.apply(params, tokens)
    assert _maxdiff(lg, ref) < 2e-5 and _maxdiff(st, ref_st) < 2e-5
    padded = jnp.concatenate([jnp.full((2, 9), EOT, jnp.int32), tokens[:, :55]], 1)
    lg, _ = model.apply(params, padded, reset=reset_after_eot(padded, EOT))
    ref, _ = model.apply(params, tokens[:, :55])
    assert _maxdiff(lg[:, 9:], ref) < 2e-5


# ---- the training loss ----------------------------------------------------------------------


def test_fsdp_loss_gradients_equal_separate_documents():
    """make_loss_and_grad(eot_id) on packed sequences: the loss and gradients of each document
    run separately (targets as packed: an EOT's target is the next document's first token).
    With the 3B preset's per-layer remat; every remat policy gives the plain gradient
    (tests/test_fsdp.py), so one policy here covers the resets."""
    lengths = (16, 21, 28)  # inputs are the first 64 of the 65 tokens
    mesh = make_mesh(8, data=1)
    batch = logical_sharding(mesh, EVAL_BATCH_AXES)
    host = init_params(TINY, jax.random.key(0))  # the references run on one device
    params = jax.device_put(host, param_shardings(TINY, mesh))
    tokens = _docs(lengths, 8, seed=3)
    model = LaplaceLM(TINY)

    def separate(p, t):
        inputs, targets = t[:, :-1], t[:, 1:]
        total = 0.0
        for a, n in zip(_starts(lengths), lengths, strict=True):
            n = min(n, inputs.shape[1] - a)
            lg, _ = model.apply({"params": p}, inputs[:, a : a + n])
            ce = optax.softmax_cross_entropy_with_integer_labels(lg, targets[:, a : a + n])
            total = total + ce.sum()
        return total / targets.size

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(separate))(host, tokens)
    fn = make_loss_and_grad(model, mesh, param_specs(TINY, mesh), "layer", eot_id=EOT)
    loss, grads = jax.jit(fn)(params, jax.device_put(tokens, batch))
    assert abs(float(loss) - float(ref_loss)) < 1e-6 * abs(float(ref_loss))
    # fp32 at initialisation: the gradients are sums of 512 tokens' terms that mostly cancel, so
    # a rounding-level change per token shows as ~1e-4 of a leaf's largest entry (computed in
    # float64 the packed and separate gradients agree to 3e-15); without resets: ~1e-1
    assert _max_rel(grads, ref_grads) < 1e-3
    plain = jax.jit(jax.grad(lambda p, t: next_token_loss(model, p, t)))(host, tokens)
    assert _max_rel(plain, ref_grads) > 1e-2
    # the same math as the plain model's loss with resets: only summation order differs
    packed_ref = jax.jit(jax.grad(lambda p, t: next_token_loss(model, p, t, EOT)))(host, tokens)
    assert _max_rel(grads, packed_ref) < 1e-3
    # resets with a task's answer mask: tests/test_context_training.py (against the plain model)
