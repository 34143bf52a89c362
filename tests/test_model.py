"""The Flax model against a float64 NumPy transcription of docs/design.md section 2; invariants."""

import math
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from laplace_jax.accounting import parameter_counts
from laplace_jax.model import (
    LaplaceLM,
    abstract_params,
    init_params,
    init_state,
)
from laplace_spec.config import PRESETS
from laplace_spec.param_groups import PARAM_GROUPS, is_muon_path, param_group, table_key

TINY = PRESETS["tiny"]


def test_param_groups_table_is_the_documented_contract():
    """laplace_spec/param_groups.py against docs/parameters.md: one row per documented path, the
    documented optimizer; every parameter of the model has a row and every row is used."""
    doc = (Path(__file__).parents[1] / "docs" / "parameters.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \|.*\| (Muon|AdamW) \|$", doc, re.M)
    documented = {table_key(p.replace("{i}", "0")): opt.lower() for p, opt in rows}
    assert documented == {k: g.optimizer for k, g in PARAM_GROUPS.items()}
    shapes = flatten_dict(abstract_params(PRESETS["laplace-3b"]), sep="/")
    # the rows only a hybrid's optional forms use (design s13.5)
    forms = PRESETS["tiny"].replace(
        attention_every=2, gla_branch="post_norm", attention_input="stream_and_embedding"
    )
    optional = {table_key(p) for p in flatten_dict(abstract_params(forms), sep="/")}
    assert optional - {table_key(p) for p in shapes} == {"layer/branch/gain", "layer/ln_0/scale"}
    assert {table_key(p) for p in shapes} | optional == set(PARAM_GROUPS)
    assert sum(param_group(p).optimizer == "muon" for p in shapes) == 96
    with pytest.raises(KeyError, match="layer_0/nope"):
        param_group("layer_0/nope")


def randomised_params(cfg, seed=0):
    """Initial params with the zero/one-initialised vectors made random, so every term counts."""
    params = init_params(cfg, jax.random.key(seed))
    rng = np.random.default_rng(seed)

    def perturb(path, x):
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        if name.endswith(("aug_balance", "bias", "ln_1/scale", "ln_2/scale", "head_norm/scale")):
            return jnp.asarray(rng.normal(1.0 if "scale" in name else 0.0, 0.3, x.shape), x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(perturb, params)


# ---- an independent transcription of docs/design.md section 2, float64, token by token ----------


def numpy_forward(p, cfg, tokens):
    p = {k: np.asarray(v, np.float64) for k, v in flatten_dict(p, sep="/").items()}
    H, dk, dv, W, eps = cfg.n_heads, cfg.d_k, cfg.d_v, cfg.conv_width, cfg.norm_eps
    lam = 2.0 ** (-1.0 / (cfg.t_min * (cfg.t_max / cfg.t_min) ** (np.arange(H) / (H - 1))))
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    sigmoid = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731

    def layernorm(x, scale):
        return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * scale

    x = p["embed/embedding"][tokens]  # [B, T, D]
    B, T, D = x.shape
    for layer in range(cfg.n_layers):
        w = {k.split("/", 1)[1]: v for k, v in p.items() if k.startswith(f"layer_{layer}/")}
        h = layernorm(x, w["ln_1/scale"])
        hp = np.concatenate([np.zeros((B, W - 1, D)), h], 1)  # h_{t<0} = 0
        conv = w["conv/kernel"]  # [D, W]
        u = silu(w["conv/bias"] + sum(conv[:, j] * hp[:, j : j + T] for j in range(W)))
        qkvg = u @ w["qkvg/kernel"]
        q = qkvg[..., : H * dk].reshape(B, T, H, dk)
        k = qkvg[..., H * dk : 2 * H * dk].reshape(B, T, H, dk)
        v = qkvg[..., 2 * H * dk : 2 * H * dk + H * dv].reshape(B, T, H, dv)
        g = qkvg[..., 2 * H * dk + H * dv :]
        S = np.zeros((B, H, dk, dv))
        o = np.zeros((B, T, H, dv))
        for t in range(T):
            S = lam[None, :, None, None] * S + np.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
            o[:, t] = np.einsum("bhk,bhkv->bhv", dk**-0.5 * q[:, t], S)
        o += sigmoid(np.einsum("bthk,hk,bthk->bth", q, w["aug_balance"], k))[..., None] * v
        gamma = np.repeat(w["head_norm/scale"], H // cfg.n_tiers, axis=0)  # [H, dv]
        o = o / np.sqrt((o**2).mean(-1, keepdims=True) + eps) * gamma
        x = x + (o.reshape(B, T, H * dv) * silu(g)) @ w["out/kernel"]
        h2 = layernorm(x, w["ln_2/scale"])
        a12 = h2 @ w["w12/kernel"]
        F = cfg.ffn_dim
        x = x + (silu(a12[..., :F]) * a12[..., F:]) @ w["w3/kernel"]
    return layernorm(x, p["ln_f/scale"]) @ p["lm_head/kernel"]


def test_forward_matches_numpy_transcription_of_the_design():
    params = randomised_params(TINY)
    tokens = np.random.default_rng(1).integers(0, TINY.vocab_size, (2, 37))
    logits, _ = jax.jit(LaplaceLM(TINY).apply)({"params": params}, jnp.asarray(tokens))
    ref = numpy_forward(params, TINY, tokens)
    err = np.abs(np.asarray(logits, np.float64) - ref).max() / np.abs(ref).max()
    assert err <= 1e-5


def test_full_forward_equals_prefill_plus_decode():
    params = randomised_params(TINY, seed=2)
    model = LaplaceLM(TINY)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, TINY.vocab_size, (3, 45)))
    full, full_state = jax.jit(model.apply)({"params": params}, tokens)

    prefill = jax.jit(model.apply)
    decode = jax.jit(lambda p, t, s: model.apply(p, t, s, method=LaplaceLM.decode_step))
    logits, state = prefill({"params": params}, tokens[:, :20])
    outs = [logits]
    for t in range(20, 45):
        step_logits, state = decode({"params": params}, tokens[:, t], state)
        outs.append(step_logits[:, None])
    stitched = jnp.concatenate(outs, 1)
    scale = float(jnp.abs(full).max())
    assert float(jnp.abs(stitched - full).max()) <= 1e-5 * scale
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(full_state), strict=True):
        assert float(jnp.abs(a - b).max()) <= 1e-5 * float(jnp.abs(b).max())


