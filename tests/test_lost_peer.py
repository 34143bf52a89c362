"""A lost peer (train/lost_peer.py): two trainer processes of one CPU device each, process 1
killed with SIGKILL mid-run (between checkpoints, while a save's asynchronous commit is in
flight, and while the run's end waits for its last save); the survivor says so in one line and
exits LOST_PEER_EXIT within the heartbeat timeout plus a step, and rerunning both resumes the
same loss curve."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from laplace_export_helpers import free_port
from shared_fixtures import START_ENV
from xla_env import DEVICES_PER_PROCESS, xla_flags

from train.lost_peer import LOST_PEER_EXIT

REPO = Path(__file__).resolve().parents[1]
# --heartbeat-timeout of these runs: the survivor watches the dead process's pulse this long.
# JAX's own heartbeat timeout, past which it aborts every process, is then 2 * 10 + 10 = 30 s,
# far above a loaded machine's heartbeat stalls
HEARTBEAT_S = 10
STEPS, CKPT_EVERY = 12, 4
# Each process runs train.main in-process with a hook that SIGKILLs process 1 right after step
# `kill_after`, once the checkpoint `committed` is on disk (its commit needs both processes: a
# kill before it would leave an earlier checkpoint the newest) and, when the step is a save step,
# once that save's directory is (orbax may create it in its writing thread; its commit then
# waits for process 1, so the directory is the temporary one, as the lines asserted say), having
# written the time to `killed_at`: a real SIGKILL at a known step and moment.
WORKER = """
import os, signal, sys, time
from pathlib import Path
import jax
from train import main as train_main
from train.loop import Hooks
kill_after, argv = int(sys.argv[1]), sys.argv[4:]
committed, killed_at = Path(sys.argv[2]), Path(sys.argv[3])
def started(step):
    return any(p.name.split(".")[0] == str(step) for p in committed.parent.iterdir())
def after_step(done):
    if done == kill_after and jax.process_index() == 1:
        while not committed.exists() or (done % CKPT_EVERY == 0 and not started(done)):
            time.sleep(0.01)
        killed_at.write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
