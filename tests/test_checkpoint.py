"""Orbax checkpoints: round trip, keep-last-N, refusal on config or layout mismatch, corrupt ones
skipped (and set aside), every-one-corrupt and unreadable checkpoints stop with nothing changed."""

import functools
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from shared_fixtures import START_ENV
from xla_env import xla_flags

from laplace_jax.model import abstract_params, init_params
from laplace_jax.optim import opt_state_shardings
from laplace_jax.sharding import abstract_with_shardings, make_mesh, param_shardings
from laplace_spec.config import get_config
from train.checkpoint import (
    Checkpointer,
    ConfigMismatch,
    CorruptCheckpointWarning,
    LayoutMismatch,
    NoUsableCheckpoint,
    RestoreError,
    check_compatible,
)

REPO = Path(__file__).resolve().parent.parent
CFG = get_config("tiny")


def _targets(mesh, cfg=CFG):
    """(abstract params, abstract AdamW state), placed as the trainer places them."""
    ps = param_shardings(cfg, mesh)
    tx = optax.adamw(1e-3)
    abs_opt = jax.eval_shape(tx.init, abstract_params(cfg))
    os_ = opt_state_shardings(tx, abstract_params(cfg), ps)
    return abstract_with_shardings(abstract_params(cfg), ps), abstract_with_shardings(abs_opt, os_)


@pytest.fixture(scope="module")
def states():
    """{seed: (params, AdamW state after one update)} on 8 devices, built once."""
    mesh = make_mesh(8)
    abs_params, abs_opt = _targets(mesh)
    shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
    tx = optax.adamw(1e-3)

    @functools.partial(jax.jit, out_shardings=(shardings(abs_params), shardings(abs_opt)))
    def make(key):
        params = init_params(CFG, key)
        opt = tx.init(params)
        _, opt = tx.update(jax.tree.map(jnp.ones_like, params), opt, params)  # non-trivial
        return params, opt

    return {seed: make(jax.random.key(seed)) for seed in (0, 1)}


def _assert_tree_equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def _save(ckpt, step, params, opt, cfg=CFG):
    meta = {"model": cfg.to_dict(), "tokenizer": "tok.json"}
    ckpt.save(step, params, opt, {"next_index": step * 3}, meta)


