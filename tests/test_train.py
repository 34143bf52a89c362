"""The trainer: it learns (logging to metrics.jsonl and TensorBoard alike, and tracing the steps
--profile-steps asks for), resumes exactly after SIGKILL, moves across device counts, guards NaN
(logging the learning rate optax applied), refuses or skips damaged checkpoints without losing
logged history, says what it chose at start-up, and its FSDP step equals the single-device step.
Tiny model, a few dozen steps, 8 CPU devices."""

import glob
import hashlib
import json
import math
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from shared_fixtures import START_ENV
from xla_env import DEVICES_PER_PROCESS, xla_flags

from laplace_jax.accounting import training_flops_per_token
from laplace_jax.model import LaplaceLM, abstract_params, init_params
from laplace_jax.optim import OPTIMIZER_PRESETS, OptimizerConfig, learning_rate_schedule
from laplace_jax.sharding import abstract_with_shardings, make_mesh, param_shardings
from laplace_spec.config import ConfigError, get_config
from train import cli
from train import config as train_config
from train import main as train_main
from train.checkpoint import Checkpointer
from train.config import TrainConfig, batch_layout
from train.shards import write_shard
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
        "--config",
        "tiny",
        "--data",
        str(shards / "train_*.bin"),
        "--run-dir",
        str(run_dir),
        "--no-progress",
        *extra,
    ]


def _metrics(run_dir):
    return [
        json.loads(line)
        for line in (Path(run_dir) / "metrics.jsonl").read_text().split("\n")
        if line
    ]


def _losses(run_dir):
    return {m["step"]: m["loss"] for m in _metrics(run_dir)}


def _tensorboard_events(run_dir):
    """Every event of RUN_DIR/tensorboard/, file by file in TensorBoard's (name) order, read with
    tensorboardX's protobufs from the TFRecord framing (length u64, crc, data, crc); a record
    cut short by a SIGKILL ends its file."""
    from tensorboardX.proto import event_pb2

    files = sorted((Path(run_dir) / "tensorboard").glob("events.out.tfevents.*"))
    assert files
    events = []
    for path in files:
        data, at = path.read_bytes(), 0
        while at + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[at : at + 8])
            if at + 12 + n + 4 > len(data):
                break
            events.append((path, event_pb2.Event.FromString(data[at + 12 : at + 12 + n])))
            at += 12 + n + 4
    return events


