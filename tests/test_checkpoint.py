"""Orbax checkpoints: round trip, keep-last-N, refusal on config mismatch, corrupt ones skipped."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from laplace_jax.config import get_config
from laplace_jax.model import abstract_params, init_params
from laplace_jax.optim import opt_state_shardings
from laplace_jax.sharding import make_mesh, param_shardings
from train.checkpoint import (
    Checkpointer,
    ConfigMismatch,
    abstract_with_shardings,
    check_compatible,
)

REPO = Path(__file__).resolve().parent.parent
CFG = get_config("tiny")


def _state(mesh, seed=0):
    ps = param_shardings(CFG, mesh)
    params = jax.jit(lambda k: init_params(CFG, k), out_shardings=ps)(jax.random.key(seed))
    tx = optax.adamw(1e-3)
    abs_opt = jax.eval_shape(tx.init, abstract_params(CFG))
    os_ = opt_state_shardings(tx, abstract_params(CFG), ps)
    opt = jax.jit(tx.init, out_shardings=os_)(params)
    # make the optimizer state non-trivial
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt = tx.update(grads, opt, params)
    return params, opt, ps, os_, abs_opt


def _assert_tree_equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def _save(ckpt, step, params, opt):
    meta = {"model": CFG.to_dict(), "tokenizer": "tok.json"}
    ckpt.save(step, params, opt, {"next_index": step * 3}, meta)


def test_roundtrip_keep_last_and_meta(tmp_path):
    mesh = make_mesh(8)
    params, opt, ps, os_, abs_opt = _state(mesh)
    ckpt = Checkpointer(tmp_path / "ck", keep=2)
    for step in (1, 2, 3):
        _save(ckpt, step, params, opt)
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]
    got = ckpt.restore_latest(
        abstract_with_shardings(params, ps), abstract_with_shardings(abs_opt, os_), None
    )
    assert got["step"] == 3 and got["data"] == {"next_index": 9}
    assert got["meta"]["model"] == CFG.to_dict() and got["meta"]["step"] == 3
    _assert_tree_equal(got["params"], params)
    _assert_tree_equal(got["opt_state"], opt)
    assert got["params"]["embed"]["embedding"].sharding == ps["embed"]["embedding"]
    ckpt.close()


def test_config_mismatch_is_refused_naming_fields(tmp_path):
    mesh = make_mesh(8)
    params, opt, ps, os_, abs_opt = _state(mesh)
    ckpt = Checkpointer(tmp_path / "ck", keep=2)
    _save(ckpt, 1, params, opt)
    ckpt.wait()
    other = CFG.replace(n_layers=3, seq_len=128)
    with pytest.raises(ConfigMismatch) as e:
        ckpt.restore_latest(
            abstract_with_shardings(params, ps),
            abstract_with_shardings(abs_opt, os_),
            {"model": other.to_dict()},
        )
    assert "model.n_layers: checkpoint 2, requested 3" in str(e.value)
    assert "model.seq_len: checkpoint 64, requested 128" in str(e.value)
    assert "d_model" not in str(e.value)
    check_compatible({"model": CFG.to_dict()}, {"model": CFG.to_dict()}, "x")  # no error
    ckpt.close()


@pytest.mark.parametrize("damage", ["delete_params", "garble_meta"])
def test_corrupt_latest_checkpoint_is_skipped_with_warning(tmp_path, damage):
    mesh = make_mesh(8)
    params, opt, ps, os_, abs_opt = _state(mesh)
    params2, opt2, *_ = _state(mesh, seed=1)
    ckpt = Checkpointer(tmp_path / "ck", keep=3)
    _save(ckpt, 1, params, opt)
    _save(ckpt, 2, params2, opt2)
    ckpt.close()
    step_dir = tmp_path / "ck" / "2"
    if damage == "delete_params":  # a partial checkpoint: array data missing
        for f in (step_dir / "params").rglob("*"):
            if f.is_file() and "metadata" not in f.name:
                f.unlink()
    else:
        (step_dir / "meta" / "metadata").write_text("{not json")
    ckpt = Checkpointer(tmp_path / "ck", keep=3)
    with pytest.warns(RuntimeWarning, match=r"ck/2 .*skipping"):
        got = ckpt.restore_latest(
            abstract_with_shardings(params, ps),
            abstract_with_shardings(abs_opt, os_),
            {"model": CFG.to_dict()},
        )
    assert got["step"] == 1
    _assert_tree_equal(got["params"], params)
    ckpt.close()


def test_restore_onto_four_devices_gives_the_same_parameters(tmp_path):
    mesh = make_mesh(8)
    params, opt, *_ = _state(mesh)
    ckpt = Checkpointer(tmp_path / "ck", keep=2)
    _save(ckpt, 5, params, opt)
    ckpt.close()
    np.savez(tmp_path / "expected.npz", **_flat(params))
    script = textwrap.dedent(
        f"""
        import jax, numpy as np, optax
        from laplace_jax.config import get_config
        from laplace_jax.model import abstract_params
        from laplace_jax.sharding import make_mesh, param_shardings
        from laplace_jax.model import flat_paths
        from train.checkpoint import Checkpointer, abstract_with_shardings as ab
        from laplace_jax.optim import opt_state_shardings
        assert jax.device_count() == 4
        cfg = get_config("tiny")
        mesh = make_mesh()
        ps = param_shardings(cfg, mesh)
        tx = optax.adamw(1e-3)
        abs_opt = jax.eval_shape(tx.init, abstract_params(cfg))
        os_ = opt_state_shardings(tx, abstract_params(cfg), ps)
        got = Checkpointer({str(tmp_path / "ck")!r}).restore_latest(
            ab(abstract_params(cfg), ps), ab(abs_opt, os_), {{"model": cfg.to_dict()}})
        emb = got["params"]["embed"]["embedding"]
        assert len(emb.sharding.device_set) == 4, emb.sharding
        exp = np.load({str(tmp_path / "expected.npz")!r})
        flat = flat_paths(got["params"])
        assert sorted(flat) == sorted(exp.files)
        for k, v in flat.items():
            np.testing.assert_array_equal(np.asarray(v), exp[k])
        print("OK", got["step"])
        """
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK 5" in out.stdout


def _flat(params):
    from laplace_jax.model import flat_paths

    return {k: np.asarray(v) for k, v in flat_paths(params).items()}