def _snapshot(root: Path) -> dict[str, str]:
    """Every file and directory under root with a hash of its bytes."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _biggest_array_file(step_dir: Path) -> Path:
    files = [Path(f) for f in glob.glob(str(step_dir / "params" / "**"), recursive=True)]
    return max((f for f in files if f.is_file()), key=lambda f: f.stat().st_size)


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def test_roundtrip_keep_last_and_meta(tmp_path, states):
    params, opt = states[0]
    targets = _targets(make_mesh(8))
    ckpt = Checkpointer(tmp_path / "ck", keep=2)
    for step in (1, 2, 3):
        _save(ckpt, step, params, opt)
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]
    got = ckpt.restore_latest(*targets, None)
    assert got["step"] == 3 and got["data"] == {"next_index": 9}
    assert got["meta"]["model"] == CFG.to_dict() and got["meta"]["step"] == 3
    _assert_tree_equal(got["params"], params)
    _assert_tree_equal(got["opt_state"], opt)
    assert got["params"]["embed"]["embedding"].sharding == targets[0]["embed"]["embedding"].sharding
    ckpt.close()
    empty = Checkpointer(tmp_path / "empty")
    assert empty.restore_latest(*targets) is None


def test_config_mismatch_is_refused_naming_fields(tmp_path, states):
    params, opt = states[0]
    targets = _targets(make_mesh(8))
    ckpt = Checkpointer(tmp_path / "ck", keep=2)
    _save(ckpt, 1, params, opt)
    ckpt.wait()
    before = _snapshot(tmp_path)
    other = CFG.replace(n_layers=3, seq_len=128)
    with pytest.raises(ConfigMismatch) as e:
        ckpt.restore_latest(*targets, {"model": other.to_dict()})
    assert "model.n_layers: checkpoint 2, requested 3" in str(e.value)
    assert "model.seq_len: checkpoint 64, requested 128" in str(e.value)
    assert "d_model" not in str(e.value)
    assert "nothing was changed" in str(e.value)
    check_compatible({"model": CFG.to_dict()}, {"model": CFG.to_dict()}, "x")  # no error
    # a checkpoint saved before `embed_scale` and `gla_branch_scale` existed: pure Laplace is
    # today's default model and resumes under it; a hybrid's embedding and GLA branches were
    # unscaled, it resumes as embed_scale=one gla_branch_scale=1, and a run that asks for
    # today's defaults is refused naming the fields
    added = ("embed_scale", "gla_branch_scale")
    saved = {k: v for k, v in CFG.to_dict().items() if k not in added}
    check_compatible({"model": saved}, {"model": CFG.to_dict()}, "x")
    hybrid = CFG.replace(attention_every=2)
    saved = {k: v for k, v in hybrid.to_dict().items() if k not in added}
    old = hybrid.replace(embed_scale="one", gla_branch_scale="1")
    check_compatible({"model": saved}, {"model": old.to_dict()}, "x")
    with pytest.raises(ConfigMismatch) as e:
        check_compatible({"model": saved}, {"model": hybrid.to_dict()}, "x")
    assert "model.embed_scale: checkpoint 'one', requested 'auto'" in str(e.value)
    assert "model.gla_branch_scale: checkpoint '1', requested 'auto'" in str(e.value)
    ckpt.close()
    assert _snapshot(tmp_path) == before


def _delete_params_data(step_dir):  # a partial checkpoint: the array data missing
    for f in (step_dir / "params").rglob("*"):
        if f.is_file() and "metadata" not in f.name.lower():
            f.unlink()


DAMAGES = {
    "delete_params": _delete_params_data,
    "truncate_array_file": lambda d: _truncate(_biggest_array_file(d)),
    "zero_array_file": lambda d: (lambda f: f.write_bytes(bytes(f.stat().st_size)))(
        _biggest_array_file(d)
    ),
    "garble_meta": lambda d: (d / "meta" / "metadata").write_text("{not json"),
    "garble_array_metadata": lambda d: (d / "params" / "_METADATA").write_text("{not json"),
    "delete_data_item": lambda d: shutil.rmtree(d / "data"),
    "delete_params_item": lambda d: shutil.rmtree(d / "params"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_corrupt_latest_checkpoint_is_skipped_with_warning_and_set_aside(tmp_path, states, damage):
    (params, opt), (params2, opt2) = states[0], states[1]
    targets = _targets(make_mesh(8))
    ckpt = Checkpointer(tmp_path / "ck", keep=3)
    _save(ckpt, 1, params, opt)
    _save(ckpt, 2, params2, opt2)
    ckpt.close()
    DAMAGES[damage](tmp_path / "ck" / "2")
    damaged = _snapshot(tmp_path / "ck" / "2")
    ckpt = Checkpointer(tmp_path / "ck", keep=3)
    with pytest.warns(CorruptCheckpointWarning) as record:
        got = ckpt.restore_latest(*targets, {"model": CFG.to_dict()})
    told = [str(w.message) for w in record]
    assert len(told) == 2, told
    assert told[0].startswith(f"checkpoint {tmp_path / 'ck' / '2'} is corrupt (")
    assert told[0].endswith("); skipping it")
    assert (
        told[1]
        == f"moved corrupt checkpoint {tmp_path / 'ck' / '2'} to {tmp_path / 'ck-corrupt' / '2'}"
    )
    assert got["step"] == 1 and got["data"] == {"next_index": 3}
    _assert_tree_equal(got["params"], params)
    # the corrupt one is kept, out of the way: the run can save step 2 again
    assert ckpt.all_steps() == [1]
    assert _snapshot(tmp_path / "ck-corrupt" / "2") == damaged
    _save(ckpt, 2, params2, opt2)
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
    ckpt.close()


def test_every_checkpoint_corrupt_raises_naming_them_and_changes_nothing(tmp_path, states):
    params, opt = states[0]
    targets = _targets(make_mesh(8))
    ckpt = Checkpointer(tmp_path / "ck", keep=3)
    _save(ckpt, 10, params, opt)
    _save(ckpt, 20, params, opt)
    ckpt.close()
    _truncate(_biggest_array_file(tmp_path / "ck" / "10"))
    (tmp_path / "ck" / "20" / "meta" / "metadata").write_text("{not json")
    before = _snapshot(tmp_path)
    ckpt = Checkpointer(tmp_path / "ck", keep=3)
    with pytest.warns(CorruptCheckpointWarning), pytest.raises(NoUsableCheckpoint) as e:
        ckpt.restore_latest(*targets, {"model": CFG.to_dict()})
    text = str(e.value)
    assert f"{tmp_path / 'ck' / '20'}: meta: JSONDecodeError" in text
    assert f"{tmp_path / 'ck' / '10'}: restore: ValueError: OUT_OF_RANGE" in text
    assert text.endswith("nothing was changed")
    assert [s for s, _ in e.value.corrupt] == [20, 10]
    ckpt.close()
    assert _snapshot(tmp_path) == before


def test_layout_mismatch_stops_naming_paths_and_changes_nothing(tmp_path, states):
    """A checkpoint whose arrays differ from what the run builds is refused from orbax's
    metadata, not skipped for an older one (both are of the same other layout)."""
    params, opt = states[0]
    ckpt = Checkpointer(tmp_path / "ck", keep=3)
    _save(ckpt, 1, params, opt)
    _save(ckpt, 2, params, opt)
    ckpt.close()
    before = _snapshot(tmp_path)
    other = CFG.replace(n_layers=3, ffn_dim=192)
    ckpt = Checkpointer(tmp_path / "ck", keep=3)
    with pytest.raises(LayoutMismatch) as e:
        ckpt.restore_latest(*_targets(make_mesh(8), other), None)
    text, problems = str(e.value), e.value.problems
    assert f"checkpoint {tmp_path / 'ck' / '2'} holds other arrays" in text
    assert "params/layer_2/w12/kernel: in this run, not in the checkpoint" in problems
    assert "params/layer_0/w12/kernel: checkpoint [64, 256], this run [64, 384]" in problems
    assert "params/layer_0/w3/kernel: checkpoint [128, 64], this run [192, 64]" in problems
    assert "opt_state/0/mu/layer_0/w3/kernel: checkpoint [128, 64], this run [192, 64]" in problems
    assert not [p for p in problems if "embedding" in p or "layer_1/out" in p]  # same shapes
    # 2 layers x (w12, w3) reshaped, one layer (10 arrays) added; params, mu and nu each
    assert len(problems) == 3 * (4 + 10)
    assert problems[0] in text and f"... and {len(problems) - 12} more" in text
    assert "nothing was changed" in text
    ckpt.close()
    assert _snapshot(tmp_path) == before


def test_unreadable_checkpoint_stops_and_is_not_taken_for_corrupt(tmp_path, states):
    """Permission denied on one array file of the newest checkpoint (as for a checkpoint written
    by another user): the restore stops, naming the error, instead of falling back to step 1."""
    params, opt = states[0]
    targets = _targets(make_mesh(8))
    root = Path(tempfile.mkdtemp(prefix="laplace-perm-"))  # reachable by another user
    try:
        os.chmod(root, 0o755)
        ckpt = Checkpointer(root / "ck", keep=3)
        _save(ckpt, 1, params, opt)
        _save(ckpt, 2, params, opt)
        ckpt.close()
        for p in (root, *root.rglob("*")):
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        _biggest_array_file(root / "ck" / "2").chmod(0o000)
        before = _snapshot(root / "ck" / "1")
        ckpt = Checkpointer(root / "ck", keep=3)
        with _as_unprivileged_user(), pytest.raises(RestoreError) as e:
            ckpt.restore_latest(*targets, {"model": CFG.to_dict()})
        assert not isinstance(e.value, NoUsableCheckpoint | LayoutMismatch | ConfigMismatch)
        text = str(e.value)
        assert f"checkpoint {root / 'ck' / '2'} could not be read" in text
        assert "PERMISSION_DENIED" in text and "nothing was changed" in text
        assert ckpt.all_steps() == [1, 2] and not (root / "ck-corrupt").exists()
        assert _snapshot(root / "ck" / "1") == before
        ckpt.close()
    finally:
        shutil.rmtree(root)


class _as_unprivileged_user:
    """Root reads any file whatever its mode: take the effective uid of `nobody` meanwhile."""

    def __enter__(self):
        self.root = os.geteuid() == 0
        if self.root:
            os.seteuid(65534)

    def __exit__(self, *exc):
        if self.root:
            os.seteuid(0)


def test_restore_onto_four_devices_gives_the_same_parameters(tmp_path, states):
    params, opt = states[0]
    ckpt = Checkpointer(tmp_path / "ck", keep=2)
    _save(ckpt, 5, params, opt)
    ckpt.close()
    np.savez(tmp_path / "expected.npz", **_flat(params))
    script = textwrap.dedent(
        f"""
        import jax, numpy as np, optax
        from flax import traverse_util
        from laplace_spec.config import get_config
        from laplace_jax.model import abstract_params
        from laplace_jax.sharding import abstract_with_shardings as ab, make_mesh, param_shardings
        from train.checkpoint import Checkpointer
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
        flat = traverse_util.flatten_dict(got["params"], sep="/")
        assert sorted(flat) == sorted(exp.files)
        for k, v in flat.items():
            np.testing.assert_array_equal(np.asarray(v), exp[k])
        print("OK", got["step"])
        """
    )
    env = {**START_ENV, "XLA_FLAGS": xla_flags(4)}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK 5" in out.stdout


def _flat(params):
    return {k: np.asarray(v) for k, v in traverse_util.flatten_dict(params, sep="/").items()}
