"""Preemption and full disks lose nothing (train/preemption.py, train/checkpoint.py DiskFull): a
real trainer subprocess sent SIGTERM saves the step it reached and exits PREEMPTED_EXIT, two JAX
processes save the same step when one of them is signalled, a real ENOSPC from a small tmpfs
stops the run with one message and exit 2, and every case resumes on the uninterrupted loss
curve."""

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_train import (  # noqa: F401
    _args,
    _ckpt_steps,
    _free_port,
    _losses,
    _start,
    _start_two_processes,
    _subprocess,
    shards,
)

from train import main as train_main
from train.preemption import PREEMPTED_EXIT

COMMON = ("--steps", "12", "--ckpt-every", "1000", "--log-every", "1", "eval_every=0")


@pytest.fixture(scope="module")
def uninterrupted(shards, tmp_path_factory):  # noqa: F811
    run = tmp_path_factory.mktemp("whole") / "run"
    assert train_main.main(_args(shards, run, *COMMON)) == 0
    return _losses(run)


def _wait_for_logged_steps(run: Path, n: int, procs, timeout: float = 240.0) -> None:
    """Until metrics.jsonl holds `n` steps (the run is mid-way, past its compilation)."""
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        if any(p.poll() is not None for p in procs):
            raise AssertionError([p.communicate() for p in procs])
        time.sleep(0.05)
    raise AssertionError(f"{metrics}: fewer than {n} steps after {timeout} s")


def _preempted_step(out: str) -> int:
    line = next(x for x in out.splitlines() if x.startswith("preempted at step "))
    return int(line.split()[3].rstrip(":"))  # "preempted at step N[ (process i)]: ..."


def _resume_and_compare(shards, run, step, uninterrupted, capsys):  # noqa: F811
    """The rerun, in this process: it ends like the run that was never stopped."""
    capsys.readouterr()
    assert train_main.main(_args(shards, run, *COMMON)) == 0
    stdout = capsys.readouterr().out
    assert f"resumed from {run / 'checkpoints' / str(step)} at step {step}" in stdout
    got = _losses(run)
    assert sorted(got) == list(range(1, 13))
    assert got == uninterrupted


def test_sigterm_saves_the_step_it_reached_and_the_rerun_continues_the_curve(
    shards,  # noqa: F811
    tmp_path,
    uninterrupted,
    capsys,
):
    run = tmp_path / "run"
    proc = _start(_args(shards, run, *COMMON))
    _wait_for_logged_steps(run, 4, [proc])
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # a second signal while it saves: ignored
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == PREEMPTED_EXIT, err[-3000:]
    step = _preempted_step(out)
    assert 4 <= step < 12
    assert f"checkpoint saved to {run / 'checkpoints' / str(step)}; rerun the same command" in out
    assert "SIGTERM received again: ignored until the checkpoint is saved" in err
    assert "Traceback" not in err
    assert _ckpt_steps(run / "checkpoints") == [step]
    assert max(_losses(run)) == step  # the log ends at the saved step: nothing to supersede
    _resume_and_compare(shards, run, step, uninterrupted, capsys)


def test_two_processes_save_the_same_step_when_one_gets_sigterm(shards, tmp_path):  # noqa: F811
    """JAX's preemption service: process 1 alone is signalled, both save one agreed step."""
    run, port = tmp_path / "run", _free_port()
    # many more steps than the notice needs to reach the other process (tiny steps are fast)
    steps = ("--steps", "400", "--ckpt-every", "1000", "--log-every", "1", "eval_every=0")
    procs = _start_two_processes(_args(shards, run, *steps), port)
    try:
        _wait_for_logged_steps(run, 4, procs)
        procs[1].send_signal(signal.SIGTERM)
        outputs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == PREEMPTED_EXIT, err[-3000:]
    steps = {_preempted_step(out) for out, _ in outputs}
    assert len(steps) == 1, [out[-500:] for out, _ in outputs]
    assert all(f"(process {i}): checkpoint saved" in out for i, (out, _) in enumerate(outputs))
    (step,) = steps
    assert 4 <= step < 400 and _ckpt_steps(run / "checkpoints") == [step]