def test_prefill_in_pieces_carries_state_and_conv_window():
    params = randomised_params(TINY, seed=3)
    apply = jax.jit(LaplaceLM(TINY).apply)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, TINY.vocab_size, (2, 40)))
    full, _ = apply({"params": params}, tokens)
    a, state = apply({"params": params}, tokens[:, :2])  # shorter than the conv window
    b, state = apply({"params": params}, tokens[:, 2:23], state)
    c, _ = apply({"params": params}, tokens[:, 23:], state)
    stitched = jnp.concatenate([a, b, c], 1)
    assert float(jnp.abs(stitched - full).max()) <= 1e-5 * float(jnp.abs(full).max())


def test_causality():
    params = randomised_params(TINY, seed=4)
    apply = jax.jit(LaplaceLM(TINY).apply)
    tokens = np.random.default_rng(4).integers(0, TINY.vocab_size, (1, 40))
    changed = tokens.copy()
    changed[0, 25] = (changed[0, 25] + 1) % TINY.vocab_size
    a, _ = apply({"params": params}, jnp.asarray(tokens))
    b, _ = apply({"params": params}, jnp.asarray(changed))
    np.testing.assert_array_equal(a[:, :25], b[:, :25])
    assert float(jnp.abs(a[:, 25] - b[:, 25]).max()) > 0


