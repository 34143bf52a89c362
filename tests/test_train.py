"""The trainer: it learns, resumes exactly after SIGKILL, moves across device counts, guards NaN,
and its FSDP step equals the single-device step. Tiny model, a few dozen steps, 8 CPU devices."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax.config import ConfigError, get_config
from laplace_jax.model import LaplaceLM, abstract_params, init_params
from laplace_jax.optim import OPTIMIZER_PRESETS
from laplace_jax.sharding import make_mesh, param_shardings
from train import main as train_main
from train import optimizer as optim
from train.config import TrainConfig, batch_layout
from train.data import write_shard
from train.step import make_train_step

REPO = Path(__file__).resolve().parent.parent
CFG = get_config("tiny")  # vocab 320, seq_len 64


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Structured data: runs that count up by one (mod 256) from random starts."""
    d = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    runs = [
        (s + np.arange(n)) % 256
        for s, n in zip(rng.integers(0, 256, 400), rng.integers(20, 200, 400), strict=True)
    ]
    stream = np.concatenate(runs)
    write_shard(d / "train_000000.bin", stream[: len(stream) * 9 // 10])
    write_shard(d / "val_000000.bin", stream[len(stream) * 9 // 10 :])
    return d


def _args(shards, run_dir, *extra):
    return [
        "--config", "tiny",
        "--data", str(shards / "train_*.bin"),
        "--run-dir", str(run_dir),
        "--no-progress",
        "sample_tokens=0",
        *extra,
    ]  # fmt: skip


def _metrics(run_dir):
    return [
        json.loads(line)
        for line in (Path(run_dir) / "metrics.jsonl").read_text().split("\n")
        if line
    ]


def _losses(run_dir):
    return {m["step"]: m["loss"] for m in _metrics(run_dir)}


def _subprocess(args, devices=8):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.run(
        [sys.executable, "-m", "train.main", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )


def test_tiny_model_learns_structured_data(shards, tmp_path):
    run = tmp_path / "run"
    status = train_main.main(
        _args(
            shards, run, "--steps", "30", "--val-data", str(shards / "val_*.bin"), "eval_every=15"
        )
    )
    assert status == 0
    m = _metrics(run)
    assert [r["step"] for r in m] == list(range(1, 31))
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "mfu"} <= set(m[-1])
    # at initialisation the prediction is near uniform: loss ~ ln vocab_size
    assert abs(m[0]["loss"] - math.log(CFG.vocab_size)) < 0.3
    assert m[-1]["loss"] < 0.5 * m[0]["loss"]
    assert m[-1]["val_loss"] < 0.5 * m[0]["loss"]
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [
        20,
        30,
    ]
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"] == CFG.to_dict() and cfg["batch"]["sequences"] == 8
    from train.plot import plot

    png = plot(run)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sigkill_between_checkpoints_then_resume_gives_the_same_losses(shards, tmp_path):
    common = ("--steps", "14", "--ckpt-every", "4", "keep_checkpoints=5", "eval_every=0")
    whole = tmp_path / "whole"
    assert train_main.main(_args(shards, whole, *common)) == 0
    expected = _losses(whole)

    killed = tmp_path / "killed"
    out = _subprocess(_args(shards, killed, *common, "--debug-sigkill-at-step", "10"))
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    assert max(_losses(killed)) == 10  # it logged past its last checkpoint (8), then died

    out = _subprocess(_args(shards, killed, *common))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "resumed from" in out.stdout
    resumed_at = int(out.stdout.split("at step ")[1].split()[0])
    assert resumed_at in (4, 8)
    got = _losses(killed)
    assert sorted(got) == list(range(1, 15))
    for step in range(resumed_at + 1, 15):
        assert got[step] == expected[step], (step, got[step], expected[step])


def test_restore_on_four_devices_gives_the_same_next_loss(shards, tmp_path):
    a = tmp_path / "a"
    assert train_main.main(_args(shards, a, "--steps", "6", "--ckpt-every", "6")) == 0
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert train_main.main(_args(shards, a, "--steps", "7")) == 0  # 8 devices
    out = _subprocess(_args(shards, b, "--steps", "7"), devices=4)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mesh fsdp=4" in out.stdout and "resumed from" in out.stdout
    la, lb = _losses(a)[7], _losses(b)[7]
    assert _losses(a)[6] == _losses(b)[6]  # step 6 comes from the copied log
    assert abs(la - lb) <= 1e-5 * abs(la), (la, lb)


def test_nan_steps_are_skipped_then_the_run_stops_with_a_good_checkpoint(shards, tmp_path, capsys):
    run = tmp_path / "run"
    args = _args(
        shards,
        run,
        "--steps",
        "12",
        "--ckpt-every",
        "2",
        "max_bad_steps=2",
        "--debug-nan-at-step",
        "3",
        "--debug-nan-at-step",
        "5",
        "--debug-nan-at-step",
        "6",
    )
    assert train_main.main(args) == 2
    text = capsys.readouterr().out
    assert "stopping: 2 non-finite steps in a row" in text
    m = {r["step"]: r for r in _metrics(run)}
    assert m[3]["applied"] is False and m[3]["loss"] is None
    assert m[4]["applied"] is True and math.isfinite(m[4]["loss"])
    assert max(m) == 6
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-1] == 4  # none written while the streak was on
    # the run resumes from it and trains on
    assert train_main.main(_args(shards, run, "--steps", "8", "--ckpt-every", "2")) == 0
    m = {r["step"]: r for r in _metrics(run)}
    assert sorted(m) == list(range(1, 9))  # the log after the checkpoint was rewritten
    assert all(math.isfinite(m[s]["loss"]) for s in range(4, 9))


def _step_setup(mesh, opt_overrides=()):
    opt_cfg = optim.optimizer_config("tiny", list(opt_overrides), 10)
    ps = param_shardings(CFG, mesh)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_params(CFG), ps
    )
    tx, _, os_ = optim.build(opt_cfg, abstract, ps, mesh)
    step, _ = make_train_step(LaplaceLM(CFG), tx, mesh, ps, os_, grad_clip=1.0)
    return tx, ps, os_, step


def _state(tx, ps, os_, host_params, mesh):
    params = jax.device_put(host_params, ps)
    return {
        "params": params,
        "opt_state": jax.jit(tx.init, out_shardings=os_)(params),
        "bad_streak": jnp.zeros((), jnp.int32),
    }


def _host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def test_nan_guard_in_the_step_keeps_the_state_with_rbg_keys():
    mesh = make_mesh(8)
    tx, ps, os_, step = _step_setup(mesh)
    host = _host(init_params(CFG, jax.random.key(0, impl="rbg")))
    state = _state(tx, ps, os_, host, mesh)
    before = _host(state)
    bad = np.full((1, 8, CFG.seq_len + 1), -(2**30), np.int32)  # out-of-range ids: NaN loss
    state, m = step(state, bad)
    assert not bool(m["applied"]) and int(m["bad_streak"]) == 1
    assert not np.isfinite(float(m["loss"]))
    after = _host(state)
    jax.tree.map(np.testing.assert_array_equal, after["params"], before["params"])
    jax.tree.map(np.testing.assert_array_equal, after["opt_state"], before["opt_state"])
    good = np.random.default_rng(0).integers(0, 256, (1, 8, CFG.seq_len + 1)).astype(np.int32)
    state, m = step(state, good)
    assert bool(m["applied"]) and int(m["bad_streak"]) == 0
    changed = jax.tree.map(
        lambda a, b: not np.array_equal(a, b), _host(state["params"]), before["params"]
    )
    assert all(jax.tree.leaves(changed))


def test_fsdp_step_on_8_devices_equals_the_1_device_step():
    """Same losses to 1e-6 and parameters after two steps to 5e-5, against updates of ~1e-2.

    The reduction order differs between 1 and 8 devices; AdamW's first steps divide gradients by
    their own magnitude, which turns fp32 rounding of near-zero gradients into ~1e-5 changes.
    """
    host = _host(init_params(CFG, jax.random.key(1)))
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 256, (1, 8, CFG.seq_len + 1)).astype(np.int32) for _ in range(2)]
    results = []
    for n in (1, 8):
        mesh = make_mesh(n)
        tx, ps, os_, step = _step_setup(mesh)
        state = _state(tx, ps, os_, host, mesh)
        losses = []
        for b in batches:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        emb = state["params"]["layer_0"]["w12"]["kernel"]
        assert len(emb.sharding.device_set) == n
        results.append((losses, _host(state["params"])))
    (l1, p1), (l8, p8) = results
    np.testing.assert_allclose(l8, l1, rtol=1e-6)
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), p1, host)
    assert min(jax.tree.leaves(moved)) > 1e-4  # the step really changed every parameter
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=5e-5), p8, p1)