@contextlib.contextmanager
def tmpfs(where: Path, size: str):
    """A real filesystem of `size` at `where` (mounting needs root; CI runs as root)."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)])
    if mounted.returncode != 0:
        pytest.fail("this test needs to mount a tmpfs (run as root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB filesystem: two tiny checkpoints fit, the third does not."""
    with tmpfs(tmp_path / "small", "3m") as where:
        yield where


def _own_lines(stderr: str) -> list[str]:
    """The lines of a run's stderr but XLA's complaint on loading a cached CPU program on an Intel
    CPU: it checks LLVM's tuning flags (+prefer-no-gather, +prefer-no-scatter) as if they were
    instruction sets, so every hit of the tests' compilation cache logs two lines there
    (openxla/xla#44565); the program loads and runs."""
    lines = stderr.strip().splitlines()
    return [line for line in lines if "cpu_aot_loader.cc" not in line]


def test_a_full_disk_stops_with_one_message_and_resumes_once_space_is_freed(
    shards,  # noqa: F811
    small_disk,
    uninterrupted,
    capfd,
):
    """In this process, its output read at the file descriptors (the C++ runtimes' lines too); the
    metrics-log test below runs the command as a process of its own."""
    run = small_disk / "run"
    args = _args(shards, run, *COMMON[:2], "--ckpt-every", "3", "--log-every", "1")
    args += ["eval_every=0", "keep_checkpoints=10"]
    capfd.readouterr()
    assert train_main.main(args) == 2
    stderr = capfd.readouterr().err
    complete = _ckpt_steps(run / "checkpoints")
    assert complete and complete == list(range(3, 3 * len(complete) + 1, 3))
    failed = complete[-1] + 3
    message = (
        f"error: no space left on the device: the checkpoint of step {failed} was not started "
        f"(it needs about "
    )
    assert message in stderr, stderr[-3000:]
    assert f"Complete checkpoints: {', '.join(map(str, complete))}. Free some space" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]
    assert len(_own_lines(stderr)) <= 5, stderr
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(1, len(logged) + 1))
    assert len(logged) == failed  # the save comes after the step's line: nothing lost
    assert not [p for p in (run / "checkpoints").iterdir() if "tmp" in p.name]  # nothing partial

    # free space: grow the filesystem, then the same command resumes from the last complete one
    grow = ["mount", "-o", "remount,size=64m", str(small_disk)]
    subprocess.run(grow, check=True)
    assert train_main.main(args) == 0
    assert f"at step {complete[-1]}" in capfd.readouterr().out
    assert _losses(run) == uninterrupted


def test_a_full_disk_under_the_metrics_log_stops_with_one_message(shards, tmp_path):  # noqa: F811
    """A real ENOSPC on metrics.jsonl (a 1 MB tmpfs filled but for 8 kB): exit 2, one message,
    every complete line kept."""
    with tmpfs(tmp_path / "tiny", "1m") as where:
        free = os.statvfs(where).f_bavail * os.statvfs(where).f_frsize
        (where / "filler").write_bytes(bytes(free - 8192))
        run = where / "run"
        args = _args(shards, run, "--steps", "40", "--ckpt-every", "1000", "--log-every", "1")
        out = _subprocess([*args, "eval_every=0"])
        assert out.returncode == 2, out.stderr[-3000:]
        message = f"error: no space left on the device: writing {run / 'metrics.jsonl'} failed"
        assert message in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
        lines = (run / "metrics.jsonl").read_text().splitlines()
        complete = [json.loads(line) for line in lines[:-1]]
        assert [r["step"] for r in complete] == list(range(1, len(complete) + 1))
        assert len(complete) >= 5
