"""Muon: Newton-Schulz, the optax transform against a float64 NumPy Muon, and the distributed
`gather` / `a2a` forms on 8 simulated devices (tests/conftest.py) against the single-device one.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.traverse_util import flatten_dict
from jax.sharding import NamedSharding, PartitionSpec

from laplace_jax import muon
from laplace_jax.model import abstract_params, init_params
from laplace_jax.muon_accounting import a2a_bytes_per_device, gather_bytes_per_device, ns_flops
from laplace_jax.muon_tiles import plan_tiles
from laplace_jax.newton_schulz import (
    NS_DTYPES,
    newton_schulz,
    newton_schulz_tiled,
    tile_widths,
)
from laplace_jax.optim import OPTIMIZER_PRESETS, make_optimizer, opt_state_shardings
from laplace_jax.sharding import FSDP, make_mesh, param_shardings
from laplace_spec.config import PRESETS
from laplace_spec.param_groups import is_muon_path

A, B, C = 3.4445, -4.7750, 2.0315


# ---- an independent float64 NumPy Muon (the definition of docs/design.md s4) -----------------


def np_newton_schulz(g: np.ndarray, steps: int = 5, eps: float = 1e-7) -> np.ndarray:
    x = np.asarray(g, np.float64)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (np.linalg.norm(x) + eps)
    for _ in range(steps):
        a = x @ x.T
        x = A * x + (B * a + C * a @ a) @ x
    return x.T if tall else x


def np_shape_factor(kernel_shape, kind):
    fan_in, fan_out = kernel_shape  # W = kernel^T has rows = fan_out
    if kind == "max_ratio":
        return math.sqrt(max(1.0, fan_out / fan_in))
    return 0.2 * math.sqrt(max(fan_in, fan_out))


def np_muon(params, grads_per_step, lr, mu=0.95, wd=0.0, kind="adamw_rms", nesterov=True):
    """params, grads: dict path -> array; lr: step -> float. Returns params after every step."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    history = []
    for t, grads in enumerate(grads_per_step):
        for k, g in grads.items():
            g = np.asarray(g, np.float64)
            m[k] = mu * m[k] + g
            d = g + mu * m[k] if nesterov else m[k]
            o = np_newton_schulz(d) * np_shape_factor(p[k].shape, kind)
            p[k] = p[k] - lr(t) * (o + wd * p[k])
        history.append({k: v.copy() for k, v in p.items()})
    return history


def _tiny_muon_shapes():
    shapes = flatten_dict(abstract_params(PRESETS["tiny"]), sep="/")
    return {p: tuple(s.shape) for p, s in shapes.items() if is_muon_path(p)}


def _random(shapes, seed):
    rng = np.random.default_rng(seed)
    return {p: rng.standard_normal(s).astype(np.float32) for p, s in shapes.items()}


# ---- Newton-Schulz --------------------------------------------------------------------------