def test_gradient_accumulation_equals_one_big_batch():
    """2 micro-batches of 4 give the full batch of 8's loss and update (fp32, 4 devices),
    to the tolerances of the FSDP test above."""
    mesh = make_mesh(4)
    tx, ps, os_, step = _step_setup(mesh)
    host = _host(init_params(CFG, jax.random.key(2)))
    batch = np.random.default_rng(2).integers(0, 256, (1, 8, CFG.seq_len + 1)).astype(np.int32)
    s1, m1 = step(_state(tx, ps, os_, host, mesh), batch)
    s2, m2 = step(_state(tx, ps, os_, host, mesh), batch.reshape(2, 4, -1))
    np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m2["grad_norm"]), float(m1["grad_norm"]), rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=5e-5),
        _host(s2["params"]),
        _host(s1["params"]),
    )


def test_overrides_are_routed_and_unknown_keys_rejected():
    args = train_main.parse_args(
        ["--config", "tiny", "d_model=128", "d_v=32", "lr=0.05", "log_every=3", "--steps", "17"]
    )
    model, opt, tr = train_main.resolve_configs(args)
    assert (model.d_model, opt.lr, tr.log_every, tr.steps, opt.total_steps) == (
        128,
        0.05,
        3,
        17,
        17,
    )
    with pytest.raises(ConfigError, match="unknown config key 'colour'"):
        train_main.resolve_configs(train_main.parse_args(["colour=red"]))
    with pytest.raises(ConfigError, match="lr expects float"):
        train_main.resolve_configs(train_main.parse_args(["lr=fast"]))
    assert train_main.main(["--config", "tiny", "bogus=1"]) == 2


def test_batch_layout():
    cfg = TrainConfig(global_batch_tokens=524_288, micro_batch_size=64)
    assert batch_layout(cfg, 2048, 64) == (256, 4, 64)  # the 3B recipe on 64 NeuronCores
    with pytest.raises(ConfigError, match="multiple of seq_len"):
        batch_layout(TrainConfig(global_batch_tokens=1000), 64, 1)
    with pytest.raises(ConfigError, match="divide over the 8 devices"):
        batch_layout(TrainConfig(global_batch_tokens=4 * 64), 64, 8)


def test_optimizer_presets_exist_for_the_train_presets():
    assert {"small", "tiny", "laplace-3b"} <= set(OPTIMIZER_PRESETS)