def _tensorboard_scalars(run_dir):
    """{tag: {step: value}} as TensorBoard shows them: a purge mark (a session start at step S)
    drops what earlier files logged at steps >= S."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for _, event in _tensorboard_events(run_dir):
        if event.session_log.status == event_pb2.SessionLog.START:
            for values in scalars.values():
                for step in [s for s in values if s >= event.step]:
                    del values[step]
        for value in event.summary.value:
            scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def _subprocess(args, devices=8, code=None):
    """`python -m train.main ARGS`, or `python -c CODE ARGS`."""
    env = {**START_ENV, "XLA_FLAGS": xla_flags(devices)}
    command = ["-m", "train.main"] if code is None else ["-c", code]
    return subprocess.run(
        [sys.executable, *command, *args], cwd=REPO, env=env, capture_output=True, text=True
    )


# the trainer with a hook that SIGKILLs the process after step STEP (a crash between checkpoints)
KILL_AFTER = textwrap.dedent(
    """
    import os, signal, sys
    from train import main as m
    kill = lambda step: step == STEP and os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(m.main(sys.argv[1:], hooks=m.Hooks(after_step=kill)))
    """
)


def _snapshot(root):
    """Every file and directory under root with a hash of its bytes."""
    root = Path(root)
    return {
        str(p.relative_to(root)): "dir"
        if p.is_dir()
        else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


def _ckpt_steps(ckpt_dir):
    return sorted(int(p.name) for p in Path(ckpt_dir).iterdir() if p.name.isdigit())


def _truncate_an_array_file(step_dir):
    """Damage a checkpoint: cut its largest parameter data file in half (as a full disk would)."""
    files = [Path(f) for f in glob.glob(str(Path(step_dir) / "params" / "**"), recursive=True)]
    big = max((f for f in files if f.is_file()), key=lambda f: f.stat().st_size)
    with open(big, "r+b") as f:
        f.truncate(big.stat().st_size // 2)


def test_tiny_model_learns_structured_data(shards, tmp_path):
    run = tmp_path / "run"
    val = ("--val-data", str(shards / "val_*.bin"), "eval_every=15")
    status = train_main.main(_args(shards, run, "--steps", "30", *val, "--profile-steps", "3:4"))
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
    # MFU: one denominator for the run, recorded with where it came from (a CPU: the matmul rate
    # timed once at start; before, it was timed again every minute and the best one kept)
    assert "measured fp32 matmul rate" in cfg["peak"]["source"]
    timed = [r for r in m if r["tokens_per_s"] is not None]  # step 1 compiles
    assert len(timed) >= 20
    for r in timed:
        want = r["tokens_per_s"] * training_flops_per_token(CFG) / cfg["peak"]["flops_per_s"]
        assert r["mfu"] == pytest.approx(want, rel=1e-9)
    from train.plot import plot

    png = plot(run)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # TensorBoard holds every numeric field of metrics.jsonl, at the same steps (float32)
    expected = {}
    for r in m:
        for k, v in r.items():
            if k != "step" and v is not None:
                expected.setdefault(k, {})[r["step"]] = float(np.float32(v))
    assert {"loss", "val_loss", "grad_norm", "lr", "tokens_per_s", "mfu"} <= set(expected)
    assert _tensorboard_scalars(run) == expected
    # --profile-steps 3:4: one jax.profiler trace, for TensorBoard's profile plugin and Perfetto
    (trace,) = (run / "profile").glob("plugins/profile/*/*.xplane.pb")
    assert trace.stat().st_size > 0
    assert (trace.parent / "perfetto_trace.json.gz").is_file()


def test_sigkill_between_checkpoints_then_resume_gives_the_same_losses(shards, tmp_path, capsys):
    """The killed run is a process of its own (SIGKILL); the rerun runs in this process."""
    common = ("--steps", "14", "--ckpt-every", "4", "keep_checkpoints=5", "eval_every=0")
    whole = tmp_path / "whole"
    assert train_main.main(_args(shards, whole, *common)) == 0
    expected = _losses(whole)

    killed = tmp_path / "killed"
    out = _subprocess(_args(shards, killed, *common), code=KILL_AFTER.replace("STEP", "10"))
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    assert max(_losses(killed)) == 10  # it logged past its last checkpoint (8), then died
    crashed_log = _metrics(killed)

    capsys.readouterr()
    assert train_main.main(_args(shards, killed, *common)) == 0
    stdout = capsys.readouterr().out
    assert "resumed from" in stdout
    resumed_at = int(stdout.split("at step ")[1].split()[0])
    assert resumed_at in (4, 8)
    got = _losses(killed)
    assert sorted(got) == list(range(1, 15))
    for step in range(resumed_at + 1, 15):
        assert got[step] == expected[step], (step, got[step], expected[step])
    # what the killed run logged after the checkpoint is kept, marked, out of metrics.jsonl
    superseded = [
        json.loads(x) for x in (killed / "metrics.superseded.jsonl").read_text().splitlines()
    ]
    assert superseded == [
        {**r, "superseded_at": resumed_at} for r in crashed_log if r["step"] > resumed_at
    ]
    assert f"{10 - resumed_at} lines of metrics.jsonl after step {resumed_at}" in stdout
    # TensorBoard: the resumed run's event file starts by purging the steps after its checkpoint
    # and logs the same steps and losses as metrics.jsonl from there (what the killed run had
    # not flushed is lost there, not in metrics.jsonl)
    events = _tensorboard_events(killed)
    newest = max(path for path, _ in events)
    marks = [e.step for path, e in events if path == newest and e.HasField("session_log")]
    assert marks == [resumed_at + 1]
    tb = _tensorboard_scalars(killed)["loss"]
    assert set(tb) <= set(got)
    assert {s: tb[s] for s in tb if s > resumed_at} == {
        s: float(np.float32(got[s])) for s in range(resumed_at + 1, 15)
    }


def test_restore_on_four_devices_gives_the_same_next_loss(shards, tmp_path, capsys):
    """Written on 8 devices, restored onto a mesh of 4 of them (in this process: the restore
    reads onto the mesh's shardings, whatever else the process sees)."""
    a = tmp_path / "a"
    assert train_main.main(_args(shards, a, "--steps", "6", "--ckpt-every", "6")) == 0
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert train_main.main(_args(shards, a, "--steps", "7")) == 0  # 8 devices
    capsys.readouterr()
    assert train_main.main(_args(shards, b, "--steps", "7", "--mesh", "fsdp=4")) == 0
    stdout = capsys.readouterr().out
    assert "mesh fsdp=4" in stdout and "resumed from" in stdout
    assert f"resumed from {b / 'checkpoints' / '6'} at step 6" in stdout
    la, lb = _losses(a)[7], _losses(b)[7]
    assert abs(la - lb) <= 1e-5 * abs(la), (la, lb)
    # step 7 from the checkpoint restored onto 4 devices gives the 8-device run's parameters (to
    # the FSDP test's tolerance), which differ from step 6's by far more than that
    params = {}
    for run in (a, b):
        ckpt = Checkpointer(run / "checkpoints")
        assert ckpt.all_steps() == [6, 7]
        params[run] = {s: _host(_restore_params(ckpt, s)) for s in (6, 7)}
        ckpt.close()
    jax.tree.map(np.testing.assert_array_equal, params[a][6], params[b][6])
    moved = jax.tree.map(lambda x, y: np.abs(x - y).max(), params[a][7], params[a][6])
    assert min(jax.tree.leaves(moved)) > 1e-4
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=0, atol=5e-5), params[b][7], params[a][7]
    )


