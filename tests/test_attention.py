"""The softmax-attention baseline (`token_mixer="attention"`, laplace_jax/attention.py).

Truths: PyTorch's `scaled_dot_product_attention` (written by others) for the attention itself;
Laplace's own parameter tree and Muon rule for the baseline's shape; separate per-document runs
for packed sequences; the plain model's gradient for the FSDP training path.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax.traverse_util import flatten_dict

from export.exporter import ExportError, convert
from laplace_jax import optim
from laplace_jax.accounting import parameter_counts, training_flops_per_token
from laplace_jax.attention import causal_attention, causal_attention_reference
from laplace_jax.fsdp import make_loss_and_grad
from laplace_jax.generate import greedy_generate
from laplace_jax.loss import next_token_loss
from laplace_jax.model import LaplaceLM, abstract_params, init_params, init_state, reset_after_eot
from laplace_jax.sharding import logical_sharding, make_mesh, param_shardings, param_specs
from laplace_spec.config import ConfigError, get_config
from train.step import EVAL_BATCH_AXES

TINY = get_config("tiny")
BASE = TINY.replace(token_mixer="attention")


def _qkv(B=2, T=40, H=3, K=8, V=16, seed=0):
    r = np.random.default_rng(seed)
    return tuple(
        jnp.asarray(r.normal(size=(B, T, H, d)), jnp.float32) for d in (K, K, V)
    )  # q, k, v


def _sdpa(q, k, v):
    """torch's causal attention on [B, T, H, X] arrays (it takes [B, H, T, X])."""
    t = [torch.from_numpy(np.array(x)).transpose(1, 2) for x in (q, k, v)]
    return F.scaled_dot_product_attention(*t, is_causal=True).transpose(1, 2).numpy()


def test_attention_equals_torch_sdpa_and_the_reference():
    q, k, v = _qkv()
    want = _sdpa(q, k, v)
    np.testing.assert_allclose(causal_attention_reference(q, k, v), want, atol=2e-6)
    np.testing.assert_allclose(causal_attention(q, k, v), want, atol=2e-6)


def test_packed_documents_attend_only_to_their_own_document():
    """reset at 0, 13 and 30 of a 40-token row: each document's outputs are torch's causal
    attention over that document alone."""
    q, k, v = _qkv(B=1)
    reset = np.zeros((1, 40), bool)
    reset[0, [13, 30]] = True
    got = np.asarray(causal_attention(q, k, v, jnp.asarray(reset)))
    np.testing.assert_allclose(causal_attention_reference(q, k, v, reset), got, atol=2e-6)
    for a, b in ((0, 13), (13, 30), (30, 40)):
        want = _sdpa(q[:, a:b], k[:, a:b], v[:, a:b])
        np.testing.assert_allclose(got[:, a:b], want, atol=2e-6)