def test_aug_balance_zero_is_a_half_strength_value_skip():
    """With a = 0 the gate is sigmoid(0) = 1/2 whatever q and k: o_t = GLA_t + v_t / 2.

    Checked in the model itself: zeroing the key columns of W_qkvg makes the GLA term vanish, so
    the mixer's output is RMSNorm(v / 2) = RMSNorm(v); doubling the key columns' effect through
    a changes nothing while a = 0, and changes the output as soon as a != 0."""
    cfg = TINY
    params = init_params(cfg, jax.random.key(5))
    assert all(np.all(params[f"layer_{i}"]["aug_balance"] == 0) for i in range(cfg.n_layers))
    H, dk = cfg.n_heads, cfg.d_k
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 16)))
    apply = jax.jit(LaplaceLM(cfg).apply)

    def with_keys_scaled(params, factor, a):
        p = jax.tree.map(lambda x: x, params)
        for i in range(cfg.n_layers):
            kern = p[f"layer_{i}"]["qkvg"]["kernel"]
            kern = kern.at[:, H * dk : 2 * H * dk].multiply(factor)
            p[f"layer_{i}"]["qkvg"]["kernel"] = kern
            p[f"layer_{i}"]["aug_balance"] = jnp.full((H, dk), a, jnp.float32)
        return p

    # the gate is sigmoid(q . a k): with a = 0 it is 1/2, independent of the keys' scale...
    base, _ = apply({"params": with_keys_scaled(params, 0.0, 0.0)}, tokens)
    numpy_half = numpy_forward(with_keys_scaled(params, 0.0, 0.0), cfg, np.asarray(tokens))
    np.testing.assert_allclose(base, numpy_half, rtol=1e-4, atol=1e-5)
    # ...and with a != 0 but k = 0 the gate is still 1/2: the same output exactly
    same, _ = apply({"params": with_keys_scaled(params, 0.0, 3.0)}, tokens)
    np.testing.assert_allclose(same, base, rtol=1e-6, atol=1e-6)
    # with live keys, a moves the gate away from 1/2 and changes the output
    live0, _ = apply({"params": with_keys_scaled(params, 1.0, 0.0)}, tokens)
    live3, _ = apply({"params": with_keys_scaled(params, 1.0, 3.0)}, tokens)
    assert float(jnp.abs(live3 - live0).max()) > 1e-3


def test_residual_projections_start_at_the_design_scale():
    """W_out and W_3 start at std fan_in ** -0.5 / sqrt(2 L) (docs/design.md s2.2), except a GLA
    layer's W_out under the post-norm, at fan_in ** -0.5 (s13.5: the norm sets that branch's
    size); measured on the initialised kernels of a 3:1 hybrid with the post-norm."""
    cfg = PRESETS["tiny"].replace(n_layers=4, attention_every=4, gla_branch="post_norm")
    residual = 1 / math.sqrt(2 * cfg.n_layers)
    params = init_params(cfg, jax.random.key(3))
    for i, mixer in enumerate(cfg.layer_mixers):
        layer = params[f"layer_{i}"]
        out = (1.0 if mixer == "gla" else residual) * (cfg.n_heads * cfg.d_v) ** -0.5
        assert np.std(layer["out"]["kernel"]) == pytest.approx(out, rel=0.05), (i, mixer)
        w3 = residual * cfg.ffn_dim**-0.5
        assert np.std(layer["w3"]["kernel"]) == pytest.approx(w3, rel=0.05), (i, mixer)


def test_decay_schedule():
    gamma = np.asarray(PRESETS["laplace-3b"].log_decay(), np.float32)
    lam = np.exp(gamma.astype(np.float64))
    assert gamma.shape == (16,) and np.all(gamma < 0)
    np.testing.assert_allclose(lam[0], 0.5, rtol=1e-6)
    np.testing.assert_allclose(lam[15], 2 ** (-1 / 2048), rtol=1e-6)
    assert round(lam[15], 5) == 0.99966
    half_lives = -math.log(2) / gamma.astype(np.float64)
    np.testing.assert_allclose(half_lives[0], 1.0, rtol=1e-6)
    np.testing.assert_allclose(half_lives[-1], 2048.0, rtol=1e-5)
    ratios = half_lives[1:] / half_lives[:-1]  # geometric in half-life
    np.testing.assert_allclose(ratios, 2048 ** (1 / 15), rtol=1e-5)


def test_laplace_3b_counts_without_allocating():
    counts = parameter_counts(PRESETS["laplace-3b"])
    assert counts == {
        "muon_matrices": 96,
        "muon_params": 2_717_908_992,
        "adamw_params": 309_642_240,
        "total_params": 3_027_551_232,
    }
    shapes = flatten_dict(abstract_params(PRESETS["laplace-3b"]), sep="/")
    assert shapes["embed/embedding"].shape == (50_304, 3_072)
    assert shapes["lm_head/kernel"].shape == (3_072, 50_304)
    assert shapes["layer_0/qkvg/kernel"].shape == (3_072, 9_216)
    assert not is_muon_path("embed/embedding") and not is_muon_path("lm_head/kernel")
    assert sorted({p.split("/")[1] for p in shapes if is_muon_path(p)}) == [
        "out",
        "qkvg",
        "w12",
        "w3",
    ]