def _restore_params(ckpt, step):
    """A checkpoint's parameters, read with orbax's metadata (no trainer code involved)."""
    import orbax.checkpoint as ocp

    return ckpt.manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore()))[
        "params"
    ]


def test_nan_steps_are_skipped_then_the_run_stops_with_a_good_checkpoint(shards, tmp_path, capsys):
    run = tmp_path / "run"
    nan_steps = {3, 5, 6}  # out-of-range ids make the loss NaN

    def poison(step, tokens):
        return np.full_like(tokens, -(2**30)) if step in nan_steps else tokens

    args = _args(shards, run, "--steps", "12", "--ckpt-every", "2", "max_bad_steps=2")
    assert train_main.main(args, hooks=train_main.Hooks(batch=poison)) == 2
    text = capsys.readouterr().out
    assert "stopping: 2 non-finite steps in a row" in text
    m = {r["step"]: r for r in _metrics(run)}
    assert m[3]["applied"] is False and m[3]["loss"] is None
    assert m[4]["applied"] is True and math.isfinite(m[4]["loss"])
    assert max(m) == 6
    # the logged lr is the one optax applied: the schedule at the count of applied updates, which
    # a skipped step does not advance (step 4 runs at count 2, not 3)
    schedule = learning_rate_schedule(
        OptimizerConfig(**json.loads((run / "config.json").read_text())["optimizer"])
    )
    applied_before = 0
    for step in range(1, 7):
        assert m[step]["lr"] == pytest.approx(float(schedule(applied_before)), rel=1e-6), step
        applied_before += step not in nan_steps
    assert float(schedule(2)) != pytest.approx(float(schedule(3)), rel=1e-3)
    steps = _ckpt_steps(run / "checkpoints")
    assert steps[-1] == 4  # none written while the streak was on
    # the run resumes from it and trains on
    assert train_main.main(_args(shards, run, "--steps", "8", "--ckpt-every", "2")) == 0
    m = {r["step"]: r for r in _metrics(run)}
    assert sorted(m) == list(range(1, 9))  # the log after the checkpoint was set aside
    assert all(math.isfinite(m[s]["loss"]) for s in range(4, 9))
    superseded = [
        json.loads(x) for x in (run / "metrics.superseded.jsonl").read_text().splitlines()
    ]
    assert [(r["step"], r["superseded_at"], r["applied"]) for r in superseded] == [
        (5, 4, False),
        (6, 4, False),
    ]