sys.exit(train_main.main(argv, hooks=Hooks(after_step=after_step)))
"""


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from train.shards import write_shard

    d = tmp_path_factory.mktemp("shards")
    stream = np.random.default_rng(0).integers(0, 256, 60_000)
    write_shard(d / "train_000000.bin", stream)
    return d


def _run_two(shards, run_dir, kill_after=0, killed_at=None):
    """Both processes to their ends: [(exit status, stdout, stderr, end time)] per process."""
    argv = [
        "--config",
        "tiny",
        "--data",
        str(shards / "train_*.bin"),
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--steps",
        str(STEPS),
        "--ckpt-every",
        str(CKPT_EVERY),
        "--log-every",
        "1",
        "--heartbeat-timeout",
        str(HEARTBEAT_S),
        "eval_every=0",
    ]
    port = free_port()
    procs = []
    for i in range(2):
        env = {
            **START_ENV,  # two fresh commands, not children of a process that ran vLLM
            "XLA_FLAGS": xla_flags(DEVICES_PER_PROCESS),
            "JAX_PLATFORMS": "cpu",
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(i),
        }
        committed = run_dir / "checkpoints" / str(CKPT_EVERY)  # the first checkpoint
        worker = f"CKPT_EVERY = {CKPT_EVERY}\n" + WORKER
        command = [sys.executable, "-c", worker, str(kill_after), str(committed), str(killed_at)]
        command += argv
        procs.append(
            subprocess.Popen(
                command,
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            results.append((p.returncode, out, err, time.time()))
    finally:  # a hung pair must not outlive the test
        for p in procs:
            p.kill()
    return results


def _losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m["loss"] for m in map(json.loads, lines) if "loss" in m}


def _complete_steps(run_dir):
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def uninterrupted(shards, tmp_path_factory):
    """The losses of the same two-process run, straight through."""
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    results = _run_two(shards, run)
    assert [r[0] for r in results] == [0, 0], [r[2][-2000:] for r in results]
    return _losses(run)


def _killed(shards, run, kill_after, tmp_path):
    """Run both processes, process 1 SIGKILLed after step `kill_after`: the survivor's stderr,
    once its status, its wait and its one line are checked."""
    killed_at = tmp_path / f"killed_at_{kill_after}"
    (status0, _, err0, ended), (status1, _, err1, _) = _run_two(shards, run, kill_after, killed_at)
    assert status1 == -9, (status0, err0[-3000:], err1[-3000:])  # SIGKILL
    assert status0 == LOST_PEER_EXIT, err0[-3000:]
    waited = ended - float(killed_at.read_text())
    assert waited < HEARTBEAT_S + 10, waited  # the step in flight, then the timeout of watching
    assert "Traceback" not in err0 and "Check failure" not in err0, err0[-3000:]
    # nor the runtime's abort: the survivor's verdict comes before the service marks the dead
    # process (asking the service raced this line, about one run in six)
    assert "Terminating process" not in err0, err0[-3000:]
    last = err0.strip().splitlines()[-1]
    assert last.startswith("lost peer:"), err0[-3000:]
    return last


def _line(run, kill_after, newest, unfinished=""):
    if unfinished:
        unfinished = f"; unfinished, removed by the rerun: {unfinished}"
    return (
        f"lost peer: process 1 of 2 left the run after step {kill_after} (this is process 0); "
        f"newest complete checkpoint: step {newest} ({run / 'checkpoints' / str(newest)})"
        f"{unfinished}; rerun every process with the same command to resume (exit status "
        f"{LOST_PEER_EXIT})"
    )


def _unfinished(run):
    return sorted(
        p.name for p in (run / "checkpoints").iterdir() if "orbax-checkpoint-tmp" in p.name
    )


def test_a_lost_peer_is_one_line_and_a_prompt_exit_and_the_rerun_loses_nothing(
    shards, uninterrupted, tmp_path
):
    """Process 1 is killed between the checkpoints of steps 4 and 8; then (in the rerun, which
    resumes from 4) while step 8's asynchronous save is being committed: the survivor is
    training step 9 and meets the death as a failed collective; then (the rerun resumes from 4
    again, removes 8's unfinished save and commits 8 anew) while the run's end waits for step
    12's save: the survivor is held in orbax's commit barrier, where no error comes back. A last
    rerun of both processes finishes with every step's loss equal to the uninterrupted run's."""
    run = tmp_path / "run"
    assert _killed(shards, run, 6, tmp_path) == _line(run, 6, 4)
    assert _complete_steps(run) == [4]

    # step 8's save in flight: it never commits, 4 stays the newest
    assert _killed(shards, run, 8, tmp_path) == _line(run, 8, 4, "8.orbax-checkpoint-tmp")
    assert _complete_steps(run) == [4]

    # the end of the run, waiting for step 12's save (before the fix: JAX's abort, exit 134)
    assert _killed(shards, run, 12, tmp_path) == _line(run, 12, 8, "12.orbax-checkpoint-tmp")
    assert _complete_steps(run) == [4, 8]

    rerun = _run_two(shards, run)
    assert [r[0] for r in rerun] == [0, 0], [r[2][-2000:] for r in rerun]
    assert f"resumed from {run / 'checkpoints' / '8'} at step 8" in rerun[0][1]
    assert _unfinished(run) == []  # the rerun removed 12's unfinished save, and saved 12 anew
    assert _losses(run) == uninterrupted


def test_a_heartbeat_timeout_under_a_second_is_a_usage_error():
    from train import cli

    with pytest.raises(SystemExit) as stop:
        cli.parse_args(["--heartbeat-timeout", "0"])
    assert stop.value.code == 2


def test_absl_records_are_held_while_the_service_is_asked_then_logged(caplog):
    """orbax logs a failed commit barrier through absl from its save thread: inside the hold it
    is kept back (a lost peer drops it with os._exit), after it logged as it was."""
    from absl import logging as absl_logging

    from train.lost_peer import absl_records_held

    with absl_records_held() as held:
        absl_logging.error("Failed to run 2 Handler Commit operations")
        assert "Failed to run" not in caplog.text
    assert [r.getMessage() for r in held.records] == ["Failed to run 2 Handler Commit operations"]
    assert "Failed to run 2 Handler Commit operations" in caplog.text


def test_orbax_barrier_timeout_counts_as_a_runtime_error():
    """The trainer may meet a lost peer as orbax's TimeoutError raised from JAX's error."""
    import jax

    from train.lost_peer import _jax_runtime_error

    try:
        try:
            raise jax.errors.JaxRuntimeError("Barrier failed")
        except jax.errors.JaxRuntimeError as e:
            raise TimeoutError("Timed out while waiting for async_write_complete barrier.") from e
    except TimeoutError as timeout:
        assert _jax_runtime_error(timeout)
    assert not _jax_runtime_error(TimeoutError("a socket"))