def _rank_deficient(rng, shape, rank):
    return rng.standard_normal((shape[0], rank)) @ rng.standard_normal((rank, shape[1]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_newton_schulz_singular_values_in_band(dtype):
    """Quintic NS does not converge to 1: for full-rank inputs every singular value lands in
    [0.6, 1.25] (Keller Jordan's iteration is tuned to roughly [0.7, 1.2]); bf16 rounding adds
    a few percent. A rank-r input keeps r singular values in the band; the others stay below
    1e-4 in fp32, but in bf16 the rounding of X (2^-9 of its entries) puts energy in the null
    space that the quintic amplifies like any small singular value (slope a = 3.44 per step,
    a^5 ~ 485), so there they reach ~0.4: bound 0.5. That is the original bf16 Muon's behaviour.
    """
    rng = np.random.default_rng(0)
    cases = {
        "random": rng.standard_normal((48, 48)),
        "tall": rng.standard_normal((96, 32)),
        "wide": rng.standard_normal((32, 80)),
        "ill-conditioned": rng.standard_normal((40, 64)) * np.geomspace(1, 1e-2, 40)[:, None],
    }
    for name, g in cases.items():
        y = newton_schulz(jnp.asarray(g, jnp.float32), dtype=NS_DTYPES[dtype])
        assert y.shape == g.shape and y.dtype == NS_DTYPES[dtype]
        sv = np.linalg.svd(np.asarray(y, np.float64), compute_uv=False)
        assert sv.min() > 0.6 and sv.max() < 1.25, (name, sv.min(), sv.max())
    g = _rank_deficient(rng, (64, 48), 5)
    sv = np.linalg.svd(np.asarray(newton_schulz(g, dtype=NS_DTYPES[dtype])), compute_uv=False)
    assert sv[:5].min() > 0.6 and sv[:5].max() < 1.25
    assert sv[5:].max() < (1e-4 if dtype == "float32" else 0.5)


def test_newton_schulz_matches_float64_reference():
    """fp32 NS vs the float64 transcription: 1e-4 relative to the largest entry. The quintic
    amplifies rounding (its slope reaches ~3.4 near 0 and its fixed points are not
    attracting), so fp32's 6e-8 grows by about three orders of magnitude over 5 steps."""
    rng = np.random.default_rng(1)
    for shape in [(32, 32), (24, 64), (64, 24)]:
        g = rng.standard_normal(shape)
        ref = np_newton_schulz(g)
        got = np.asarray(newton_schulz(jnp.asarray(g, jnp.float32), dtype=jnp.float32))
        assert np.max(np.abs(got - ref)) < 1e-4 * np.max(np.abs(ref))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_zero_gradient_gives_zero_update(dtype):
    shapes = {"layer_0/qkvg/kernel": (16, 48), "layer_0/w3/kernel": (32, 16)}
    plan = muon.MuonPlan(shapes, ns_dtype=dtype)
    tx = muon.muon(0.1, plan, weight_decay=0.0)
    zeros = {"layer_0": {k.split("/")[1]: {"kernel": jnp.zeros(s)} for k, s in shapes.items()}}
    state = tx.init(zeros)
    for _ in range(2):
        upd, state = jax.jit(tx.update)(zeros, state, zeros)
    for leaf in jax.tree.leaves(upd):
        assert np.all(np.isfinite(leaf)) and not np.any(leaf)


# ---- single-device Muon vs float64 NumPy ------------------------------------------------------


@pytest.mark.parametrize("kind", ["adamw_rms", "max_ratio"])
def test_single_device_muon_matches_numpy_over_steps(kind):
    """Four steps with momentum, Nesterov, weight decay and a changing learning rate.

    Tolerance on the parameters: fp32 NS 1e-5 absolute on entries of size ~0.1 (the update per
    step is lr * O(1); the NS rounding above is 1e-4 of it). bf16 NS (what the 3B run uses):
    3e-2 of the accumulated change in Frobenius norm. bf16 NS alone is ~1.5% from float64
    (measured, every shape here): X and B are rounded to 8 mantissa bits at every step.
    """
    shapes = _tiny_muon_shapes()
    params = {k: v * 0.1 for k, v in _random(shapes, 2).items()}
    grads = [_random(shapes, 10 + t) for t in range(4)]
    lrs = [0.01, 0.02, 0.03, 0.015]
    ref = np_muon(params, grads, lambda t: lrs[t], wd=0.1, kind=kind)

    def tree(d):
        out: dict = {}
        for path, v in d.items():
            layer, mod, leaf = path.split("/")
            out.setdefault(layer, {}).setdefault(mod, {})[leaf] = jnp.asarray(v)
        return out

    for dtype, tol in (("float32", 1e-5), ("bfloat16", 3e-2)):
        plan = muon.MuonPlan(shapes, ns_dtype=dtype, shape_factor=kind)
        tx = muon.muon(lambda step: jnp.asarray(lrs)[step], plan, weight_decay=0.1)
        p = tree(params)
        state = tx.init(p)
        step = jax.jit(tx.update)
        for t in range(4):
            upd, state = step(tree(grads[t]), state, p)
            p = optax.apply_updates(p, upd)
            got = flatten_dict(p, sep="/")
            for k in shapes:
                diff = np.asarray(got[k], np.float64) - ref[t][k]
                if dtype == "float32":
                    err = np.max(np.abs(diff))
                else:  # relative to the accumulated change, in Frobenius norm
                    err = np.linalg.norm(diff) / np.linalg.norm(ref[t][k] - params[k])
                assert err < tol, (dtype, t, k, err)


def test_first_step_matches_optax_contrib_muon():
    """optax.contrib.muon uses an EMA with bias correction, so only the first step's direction
    (proportional to G either way) is comparable: same NS, same max(1, out/in) ** 0.5 factor."""
    shapes = {"a": (24, 64), "b": (64, 24), "c": (32, 32)}
    g = {k: jnp.asarray(v) for k, v in _random(shapes, 3).items()}
    ref_tx = optax.contrib.muon(1.0, eps=1e-7)
    ref, _ = ref_tx.update(g, ref_tx.init(g), g)
    plan = muon.MuonPlan(shapes, ns_dtype="float32", shape_factor="max_ratio")
    tx = muon.muon(1.0, plan)
    got, _ = tx.update(g, tx.init(g), g)
    for k in shapes:
        np.testing.assert_allclose(got[k], ref[k], atol=2e-5)


# ---- the a2a plan -------------------------------------------------------------------------------


@pytest.mark.parametrize("preset,n", [("laplace-3b", 64), ("laplace-3b", 8), ("small", 8)])
def test_tile_plan_is_a_packing(preset, n):
    """Every matrix placed once, whole, on one device; tiles never overlap or overflow."""
    shapes = {
        p: tuple(s.shape)
        for p, s in flatten_dict(abstract_params(PRESETS[preset]), sep="/").items()
        if is_muon_path(p)
    }
    pools, rest = plan_tiles(shapes, n, tile_widths(shapes.values()))
    assert rest == [] and len(pools) == 1
    pool = pools[0]
    assert sorted(m.path for m in pool.matrices) == sorted(shapes)
    used = np.zeros((n, pool.tile_slots), int)
    for m in pool.matrices:
        assert m.n_tiles * pool.tile_width == max(m.shape)
        used[m.owner, m.first_slot : m.first_slot + m.n_tiles] += 1
    assert used.max() == 1
    seg = pool.seg_table()
    assert np.array_equal(seg.sum(axis=1), used)  # every used slot in exactly one matrix slot
    # a tall matrix's tile t is stacked from the blocks holding its rows t w .. (t+1) w - 1 in
    # order (block (source i, slot t) of a matrix at first_slot f starts at row
    # i c/n + (t - f) w/n), and the way back is the inverse permutation
    src, ret, T, w = pool.tall_sources(), pool.tall_returns(), pool.tile_slots, pool.tile_width
    for m in pool.matrices:
        if m.tall:
            source, slot = np.divmod(src[m.owner, m.first_slot : m.first_slot + m.n_tiles], T)
            starts = source * (m.shape[0] // n) + (slot - m.first_slot) * (w // n)
            assert np.array_equal(starts.ravel(), np.arange(0, m.shape[0], w // n))
    for j in range(n):
        position = np.empty(n * T, int)
        position[src[j].ravel()] = np.arange(n * T)
        assert np.array_equal(ret[j].ravel(), position)
    if preset == "laplace-3b" and n == 64:
        # T is set by W_12 (16 tiles of 1,024 columns); no device is left without a matrix
        assert (pool.short_side, pool.tile_width, pool.tile_slots, pool.matrix_slots) == (
            3072,
            1024,
            16,
            2,
        )
        assert min(pool.loads()) > 0
        # docs/design.md s4 and s8: Muon's two all_to_alls move 396,361,728 bytes per device (bf16);
        # gather moves 2 x 63/64 of the 5.44 GB gradient; the ratio is the 27.0 bound.
        a2a = a2a_bytes_per_device(pools, 2)
        gather = gather_bytes_per_device(shapes, n, 2)
        assert a2a == 396_361_728
        assert gather == 10_701_766_656
        assert gather / a2a == 27.0
        # Newton-Schulz FLOPs: the write-up's 1.95e14 (2% of 9.53e15)
        assert round(sum(ns_flops(s) for s in shapes.values()) / 1e12) == 195
    if preset == "laplace-3b" and n == 8:
        assert pool.tile_slots == 108  # 864 tiles / 8: a perfect packing


# ---- distributed vs single device on 8 simulated devices ------------------------------------


def _collectives(hlo: str) -> dict[str, int]:
    return {
        op: len(re.findall(rf"^\s*\S+ = .* {op}(?:-start)?\(", hlo, re.M))
        for op in ("all-to-all", "all-gather", "all-reduce", "collective-permute", "reduce-scatter")
    }


@pytest.fixture(scope="module")
def tiny_setup():
    assert len(jax.devices()) >= 8, "tests/conftest.py sets 8 host devices"
    cfg = PRESETS["tiny"]
    mesh = make_mesh(8)
    shard = param_shardings(cfg, mesh)
    params = jax.device_put(init_params(cfg, jax.random.key(0, impl="rbg")), shard)
    rng = np.random.default_rng(5)
    grads = [
        jax.device_put(
            jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params),
            shard,
        )
        for _ in range(3)
    ]
    return cfg, mesh, shard, params, grads


def _run(mode, dtype, setup, mesh=True):
    cfg, m, shard, params, grads = setup
    opt = OPTIMIZER_PRESETS["tiny"].replace(muon_mode=mode, ns_dtype=dtype)
    if not mesh:  # one device, plain arrays
        params = jax.device_get(params)
        grads = [jax.device_get(g) for g in grads]
        tx = make_optimizer(opt, params)
        step = jax.jit(tx.update)
        state = jax.jit(tx.init)(params)
        hlo = None
    else:
        tx = make_optimizer(opt, params, m)
        ss = opt_state_shardings(tx, params, shard)
        state = jax.jit(tx.init, out_shardings=ss)(params)
        step = jax.jit(tx.update, in_shardings=(shard, ss, shard), out_shardings=(shard, ss))
        hlo = step.lower(grads[0], state, params).compile().as_text()
    outs = []
    p = params
    for g in grads:
        upd, state = step(g, state, p)
        p = optax.apply_updates(p, upd)
        outs.append(flatten_dict(jax.device_get(upd), sep="/"))
    return outs, state, hlo


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_distributed_modes_are_bit_identical_to_one_device(tiny_setup, dtype):
    """Three optimizer steps of the whole Laplace optimizer: one device, and `single`, `gather`
    and `a2a` on 8 devices give the same bits, every leaf, every step (the old `a2a` summed each
    Gram in another order: 2.6e-6 of the largest entry in fp32, 1.8e-2 in bf16)."""
    single, _, _ = _run("single", dtype, tiny_setup, mesh=False)
    for mode in ("single", "gather", "a2a"):
        got, _, _ = _run(mode, dtype, tiny_setup)
        for t in range(len(single)):
            for path, ref in single[t].items():
                err = np.max(np.abs(got[t][path] - ref))
                assert np.array_equal(got[t][path], ref), (mode, t, path, err)


def _modes_bit_identical(shapes, spec, dtype, seed):
    """plan.orthogonalize of random gradients: one device, then every mode on 8 devices."""
    mesh = make_mesh(8)
    grads = {k: jnp.asarray(v) for k, v in _random(shapes, seed).items()}
    ref = jax.jit(muon.MuonPlan(shapes, ns_dtype=dtype).orthogonalize)(grads)
    placed = {k: jax.device_put(v, NamedSharding(mesh, spec[k])) for k, v in grads.items()}
    for mode in muon.MODES:
        plan = muon.MuonPlan(shapes, mode, ns_dtype=dtype, mesh=mesh, specs=spec)
        got = jax.jit(plan.orthogonalize)(placed)
        for k in shapes:
            assert np.array_equal(got[k], ref[k]), (mode, k, np.max(np.abs(got[k] - ref[k])))
    return plan


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hybrid_modes_are_bit_identical(dtype):
    """The tiny 1:1 hybrid's Muon matrices, placed by the rules table."""
    cfg = PRESETS["tiny"].replace(attention_every=2)
    abstract = flatten_dict(abstract_params(cfg), sep="/")
    shapes = {p: tuple(s.shape) for p, s in abstract.items() if is_muon_path(p)}
    shard = flatten_dict(param_shardings(cfg, make_mesh(8)), sep="/")
    _modes_bit_identical(shapes, {p: shard[p].spec for p in shapes}, dtype, seed=11)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_shapes_fallbacks_are_bit_identical(dtype):
    """Matrices the tile layout cannot take (rows not divisible by n: replicated; a tall matrix
    whose tile width does not split in n: all-gathered) beside pooled ones, tall and wide, of
    three short sides: every mode gives the one-device bits."""
    shapes = {"a": (16, 100), "b": (16, 60), "d": (40, 16), "c": (20, 40), "e": (24, 48)}
    spec = {k: PartitionSpec(FSDP) if s[0] % 8 == 0 else PartitionSpec() for k, s in shapes.items()}
    plan = _modes_bit_identical(shapes, spec, dtype, seed=7)
    pools, rest = plan.pools()
    # s = 16 pool: w = gcd(100, 60, 40) = 20 does not split in 8 rows, so the tall `d` goes
    # to the all-gather fallback; `c` (20 rows) is replicated and orthogonalised locally.
    assert rest == ["d"] and sorted(p.short_side for p in pools) == [16, 24]
    assert plan.widths == {16: 20, 20: 40, 24: 48}


def test_tiled_arithmetic_matches_whole_matrices():
    """The tiled Newton-Schulz every mode runs is the whole-matrix definition up to fp32
    reassociation (1e-5 of the largest entry), for wide, tall and square matrices."""
    rng = np.random.default_rng(4)
    for shape, w in (((24, 96), 32), ((96, 24), 24), ((32, 32), 32)):
        g = jnp.asarray(rng.standard_normal((2,) + shape), jnp.float32)
        ref = newton_schulz(g, dtype=jnp.float32)
        got = newton_schulz_tiled(g, w, dtype=jnp.float32)
        assert got.shape == g.shape
        np.testing.assert_allclose(got, ref, atol=1e-5 * float(jnp.max(jnp.abs(ref))))


def test_compiled_update_collectives_and_state_sharding(tiny_setup):
    """a2a: exactly two all_to_all and no all-gather; gather: one all-gather per shape group
    (4 Muon shapes) and no all_to_all; the state keeps the parameters' shardings."""
    _, mesh, shard, params, _ = tiny_setup
    _, state, hlo = _run("a2a", "bfloat16", tiny_setup)
    counts = _collectives(hlo)
    assert counts["all-to-all"] == 2 and counts["all-gather"] == 0, counts
    # each all_to_all moves the static [n, T, s w / n] layout: T s w elements per device
    pools, rest = plan_tiles(_tiny_muon_shapes(), 8, {64: 64})
    (pool,) = pools
    sizes = [
        sum(math.prod(int(d) for d in dims.split(",")) for dims in re.findall(r"\[([\d,]+)\]", t))
        for t in re.findall(r"^\s*\S+ = (.*) all-to-all\(", hlo, re.M)
    ]
    assert rest == [] and sizes == [pool.tile_slots * pool.short_side * pool.tile_width] * 2, sizes
    assert counts["reduce-scatter"] == 0 and counts["collective-permute"] == 0, counts
    for path, sh in flatten_dict(shard, sep="/").items():
        if is_muon_path(path):
            mom = state.inner_states["muon"].inner_state[0].momentum
            assert flatten_dict(mom, sep="/")[path].sharding.is_equivalent_to(sh, 2)
            assert sh.spec[0] == FSDP
        else:
            nu = state.inner_states["adamw"].inner_state[0].nu
            assert flatten_dict(nu, sep="/")[path].sharding.is_equivalent_to(sh, len(sh.spec) or 1)
    _, _, hlo = _run("gather", "bfloat16", tiny_setup)
    counts = _collectives(hlo)
    assert counts["all-gather"] == 4 and counts["all-to-all"] == 0, counts


def test_jitted_update_has_no_branches_loops_or_callbacks(tiny_setup):
    """Neuron constraints (docs/design.md s1): no cond/case, no while, no host callbacks."""
    cfg, mesh, shard, params, grads = tiny_setup
    tx = make_optimizer(OPTIMIZER_PRESETS["tiny"], params, mesh)
    state = jax.jit(tx.init)(params)
    text = jax.jit(tx.update).lower(grads[0], state, params).as_text()
    for bad in ("stablehlo.if", "stablehlo.case", "stablehlo.while", "callback"):
        assert bad not in text, bad


def test_zero_gradients_give_zeros_through_every_path():
    """Tiles, empty slots, the replicated and the all-gathered fallback: zeros, no NaN."""
    mesh = make_mesh(8)
    shapes = {"a": (16, 100), "b": (16, 60), "d": (40, 16), "c": (20, 40), "e": (24, 48)}
    spec = {k: PartitionSpec(FSDP) if s[0] % 8 == 0 else PartitionSpec() for k, s in shapes.items()}
    plan = muon.MuonPlan(shapes, "a2a", ns_dtype="float32", mesh=mesh, specs=spec)
    zeros = jax.jit(plan.orthogonalize)(
        {k: jax.device_put(jnp.zeros(s), NamedSharding(mesh, spec[k])) for k, s in shapes.items()}
    )
    for k in shapes:
        assert np.all(np.asarray(zeros[k]) == 0), k