def test_every_checkpoint_corrupt_stops_changing_nothing_and_restart_starts_over(
    shards, tmp_path, capsys
):
    """The user scenario of issue 11: both checkpoints of a finished run damaged, the command
    rerun for more steps. It must not start over silently nor rewrite the log."""
    run = tmp_path / "run"
    common = ("--ckpt-every", "10", "eval_every=0")
    assert train_main.main(_args(shards, run, "--steps", "20", *common)) == 0
    assert _ckpt_steps(run / "checkpoints") == [10, 20]
    for step in (10, 20):
        _truncate_an_array_file(run / "checkpoints" / str(step))
    before = _snapshot(run)
    old_log = (run / "metrics.jsonl").read_bytes()
    capsys.readouterr()

    assert train_main.main(_args(shards, run, "--steps", "30", *common)) == 2
    err = capsys.readouterr().err
    assert f"error: no checkpoint in {run / 'checkpoints'} can be restored" in err
    for step in (10, 20):
        assert f"{run / 'checkpoints' / str(step)}: restore: ValueError: OUT_OF_RANGE" in err
    assert "nothing was changed" in err and "--restart" in err
    assert "Traceback" not in err
    assert _snapshot(run) == before  # metrics.jsonl, config.json, checkpoints: all untouched

    assert train_main.main(_args(shards, run, "--steps", "30", "--restart", *common)) == 0
    out = capsys.readouterr().out
    aside = [p for p in run.iterdir() if p.name.startswith("restarted-")]
    assert len(aside) == 1
    moved = "checkpoints, metrics.jsonl, tensorboard"
    assert f"restart: moved {moved} into {aside[0]}; starting at step 0" in out
    assert (aside[0] / "metrics.jsonl").read_bytes() == old_log
    assert _snapshot(aside[0] / "tensorboard") == {
        k.removeprefix("tensorboard/"): v for k, v in before.items() if k.startswith("tensorboard/")
    }
    assert _snapshot(aside[0] / "checkpoints") == {
        k.removeprefix("checkpoints/"): v for k, v in before.items() if k.startswith("checkpoints/")
    }
    assert [r["step"] for r in _metrics(run)] == list(range(1, 31))
    assert _ckpt_steps(run / "checkpoints") == [10, 20, 30]
    assert "resumed from" not in out


def test_corrupt_newest_checkpoint_resumes_from_the_older_and_keeps_the_log(
    shards, tmp_path, capsys
):
    run = tmp_path / "run"
    common = ("--steps", "8", "--ckpt-every", "4", "eval_every=0")
    assert train_main.main(_args(shards, run, *common)) == 0
    first = _metrics(run)
    _truncate_an_array_file(run / "checkpoints" / "8")
    capsys.readouterr()

    assert train_main.main(_args(shards, run, *common)) == 0
    out, err = capsys.readouterr()
    newest = run / "checkpoints" / "8"
    assert f"warning: checkpoint {newest} is corrupt (restore: ValueError: OUT_OF_RANGE" in err
    assert (
        f"warning: moved corrupt checkpoint {newest} to {run / 'checkpoints-corrupt' / '8'}" in err
    )
    assert f"resumed from {run / 'checkpoints' / '4'} at step 4" in out
    assert "4 lines of metrics.jsonl after step 4" in out
    # metrics.jsonl is one clean curve (the same losses again: resuming is exact); the first
    # run's steps 5-8 are kept in metrics.superseded.jsonl
    again = _metrics(run)
    assert [r["step"] for r in again] == list(range(1, 9))
    assert again[:4] == first[:4]
    assert [r["loss"] for r in again[4:]] == [r["loss"] for r in first[4:]]
    superseded = [
        json.loads(x) for x in (run / "metrics.superseded.jsonl").read_text().splitlines()
    ]
    assert superseded == [{**r, "superseded_at": 4} for r in first[4:]]
    assert _ckpt_steps(run / "checkpoints") == [4, 8]
    assert (run / "checkpoints-corrupt" / "8" / "params").is_dir()


