"""Ring attention across a context axis (laplace_jax/attention_ring.py, docs/design.md s13.3).

Truths: `causal_attention_reference` (laplace_jax/attention.py: the definition, every score at
once) on one device for the ring's output and gradients; the half each device must hold for the
zig-zag; the gather form (laplace_jax/attention_context.py) for the work and memory the ring
saves: its score FLOPs counted from both programs' jaxprs against `attention_share`'s formula,
and its compiled temporaries as the context axis grows. The whole model on 2, 4 and 8 devices
against one is tests/test_hybrid.py's.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from laplace_jax.accounting import attention_share
from laplace_jax.attention import causal_attention_reference
from laplace_jax.attention_context import attention_context_parallel
from laplace_jax.attention_ring import attention_ring_parallel, from_zigzag, to_zigzag

SLICE = P(None, "context")


def on_context(f, n: int, n_in: int):
    """f inside `shard_map` over a `context` axis of the first n devices, every argument and the
    output split along their second dimension."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("context",))
    return jax.shard_map(f, mesh=mesh, in_specs=(SLICE,) * n_in, out_specs=SLICE, check_vma=False)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_zigzag_gives_device_i_halves_i_and_2n_minus_1_minus_i_and_back(n):
    h = 3
    x = jnp.arange(2 * n * h, dtype=jnp.int32)[None]  # [1, T]: each token its position
    zig = on_context(lambda x: to_zigzag(x, "context"), n, 1)(x)
    want = np.concatenate(
        [np.r_[i * h : (i + 1) * h, (2 * n - 1 - i) * h : (2 * n - i) * h] for i in range(n)]
    )
    np.testing.assert_array_equal(zig[0], want)
    back = on_context(lambda x: from_zigzag(to_zigzag(x, "context"), "context"), n, 1)(x)
    np.testing.assert_array_equal(back, x)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_attention_equals_the_definition_with_its_gradients(n):
    """Slices of 8 tokens (halves of 4, key blocks of 3: the last padded); documents starting
    at a slice's first token, at a half's, one token long, and running across slice edges."""
    rng = np.random.default_rng(n)
    B, T, H, K, V, scale = 2, 8 * n, 2, 4, 3, 0.5
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, H, d)), jnp.float32) for d in (K, K, V))
    reset = np.zeros((B, T), bool)
    reset[0, [4, 8, 9, T - 3]] = True  # a half's start, a slice's, a one-token document
    reset[1, 5] = True  # one document across every later slice edge
    reset = jnp.asarray(reset)
    w = jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32)  # a cotangent

    def ring(q, k, v):
        attend = functools.partial(attention_ring_parallel, axis="context", scale=scale, block=3)
        o = on_context(attend, n, 4)(q, k, v, reset)
        return jnp.sum(o * w), o

    def definition(q, k, v):
        o = causal_attention_reference(q, k, v, reset, scale)
        return jnp.sum(o * w), o

    (_, o), grads = jax.jit(jax.value_and_grad(ring, (0, 1, 2), has_aux=True))(q, k, v)
    (_, o_ref), grads_ref = jax.value_and_grad(definition, (0, 1, 2), has_aux=True)(q, k, v)
    np.testing.assert_allclose(o, o_ref, atol=1e-6)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(g, g_ref, atol=1e-5)