def test_state_bytes():
    cfg = PRESETS["laplace-3b"]
    assert cfg.state_bytes_per_sequence() == {
        "gla": 28_311_552,
        "conv": 1_179_648,
        "total": 29_491_200,
    }
    assert cfg.state_bytes_per_sequence(conv_window=3)["total"] == 29_196_288
    assert cfg.page_bytes_per_sequence() == 29_196_288  # vLLM's pages: the W - 1 window
    # the state the model actually allocates has exactly the computed size
    abstract = jax.eval_shape(lambda: init_state(cfg, 1))
    assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract)) == 29_491_200


def test_info_cli_prints_the_figures():
    out = subprocess.run(
        [sys.executable, "-m", "laplace_jax.info", "--config", "laplace-3b"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for figure in (
        "2,717,908,992",
        "309,642,240",
        "3,027,551,232",
        "29,491,200",
        "29,196,288",
        "2,415,919,104",
        "81.9x",
    ):
        assert figure in out, figure


def test_rbg_prng_initialises_and_runs():
    params = init_params(TINY, jax.random.key(0, impl="rbg"))
    logits, _ = LaplaceLM(TINY).apply({"params": params}, jnp.zeros((1, 8), jnp.int32))
    assert np.all(np.isfinite(logits))


def test_jit_on_8_simulated_devices_matches_one_device():
    from laplace_jax.sharding import logical_sharding, make_mesh, param_shardings

    assert jax.device_count() >= 8, "tests/conftest.py sets 8 host devices"
    mesh = make_mesh(8)
    params = randomised_params(TINY, seed=6)
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, TINY.vocab_size, (8, 32)))
    shardings = param_shardings(TINY, mesh)
    sharded = jax.device_put(params, shardings)
    assert sharded["layer_0"]["w12"]["kernel"].sharding.spec[0] == "fsdp"
    batch_sharding = logical_sharding(mesh, ("batch", "length"))
    assert tuple(batch_sharding.spec) == ("fsdp", None)
    forward = jax.jit(
        lambda p, t: LaplaceLM(TINY).apply({"params": p}, t)[0],
        in_shardings=(shardings, batch_sharding),
    )
    logits = forward(sharded, jax.device_put(tokens, batch_sharding))
    single, _ = jax.jit(LaplaceLM(TINY).apply)({"params": params}, tokens)
    np.testing.assert_allclose(logits, single, rtol=1e-5, atol=1e-5)


def test_bfloat16_compute_runs_close_to_fp32():
    params = randomised_params(TINY, seed=7)
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, TINY.vocab_size, (2, 32)))
    f32, _ = LaplaceLM(TINY).apply({"params": params}, tokens)
    b16, _ = LaplaceLM(TINY.replace(compute_dtype="bfloat16")).apply({"params": params}, tokens)
    assert b16.dtype == jnp.float32  # logits are returned in fp32
    assert float(jnp.abs(b16 - f32).max()) <= 0.1 * float(jnp.abs(f32).max())


def test_axes_that_do_not_divide_are_replicated_and_listed():
    """On 3 devices tiny's 64-wide axes cannot be split: those matrices stay whole, and
    `replicated_fallbacks` names each of them (the trainer prints the list at start-up)."""
    from laplace_jax.sharding import make_mesh, param_specs, replicated_fallbacks

    assert replicated_fallbacks(TINY, make_mesh(8)) == []
    mesh = make_mesh(3)
    specs = flatten_dict(param_specs(TINY, mesh), sep="/")
    listed = {line.split(" ")[0] for line in replicated_fallbacks(TINY, mesh)}
    # every matrix asks for fsdp (no axis of 64, 128, 320 divides by 3); the 1-D parameters,
    # aug_balance (heads, head_k) and the head-norm scales (tiers, head_v) never ask for it
    matrices = {
        p
        for p, s in specs.items()
        if len(s) == 2 and not p.endswith(("aug_balance", "head_norm/scale"))
    }
    assert listed == matrices
    assert all(tuple(specs[p]) == (None, None) for p in listed)
    assert "layer_0/w12/kernel [64, 256]: [64, 256] on fsdp=3" in replicated_fallbacks(TINY, mesh)