def _start(args, devices=8, env=None):
    """`python -m train.main ARGS` in the background, on `devices` CPU devices."""
    env = {
        **START_ENV,  # a fresh command: not the child of a process that ran vLLM (its LD_PRELOAD)
        "XLA_FLAGS": xla_flags(devices),
        **(env or {}),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "train.main", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _start_two_processes(args, port):
    """The trainer as 2 JAX processes (jax.distributed on 127.0.0.1) of DEVICES_PER_PROCESS CPU
    devices each."""
    return [
        _start(
            args,
            devices=DEVICES_PER_PROCESS,
            env={
                "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": str(i),
            },
        )
        for i in range(2)
    ]


def _two_processes(args, port):
    """The two processes of `_start_two_processes`, run to the end."""
    procs = _start_two_processes(args, port)
    try:
        outputs = [p.communicate(timeout=300) for p in procs]
    finally:  # a hung pair (processes out of step) must not outlive the test
        for p in procs:
            p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fatal_lines(err: str) -> str:
    """A stderr without its stack-trace frames: what a process that aborted said before it did
    (XLA prints dozens of `@ 0x...` frames after the message, which would crowd it out)."""
    return "\n".join(line for line in err.splitlines() if not line.lstrip().startswith("@ 0x"))


def test_two_processes_agree_on_the_checkpoint_when_one_finds_it_corrupt(shards, tmp_path):
    """Only process 0's shards of the newest checkpoint are damaged: process 1 reads its own
    fine, yet both skip it and resume from the same older step (and neither hangs)."""
    run = tmp_path / "run"
    common = ("--steps", "4", "--ckpt-every", "2", "eval_every=0")
    for rc, _, err in _two_processes(_args(shards, run, *common), _free_port()):
        assert rc == 0, _fatal_lines(err)[-3000:]
    for f in (run / "checkpoints" / "4" / "params").glob("ocdbt.process_0/d/*"):
        f.write_bytes(f.read_bytes()[:10])
    (p0, out0, err0), (p1, out1, err1) = _two_processes(_args(shards, run, *common), _free_port())
    assert p0 == 0 and p1 == 0, (p0, p1, _fatal_lines(err0)[-3000:], _fatal_lines(err1)[-3000:])
    assert "is corrupt (restore: ValueError: OUT_OF_RANGE" in err0
    assert "is corrupt (another process found it corrupt" in err1
    assert f"resumed from {run / 'checkpoints' / '2'} at step 2" in out0
    assert _ckpt_steps(run / "checkpoints") == [2, 4]
    assert (run / "checkpoints-corrupt" / "4").is_dir()


def test_layout_mismatch_stops_the_run_without_touching_it(shards, tmp_path, capsys):
    """A checkpoint whose meta claims this model but whose arrays are another's (one layer)."""
    run = tmp_path / "run"
    args = ("--steps", "2", "--ckpt-every", "2", "eval_every=0")
    assert train_main.main(_args(shards, run, *args, "n_layers=1")) == 0
    meta_file = run / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["model"]["n_layers"] = meta["config"]["n_layers"] = CFG.n_layers
    meta_file.write_text(json.dumps(meta))
    before = _snapshot(run)
    capsys.readouterr()

    assert train_main.main(_args(shards, run, "--steps", "4", "eval_every=0")) == 2
    err = capsys.readouterr().err
    assert f"error: checkpoint {run / 'checkpoints' / '2'} holds other arrays" in err
    assert "params/layer_1/w12/kernel: in this run, not in the checkpoint" in err
    assert "nothing was changed" in err and "Traceback" not in err
    assert _snapshot(run) == before


def test_startup_notices_say_what_was_chosen(shards, tmp_path, capsys):
    """A JSON model config, a schedule fitted to the run, the windows' context (no end-of-text
    id: no resets, so a target's context is its position), and parameters that cannot be split
    over a 3-device mesh: one line each."""
    model_file = tmp_path / "model.json"
    model_file.write_text(CFG.to_json())
    run = tmp_path / "run"
    args = _args(shards, run, "--steps", "3", "--mesh", "fsdp=3", "--global-batch-tokens", "384")
    args[args.index("tiny")] = str(model_file)
    assert train_main.main(args) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert notes[0] == (
        f"note: {model_file} names no preset (laplace-3b, small, tiny): the training and "
        "optimizer settings it leaves unset are the 'small' presets' (set them as key=value, or "
        "in the file)"
    )
    small = OPTIMIZER_PRESETS["small"]
    assert notes[1] == (
        "note: the learning-rate schedule is fitted to this run: total_steps=3 (the run's steps; "
        f"preset {small.total_steps}), warmup_steps=1 (a tenth of the run; preset "
        f"{small.warmup_steps}); set total_steps=N / warmup_steps=N to choose"
    )
    assert notes[2] == (
        "note: context (no resets) of the scored tokens at seq_len 64 (64 sampled windows): "
        ">= 1k tokens 0.0%, >= 8k tokens 0.0%, >= 64k tokens 0.0%; median 32 tokens"
    )  # the median of 1 .. 64 is 32.5, printed without decimals
    assert notes[3].startswith(  # CPU devices are not in the peak table
        "note: MFU against a measured fp32 matmul rate, "
    ) and notes[3].endswith("no cpu device kind 'cpu'; set peak_flops=F")
    # every matrix with an fsdp axis: the embedding, the LM head and each layer's conv, qkvg, out,
    # w12, w3 kernels (no size among 64, 128, 192, 256, 320 divides by 3)
    assert notes[4].startswith(
        "note: 12 parameters are replicated, not sharded: their fsdp axis does not divide by "
        "fsdp=3 (Muon orthogonalises each whole on every device): "
        "embed/embedding [320, 64]: [320, 64] on fsdp=3; layer_0/conv/kernel [64, 4]: [64] on "
    )
    assert notes[4].endswith("; and 8 more")
    assert len(notes) == 5
    config = json.loads((run / "config.json").read_text())
    assert config["optimizer"]["lr"] == OPTIMIZER_PRESETS["small"].lr
    assert config["train"]["log_every"] == train_config.TRAIN_PRESETS["small"].log_every
    assert config["data"]["context_shares"]["share_ge_1k"] == 0.0


def test_explicit_settings_get_no_notice():
    cfg = cli.resolve_configs(
        cli.parse_args(["--config", "tiny", "--steps", "30", "total_steps=100", "warmup_steps=7"])
    )
    assert (cfg.optim.total_steps, cfg.optim.warmup_steps, cfg.notices) == (100, 7, ())
    # the 3B recipe's schedule already spans its run
    cfg = cli.resolve_configs(cli.parse_args(["--config", "laplace-3b"]))
    assert cfg.notices == () and cfg.optim == OPTIMIZER_PRESETS["laplace-3b"]
    # only total_steps fitted: warmup stays the preset's, and the note says so
    cfg = cli.resolve_configs(cli.parse_args(["--config", "tiny", "--steps", "400"]))
    assert cfg.optim.warmup_steps == OPTIMIZER_PRESETS["tiny"].warmup_steps
    assert cfg.notices == (
        "note: the learning-rate schedule is fitted to this run: total_steps=400 (the run's "
        "steps; preset 200), warmup_steps=10 (the preset's); set total_steps=N / "
        "warmup_steps=N to choose",
    )


def _step_setup(mesh, opt_overrides=()):
    opt_cfg, _ = train_config.optimizer_config("tiny", {}, list(opt_overrides), 10)
    ps = param_shardings(CFG, mesh)
    abstract = abstract_with_shardings(abstract_params(CFG), ps)
    tx, schedule, os_ = train_config.build_optimizer(opt_cfg, abstract, ps, mesh)
    step, _ = make_train_step(
        LaplaceLM(CFG), tx, mesh, ps, os_, grad_clip=1.0, lr_schedule=schedule
    )
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
    tx, ps, os_, step = _step_setup(mesh, ["warmup_steps=5", "lr=0.01"])
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
    # the first applied update runs at warmup's first rate, lr * 1/5, not the second step's 2/5
    assert float(m["lr"]) == pytest.approx(0.01 / 5, rel=1e-6)
    state, m = step(state, good)
    assert float(m["lr"]) == pytest.approx(0.01 * 2 / 5, rel=1e-6)
    changed = jax.tree.map(
        lambda a, b: not np.array_equal(a, b), _host(state["params"]), before["params"]
    )
    assert all(jax.tree.leaves(changed))


def test_fsdp_and_2d_mesh_steps_equal_the_1_device_step():
    """1 device, FSDP over 8, and data=2 x fsdp=4 (parameters sharded over 4, replicated over 2;
    the batch over all 8): the same losses to 1e-6 and parameters after two steps to 5e-5,
    against updates of ~1e-2.

    The reduction order differs between meshes; AdamW's first steps divide gradients by their
    own magnitude, which turns fp32 rounding of near-zero gradients into ~1e-5 changes.
    """
    host = _host(init_params(CFG, jax.random.key(1)))
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 256, (1, 8, CFG.seq_len + 1)).astype(np.int32) for _ in range(2)]
    results = []
    for n, data in ((1, 1), (8, 1), (8, 2)):
        mesh = make_mesh(n, data=data)
        tx, ps, os_, step = _step_setup(mesh)
        state = _state(tx, ps, os_, host, mesh)
        losses = []
        for b in batches:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        w12 = state["params"]["layer_0"]["w12"]["kernel"]
        assert len(w12.sharding.device_set) == n
        assert w12.addressable_shards[0].data.shape[0] == CFG.d_model // (n // data)
        results.append((losses, _host(state["params"])))
    (l1, p1), *others = results
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), p1, host)
    assert min(jax.tree.leaves(moved)) > 1e-4  # the step really changed every parameter
    for losses, params in others:
        np.testing.assert_allclose(losses, l1, rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=5e-5), params, p1)