def dot_flops(jaxpr, times: int = 1) -> int:
    """FLOPs of every dot_general in a jaxpr and the jaxprs inside it, each scan's body counted
    `length` times."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += times * 2 * math.prod(out) * math.prod(lhs[d] for d in contract)
        repeat = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
                if hasattr(sub, "eqns"):
                    total += dot_flops(sub, times * repeat)
    return total


@pytest.mark.parametrize("n", [4, 8])
def test_the_ring_scores_the_causal_share_of_the_square(n):
    """The forward's score and output matmuls, counted from the traced programs (scan bodies
    times their trip counts): the ring's are `attention_share("ring", n)` = (2n + 1) / (4n) of
    the gather form's whole square, exactly (key blocks of a half, so no padding). With the
    equality test above (a wrong pair leaves a key out), no device scores a wholly future pair:
    this count leaves no room for one."""
    B, h, H, K, V = 1, 8, 2, 4, 4
    T = 2 * n * h
    q, k, v = (jax.ShapeDtypeStruct((B, T, H, d), jnp.float32) for d in (K, K, V))
    reset = jax.ShapeDtypeStruct((B, T), jnp.bool_)

    def flops(form, block):
        f = functools.partial(form, axis="context", scale=0.5, block=block)
        return dot_flops(jax.make_jaxpr(on_context(f, n, 4))(q, k, v, reset))

    ring, gather = flops(attention_ring_parallel, h), flops(attention_context_parallel, h)
    assert ring == attention_share("ring", n) * gather
    assert ring < 0.6 * gather


def test_the_rings_memory_does_not_grow_with_the_context_axis():
    """Slices of 1,024 tokens, forward and backward under remat: going from 4 to 8 devices (2x
    the sequence) the ring's compiled temporaries grow by under a tenth of one slice's keys and
    values (measured: not at all), while the gather form's grow by more than 4 slices' (it holds
    every slice's, and their gradients: measured 8.1)."""
    L, H, K, V = 1_024, 2, 16, 32

    def temporaries(form, n):
        q, k, v = (jax.ShapeDtypeStruct((1, n * L, H, d), jnp.float32) for d in (K, K, V))
        reset = jax.ShapeDtypeStruct((1, n * L), jnp.bool_)

        @jax.checkpoint
        def loss(q, k, v, r):
            f = functools.partial(form, axis="context", scale=0.25, block=128)
            return on_context(f, n, 4)(q, k, v, r).sum()

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return grad.lower(q, k, v, reset).compile().memory_analysis().temp_size_in_bytes

    slice_kv = L * H * (K + V) * 4
    ring = temporaries(attention_ring_parallel, 8) - temporaries(attention_ring_parallel, 4)
    gather = temporaries(attention_context_parallel, 8) - temporaries(attention_context_parallel, 4)
    assert ring < slice_kv / 10 < 4 * slice_kv < gather


def test_an_odd_slice_is_refused_with_the_fix():
    f = functools.partial(attention_ring_parallel, axis="context", scale=0.5)
    x = jnp.zeros((1, 18, 1, 2), jnp.float32)
    with pytest.raises(ValueError, match=r"slices of 9 tokens \(seq_len 18 over context=2\)"):
        on_context(f, 2, 4)(x, x, x, jnp.zeros((1, 18), bool))


def test_an_odd_slice_is_a_config_error_unless_the_run_needs_no_ring():
    """`train.main`'s batch layout refuses slices of an odd length for a hybrid's ring (one
    line, exit 2), and takes them for the gather form and for pure Laplace."""
    from laplace_spec.config import ConfigError
    from train.config import TrainConfig, batch_layout

    ring, gather = (
        TrainConfig(global_batch_tokens=640),
        TrainConfig(global_batch_tokens=640, attention_context="gather"),
    )
    with pytest.raises(ConfigError, match=r"slices of 5 tokens .* attention_context=gather"):
        batch_layout(ring, 80, 16, context=16, attention=True)
    assert batch_layout(gather, 80, 16, context=16, attention=True) == (8, 1, 8)
    assert batch_layout(ring, 80, 16, context=16) == (8, 1, 8)  # no attention layer


LENGTHS = ("32k", "128k", "1m")  # bench.plan's hybrid rows on a context axis


def test_the_default_form_is_the_one_the_committed_plan_measured():
    """laplace_jax/model.py's ATTENTION_CONTEXT is bench/results/plan.json's
    `attention_context_default` (the ring when its 3B hybrid step is no larger than the gather
    form's at 32k, 128k and 1M tokens, else the gather form), and that plan's ring fits the 1M
    step in 16 GiB."""
    import json
    from pathlib import Path

    from laplace_jax.model import ATTENTION_CONTEXT

    plan = Path(__file__).resolve().parents[1] / "bench" / "results" / "plan.json"
    headline = json.loads(plan.read_text())["headline"]
    default = headline["attention_context_default"]
    other = "gather" if default == "ring" else "ring"
    assert ATTENTION_CONTEXT == default
    gib = {  # form -> the step's GiB per device at each length
        form: [headline[f"train_step_gib_per_device_hybrid4_{row}{suffix}"] for row in LENGTHS]
        for form, suffix in ((default, ""), (other, f"_{other}"))
    }
    ring_no_larger = all(r <= g for r, g in zip(gib["ring"], gib["gather"], strict=True))
    assert default == ("ring" if ring_no_larger else "gather")
    assert gib["ring"][-1] <= 16  # 1M tokens


def test_the_ring_in_bf16_is_as_close_to_the_definition_as_the_gather_form():
    """bf16 q, k, v (the 3B compute dtype) on 4 devices: the ring's output and gradients (dK,
    dV summed in fp32 on their way round, rounded to bf16 once) are within bf16 rounding of
    the fp32 definition on the same rounded inputs, and no further from it than the gather
    form's (within 1.5x: the two round in different places)."""
    n, B, T, H, K, V = 4, 2, 64, 2, 8, 8
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, H, d)), jnp.bfloat16) for d in (K, K, V))
    reset = jnp.asarray(rng.random((B, T)) < 0.05)
    w = jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32)

    def loss(form):
        attend = functools.partial(form, axis="context", scale=K**-0.5, block=4)
        return lambda q, k, v: jnp.sum(on_context(attend, n, 4)(q, k, v, reset) * w)

    def definition(q, k, v):
        o = causal_attention_reference(q, k, v, reset, K**-0.5)
        return jnp.sum(o * w)

    f32_inputs = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.grad(definition, (0, 1, 2))(*f32_inputs)

    def errors(form):  # each gradient's largest error over its largest entry
        got = jax.jit(jax.grad(loss(form), (0, 1, 2)))(q, k, v)
        assert [g.dtype for g in got] == [jnp.bfloat16] * 3
        return [
            float(jnp.abs(g.astype(jnp.float32) - e).max() / jnp.abs(e).max())
            for g, e in zip(got, want, strict=True)
        ]

    ring, gather = errors(attention_ring_parallel), errors(attention_context_parallel)
    assert max(ring) < 1e-2
    for r, g in zip(ring, gather, strict=True):
        assert r <= 1.5 * g + 1e-3
