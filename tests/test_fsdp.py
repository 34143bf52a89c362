"""FSDP with explicit collectives (laplace_jax/fsdp.py) against the plain model's gradient.

The truth is `jax.value_and_grad` of the model's own loss (`laplace_jax.loss.next_token_loss`
through the model's own layer loop) on one device, whole parameters: the explicit per-layer gathers,
fp32 reduce-scatters, layer scan and rematerialisation must change where bytes live, never the
loss or the gradient.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax.fsdp import REMAT_POLICIES, make_loss_and_grad, split_dim
from laplace_jax.loss import next_token_loss
from laplace_jax.model import LaplaceLM, init_params
from laplace_jax.sharding import (
    FSDP,
    logical_sharding,
    make_mesh,
    param_shardings,
    param_specs,
)
from laplace_spec.config import get_config
from train.step import EVAL_BATCH_AXES

TINY = get_config("tiny")


def _host_inputs(cfg):
    """The parameters and 8 token sequences, on one device."""
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (8, cfg.seq_len + 1)), jnp.int32)
    return init_params(cfg, jax.random.key(0)), tokens


def _setup(cfg, data):
    mesh = make_mesh(8, data=data)
    batch = logical_sharding(mesh, EVAL_BATCH_AXES)
    params, tokens = _host_inputs(cfg)
    params = jax.device_put(params, param_shardings(cfg, mesh))
    return mesh, batch, params, jax.device_put(tokens, batch)


def _plain_value_and_grad(cfg):
    """The truth: the plain model's loss and gradient on one device, whole parameters."""
    params, tokens = _host_inputs(cfg)
    model = LaplaceLM(cfg)
    return jax.jit(jax.value_and_grad(lambda p, t: next_token_loss(model, p, t)))(params, tokens)


@pytest.fixture(scope="module")
def fp32_reference():
    return _plain_value_and_grad(TINY)


def _max_rel(a, b):
    """Largest |a - b| / max|b| over the leaves of two gradient trees."""
    rel = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y))), a, b)
    return max(jax.tree.leaves(rel))


@pytest.mark.parametrize("data", [1, 2])
@pytest.mark.parametrize("remat", sorted(REMAT_POLICIES))
def test_explicit_fsdp_equals_the_plain_gradient_in_fp32(data, remat, fp32_reference):
    """1 x 8 and 2 x 4 meshes, every remat policy: the same loss (1e-6) and gradients (1e-5 of
    each leaf's largest entry; only summation order differs) as the plain model's."""
    mesh, batch, params, tokens = _setup(TINY, data)
    model = LaplaceLM(TINY)
    ref_loss, ref_grads = fp32_reference
    fn = make_loss_and_grad(model, mesh, param_specs(TINY, mesh), remat)
    loss, grads = jax.jit(fn)(params, tokens)
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
    assert _max_rel(grads, ref_grads) < 1e-5
    # the gradients come back sharded like the parameters
    shardings = param_shardings(TINY, mesh)
    for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(shardings), strict=True):
        assert g.sharding.is_equivalent_to(s, g.ndim)


def test_bf16_compute_matches_the_plain_bf16_model_and_stays_close_to_fp32(fp32_reference):
    """bf16 compute (weights gathered in bf16, gradients reduced in fp32), remat per layer:
    against the plain model in bf16, the loss within 1e-4 and every gradient leaf within 5% of
    its largest entry (bf16 rounds in different places); against fp32, the loss within 1% and
    the whole gradient's direction (cosine) above 0.99."""
    mesh, batch, params, tokens = _setup(TINY, 1)
    bf16 = TINY.replace(compute_dtype="bfloat16")
    fn = make_loss_and_grad(LaplaceLM(bf16), mesh, param_specs(bf16, mesh), "layer")
    loss, grads = jax.jit(fn)(params, tokens)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    references = {bf16: _plain_value_and_grad(bf16), TINY: fp32_reference}
    for cfg, loss_tol in ((bf16, 1e-4), (TINY, 1e-2)):
        ref_loss, ref_grads = references[cfg]
        assert abs(float(loss) - float(ref_loss)) <= loss_tol * float(ref_loss), cfg
        if cfg is bf16:
            assert _max_rel(grads, ref_grads) < 0.05
        else:
            flat = lambda t: jnp.concatenate([x.ravel() for x in jax.tree.leaves(t)])  # noqa: E731
            a, b = flat(grads), flat(ref_grads)
            assert float(a @ b / (jnp.linalg.norm(a) * jnp.linalg.norm(b))) > 0.99


def test_split_dim_reads_the_partition_spec():
    from jax.sharding import PartitionSpec as P

    assert split_dim(P(FSDP, None)) == (0, FSDP)
    assert split_dim(P(None, FSDP)) == (1, FSDP)
    assert split_dim(P((FSDP, "context"), None)) == (0, (FSDP, "context"))
    assert split_dim(P(None)) == (None, None) and split_dim(P()) == (None, None)


def test_unknown_remat_policy_is_named():
    mesh, batch, _, _ = _setup(TINY, 1)
    with pytest.raises(ValueError, match="remat must be one of"):
        make_loss_and_grad(LaplaceLM(TINY), mesh, param_specs(TINY, mesh), "all")