def test_muon_modes_train_bit_identically_on_one_mesh():
    """Five steps of `tiny` on fsdp=8 with Muon in `single`, `gather` and `a2a`: every loss and
    every final parameter the same bits (one Newton-Schulz arithmetic for every layout, design
    s4.2; `python -m bench.muon` checks twenty steps of `small` at XLA:CPU's default level)."""
    host = _host(init_params(CFG, jax.random.key(2)))
    rng = np.random.default_rng(2)
    batches = [rng.integers(0, 256, (1, 8, CFG.seq_len + 1)).astype(np.int32) for _ in range(5)]
    mesh = make_mesh(8)
    results = {}
    for mode in ("single", "gather", "a2a"):
        tx, ps, os_, step = _step_setup(mesh, [f"muon_mode={mode}"])
        state = _state(tx, ps, os_, host, mesh)
        losses = []
        for b in batches:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        results[mode] = (losses, _host(state["params"]))
    losses, params = results["single"]
    for mode in ("gather", "a2a"):
        assert results[mode][0] == losses, mode
        assert all(jax.tree.leaves(jax.tree.map(np.array_equal, results[mode][1], params))), mode


def test_mesh_flag():
    assert dict(cli.mesh_from_flag("fsdp=4").shape) == {"fsdp": 4}
    assert dict(cli.mesh_from_flag("data=2,fsdp=4").shape) == {"data": 2, "fsdp": 4}
    assert dict(cli.mesh_from_flag("fsdp=2,context=4").shape) == {"fsdp": 2, "context": 4}
    mesh = cli.mesh_from_flag("data=2,fsdp=2,context=2")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "context": 2}
    for bad in ("fsdp=x", "data=2", "tp=2,fsdp=4", "data=3,fsdp=3", "fsdp=4,context=0"):
        with pytest.raises(ConfigError):
            cli.mesh_from_flag(bad)


