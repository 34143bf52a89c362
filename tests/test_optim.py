"""The Laplace optimizer: Muon/AdamW split by path, the shared schedule, AdamW vs NumPy."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.traverse_util import flatten_dict

from laplace_jax.model import abstract_params, init_params
from laplace_jax.optim import (
    OPTIMIZER_PRESETS,
    OptimizerConfig,
    learning_rate_schedule,
    make_optimizer,
    muon_plan,
    param_labels,
)
from laplace_spec.config import PRESETS


def test_presets_match_model_presets_and_3b_recipe():
    assert set(OPTIMIZER_PRESETS) == set(PRESETS)
    cfg = OPTIMIZER_PRESETS["laplace-3b"]
    assert cfg == OptimizerConfig()
    assert (cfg.warmup_steps, cfg.total_steps, cfg.muon_momentum, cfg.ns_steps) == (
        3_815,
        190_735,
        0.95,
        5,
    )
    assert (cfg.ns_dtype, cfg.shape_factor, cfg.muon_mode, cfg.nesterov) == (
        "bfloat16",
        "adamw_rms",
        "a2a",
        True,
    )


def test_config_validation_and_overrides():
    cfg = OptimizerConfig().with_overrides(["lr=1e-3", "nesterov=false", "muon_mode=gather"])
    assert (cfg.lr, cfg.nesterov, cfg.muon_mode) == (1e-3, False, "gather")
    with pytest.raises(ValueError):
        OptimizerConfig().with_overrides(["momentum=0.9"])  # unknown key
    for bad in (
        {"muon_mode": "ring"},
        {"ns_dtype": "float16"},
        {"shape_factor": "none"},
        {"warmup_steps": 10, "total_steps": 5},
        {"muon_momentum": 1.0},
    ):
        with pytest.raises(ValueError):
            OptimizerConfig(**bad)


def test_muon_adamw_split_for_3b_is_exact():
    """By path, not ndim: 96 matrices / 2,717,908,992 vs 309,642,240 (docs/design.md s2)."""
    shapes = flatten_dict(abstract_params(PRESETS["laplace-3b"]), sep="/")
    labels = flatten_dict(param_labels(abstract_params(PRESETS["laplace-3b"])), sep="/")
    muon = [p for p, lab in labels.items() if lab == "muon"]
    n_muon = sum(math.prod(shapes[p].shape) for p in muon)
    n_adamw = sum(math.prod(s.shape) for p, s in shapes.items() if labels[p] == "adamw")
    assert (len(muon), n_muon, n_adamw) == (96, 2_717_908_992, 309_642_240)
    assert labels["embed/embedding"] == labels["lm_head/kernel"] == "adamw"  # 2-D, yet AdamW
    assert {p.split("/")[1] for p in muon} == {"qkvg", "out", "w12", "w3"}
    plan = muon_plan(OptimizerConfig(), abstract_params(PRESETS["laplace-3b"]))
    assert plan.mode == "single" and len(plan.shapes) == 96  # no mesh: single


def test_schedule_warmup_then_cosine_against_numpy():
    cfg = OptimizerConfig(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    sched = jax.jit(learning_rate_schedule(cfg))

    def ref(t):
        if t < 10:
            return (t + 1) / 10
        frac = min(1.0, (t - 10) / 100)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * frac))

    for t in [0, 4, 9, 10, 35, 60, 109, 110, 500]:
        assert abs(float(sched(t)) - ref(t)) < 1e-6, t
    assert abs(float(sched(9)) - 1.0) < 1e-7 and abs(float(sched(10)) - 1.0) < 1e-7
    assert abs(float(sched(60)) - 0.55) < 1e-6 and abs(float(sched(10_000)) - 0.1) < 1e-7


def _np_adamw(p, grads, lrs, b1, b2, eps, wd, decay):
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        upd = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        p = p - lrs[t - 1] * (upd + (wd * p if decay else 0.0))
    return p


def test_adamw_half_matches_numpy_with_lr_ratio_and_decay_mask():
    """Embedding (decayed) and a LayerNorm scale (not decayed) over three steps, AdamW at
    adamw_lr_ratio x the shared schedule; fp32 vs float64: 1e-6 absolute on O(1) entries."""
    cfg = OptimizerConfig(
        lr=0.05,
        adamw_lr_ratio=0.3,
        warmup_steps=2,
        total_steps=10,
        weight_decay=0.2,
        muon_mode="single",
        ns_dtype="float32",
    )
    params = init_params(PRESETS["tiny"], jax.random.key(0, impl="rbg"))
    rng = np.random.default_rng(0)
    grads = [
        jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), params)
        for _ in range(3)
    ]
    tx = make_optimizer(cfg, params)
    state = tx.init(params)
    p = params
    for g in grads:
        upd, state = jax.jit(tx.update)(g, state, p)
        p = optax.apply_updates(p, upd)
    sched = learning_rate_schedule(cfg)
    lrs = [0.3 * float(sched(t)) for t in range(3)]
    got, p0 = flatten_dict(p, sep="/"), flatten_dict(params, sep="/")
    for path, decay in (
        ("embed/embedding", True),
        ("layer_0/ln_1/scale", False),
        ("layer_1/aug_balance", False),
        ("lm_head/kernel", True),
    ):
        ref = _np_adamw(
            np.asarray(p0[path], np.float64),
            [np.asarray(flatten_dict(g, sep="/")[path], np.float64) for g in grads],
            lrs,
            cfg.adam_b1,
            cfg.adam_b2,
            cfg.adam_eps,
            cfg.weight_decay,
            decay,
        )
        np.testing.assert_allclose(got[path], ref, atol=1e-6, err_msg=path)


def test_lr_ratio_scales_only_adamw():
    params = init_params(PRESETS["tiny"], jax.random.key(1, impl="rbg"))
    grads = jax.tree.map(lambda x: jnp.ones_like(x) * 0.01, params)
    out = {}
    for ratio in (1.0, 0.25):
        cfg = OPTIMIZER_PRESETS["tiny"].replace(adamw_lr_ratio=ratio, weight_decay=0.0)
        tx = make_optimizer(cfg, params)
        out[ratio] = flatten_dict(jax.jit(tx.update)(grads, tx.init(params), params)[0], sep="/")
    labels = flatten_dict(param_labels(params), sep="/")
    for path, lab in labels.items():
        if lab == "muon":
            assert np.array_equal(out[1.0][path], out[0.25][path]), path
        else:
            np.testing.assert_allclose(out[0.25][path], 0.25 * out[1.0][path], rtol=1e-6)


def test_abstract_params_suffice():
    """make_optimizer on ShapeDtypeStructs: init traces without allocating."""
    abstract = abstract_params(PRESETS["small"])
    tx = make_optimizer(OPTIMIZER_PRESETS["small"], abstract)
    state = jax.eval_shape(tx.init, abstract)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