def test_head_by_head_gradients_equal_the_reference():
    q, k, v = _qkv(seed=1)
    reset = jnp.zeros((2, 40), bool).at[1, 17].set(True)
    w = jnp.asarray(np.random.default_rng(2).normal(size=(2, 40, 3, 16)), jnp.float32)
    for r in (None, reset):

        def grads(attention, r=r):
            loss = lambda *qkv: jnp.sum(w * attention(*qkv, r))  # noqa: E731
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

        for a, b in zip(grads(causal_attention), grads(causal_attention_reference), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_baseline_has_laplaces_parameters_and_muon_matrices(preset):
    """Same parameter tree (every path and shape), count and Muon/AdamW split as Laplace's."""
    gla = get_config(preset)
    att = gla.replace(token_mixer="attention")
    shapes = [
        {p: s.shape for p, s in flatten_dict(abstract_params(c), sep="/").items()}
        for c in (gla, att)
    ]
    assert shapes[0] == shapes[1]
    assert parameter_counts(att) == parameter_counts(gla)
    labels = flatten_dict(optim.param_labels(abstract_params(att)), sep="/")  # by path only
    assert sorted(p for p, lab in labels.items() if lab == "muon") == sorted(
        f"layer_{i}/{m}/kernel" for i in range(att.n_layers) for m in ("qkvg", "out", "w12", "w3")
    )
    # model FLOPs: 6 P + 3 x (full-square q K^T and P V per head and layer)
    T, L, H = att.seq_len, att.n_layers, att.n_heads
    want = 6 * parameter_counts(att)["total_params"] + 3 * L * H * 2 * T * (att.d_k + att.d_v)
    assert training_flops_per_token(att) == want


def test_baseline_model_packs_documents_and_is_causal():
    """The whole model with reset after EOT equals separate runs of each document; a later token
    never changes an earlier logit."""
    params = init_params(BASE, jax.random.key(0))
    model = LaplaceLM(BASE)
    apply = jax.jit(model.apply)
    eot = 7
    docs = [np.arange(10, 31) % 300 + 8, np.arange(5, 48) % 300 + 8]
    packed = np.concatenate([docs[0], [eot], docs[1]])[None].astype(np.int32)
    logits, _ = apply({"params": params}, packed, reset=reset_after_eot(packed, eot))
    first, _ = apply({"params": params}, packed[:, :22])
    second, _ = apply({"params": params}, docs[1][None].astype(np.int32))
    np.testing.assert_allclose(logits[:, :22], first, atol=2e-5)
    np.testing.assert_allclose(logits[:, 22:], second, atol=2e-5)
    changed = packed.copy()
    changed[0, 40:] = 3
    other, _ = apply({"params": params}, changed)
    plain, _ = apply({"params": params}, packed)
    np.testing.assert_array_equal(other[:, :40], plain[:, :40])
    assert not np.allclose(other[:, 40:], plain[:, 40:])


def test_baseline_fsdp_gradient_equals_the_plain_gradient():
    """The trainer's path (explicit FSDP collectives, layer scan, remat) on a 1 x 8 mesh."""
    mesh = make_mesh(8)
    batch = logical_sharding(mesh, EVAL_BATCH_AXES)
    params = jax.device_put(init_params(BASE, jax.random.key(0)), param_shardings(BASE, mesh))
    tokens = np.random.default_rng(1).integers(0, BASE.vocab_size, (8, BASE.seq_len + 1))
    tokens = jax.device_put(jnp.asarray(tokens, jnp.int32), batch)
    model = LaplaceLM(BASE)
    loss_of = lambda p, t: next_token_loss(model, p, t)  # noqa: E731
    ref_loss, ref = jax.jit(jax.value_and_grad(loss_of))(params, tokens)
    fn = make_loss_and_grad(model, mesh, param_specs(BASE, mesh), "layer")
    loss, grads = jax.jit(fn)(params, tokens)
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
    rel = jax.tree.map(
        lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))), grads, ref
    )
    assert max(jax.tree.leaves(rel)) < 1e-5


def test_baseline_greedy_generation_recomputes_the_prefix():
    """Without a state, each token is the argmax of a whole-sequence forward pass: the same as
    running the model on the growing sequence one length at a time, which (the model being
    causal: test_baseline_model_packs_documents_and_is_causal) is one pass over the final
    sequence, each new token the argmax at the position before it."""
    params = init_params(BASE, jax.random.key(3))
    prompt = np.array([[5, 9, 11, 40], [1, 2, 3, 4]], np.int32)
    got = greedy_generate(params, BASE, prompt, 6)
    seq = np.concatenate([prompt, got], 1)
    logits, _ = jax.jit(LaplaceLM(BASE).apply)({"params": params}, seq)
    np.testing.assert_array_equal(got, np.argmax(logits[:, 3:-1], -1))


def test_baseline_refuses_state_decode_and_export():
    params = init_params(BASE, jax.random.key(0))
    model = LaplaceLM(BASE)
    tokens = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="token_mixer='attention'"):
        model.apply({"params": params}, tokens, init_state(BASE, 1))
    with pytest.raises(ValueError, match="token_mixer='attention'"):
        model.apply(
            {"params": params}, tokens[:, 0], init_state(BASE, 1), method=LaplaceLM.decode_step
        )
    with pytest.raises(ExportError, match="token_mixer='attention'"):
        convert(BASE, params)
    with pytest.raises(ConfigError, match="token_mixer must be one of"):
        TINY.replace(token_mixer="mamba")