def test_bad_profile_steps_is_one_error_line(tmp_path, capsys):
    assert cli.parse_profile_steps("5:7") == (5, 7) and cli.parse_profile_steps("3:3") == (3, 3)
    assert cli.parse_profile_steps(None) is None
    for bad in ("5", "5:", "a:b", "7:5", "-1:3", "0:2", "3:4:5", "2.5:4", ""):
        with pytest.raises(ConfigError, match="^--profile-steps expects A:B"):
            cli.parse_profile_steps(bad)
    args = ["--config", "tiny", "--run-dir", str(tmp_path / "run"), "--profile-steps=7:5"]
    assert train_main.main(args) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: --profile-steps expects A:B, two step numbers with 1 <= A <= B (e.g. 5:7), "
        "got '7:5'\n"
    )
    assert not (tmp_path / "run").exists()


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
    args = cli.parse_args(
        ["--config", "tiny", "d_model=128", "d_v=32", "lr=0.05", "log_every=3", "--steps", "17"]
    )
    cfg = cli.resolve_configs(args)
    model, opt, tr = cfg.model, cfg.optim, cfg.train
    assert (model.d_model, opt.lr, tr.log_every, tr.steps, opt.total_steps) == (
        128,
        0.05,
        3,
        17,
        17,
    )
    with pytest.raises(ConfigError, match="unknown config key 'colour'"):
        cli.resolve_configs(cli.parse_args(["colour=red"]))
    with pytest.raises(ConfigError, match="lr expects float"):
        cli.resolve_configs(cli.parse_args(["lr=fast"]))
    assert train_main.main(["--config", "tiny", "bogus=1"]) == 2
    for hook in ("--debug-nan-at-step", "--debug-sigkill-at-step"):  # in-process hooks only
        with pytest.raises(SystemExit):
            cli.parse_args([hook, "3"])


def test_batch_layout():
    cfg = TrainConfig(global_batch_tokens=524_288, micro_batch_size=64)
    assert batch_layout(cfg, 2048, 64) == (256, 4, 64)  # the 3B recipe on 64 NeuronCores
    with pytest.raises(ConfigError, match="multiple of seq_len"):
        batch_layout(TrainConfig(global_batch_tokens=1000), 64, 1)
    with pytest.raises(ConfigError, match="divide over the 8 devices"):
        batch_layout(TrainConfig(global_batch_tokens=4 * 64), 64, 8)
    # 3B at 32,768 tokens: 16 sequences cannot go over 64 devices, but over 16 context groups
    long = TrainConfig(global_batch_tokens=524_288)
    with pytest.raises(ConfigError, match="64 devices of the mesh.*context=S"):
        batch_layout(long, 32_768, 64)
    assert batch_layout(long, 32_768, 64, context=4) == (16, 1, 16)
    with pytest.raises(ConfigError, match="into context=3 equal slices"):
        batch_layout(long, 32_768, 48, context=3)


def test_optimizer_presets_exist_for_the_train_presets():
    assert {"small", "tiny", "laplace-3b"} <= set(OPTIMIZER_PRESETS)


def test_data_that_matches_no_shard_is_one_error_line(tmp_path, capsys):
    args = ["--config", "tiny", "--data", str(tmp_path / "none_*.bin"), "--run-dir", str(tmp_path)]
    assert train_main.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no token shards match") and "Traceback" not in err
