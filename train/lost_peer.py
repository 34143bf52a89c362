"""A lost peer: a process of a multi-process run that dies without notice (a kernel panic, an
OOM kill, a spot reclaim), and how the processes left say so and stop.

Every training step all-reduces across the processes, so within one step of a death XLA
raises `jax.errors.JaxRuntimeError` in the survivors (on CPU, Gloo's "Connection reset by
peer"). The error does not say whether a peer died or something else broke, so
`stop_if_peer_lost` asks JAX's coordination service which processes are alive
(`DistributedRuntimeClient.get_live_nodes`), polling until the service has marked the dead one
(it does after `heartbeat_timeout` seconds without its heartbeats). A process missing from the
answer is a lost peer; when every process stays alive, the error is not ours to explain and it
goes on. The error may also reach the trainer as orbax's (a save whose commit barrier failed),
with JAX's error as its cause. (JAX's `jax_enable_recoverability`, which would keep the service
from telling the others to fail, is not used: with it, two-process start-ups aborted now and
then in the test suite.) The runtime's own C++ lines about the dead task may come before or
after ours.

While the service is asked, Python's log records through absl (orbax's) are held back: the
service marks the dead process at the same moment a save in flight fails its commit barrier,
and orbax's background thread then logs that failure with a traceback. A lost peer explains
it (the save is not committed, the line names the newest complete checkpoint), so the held
records are dropped when a peer is lost and logged as they were when none is.

The survivor then prints one line (which process was lost, the step reached, the newest
complete checkpoint, what to do) and leaves at once with `LOST_PEER_EXIT` through `os._exit`:
a normal exit would run JAX's shutdown, which waits at a barrier for the lost process (the
shutdown timeout, 5 minutes) and then aborts, and orbax's wait for a save in flight, whose
commit needs every process. That save is simply not finished: orbax writes a step into a
temporary directory and renames it only once every process has written its part (its commit
protocol), so an unfinished save leaves no directory a rerun takes for a checkpoint; the rerun
restores the newest step every process committed (train/checkpoint.py `complete_steps`).

Not covered: the loss of process 0, which runs the coordination service. The other processes'
distributed clients then fail their next call to it within a second and abort the process from
their own thread (JAX's missed-heartbeat callback, exit 134). jax 0.10 takes no other callback
from Python: its client factory accepts a `missed_heartbeat_callback`, but calling a Python one
ends in `std::bad_cast` (the status it is handed has no Python form). The survivors still stop
promptly and the rerun resumes as above; only the line is missing.

The time from a death to the survivors' exit is at most the heartbeat timeout plus the step in
flight: `--heartbeat-timeout` (DEFAULT_HEARTBEAT_TIMEOUT_S), passed to
`jax.distributed.initialize`. Importing this module imports no JAX (train/cli.py reads its
constants).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time

# EX_UNAVAILABLE of sysexits.h: a service the run needs (a peer process) is gone; rerunning
# every process resumes. Apart from 0 (finished), 1 (a bug), 2 (a stop with a message) and
# 75 (preempted, train/preemption.py).
LOST_PEER_EXIT = 69
# Seconds without a process's heartbeat before the coordination service declares it dead. Long
# enough for a loaded 64-core host or a congested network between hosts to miss a few beats
# (they are sent every few seconds by a thread of their own, not by the training step); short
# against a step of minutes' checkpoints. JAX's default is 100.
DEFAULT_HEARTBEAT_TIMEOUT_S = 60


@dataclasses.dataclass
class Progress:
    """What the line reports, kept current by the trainer (one run per process)."""

    step: int = 0  # the last step every process finished
    checkpointer: object = None  # train.checkpoint.Checkpointer, once the run has one
    heartbeat_timeout_s: float | None = None  # set by initialize_distributed


PROGRESS = Progress()


def lost_peer_line(lost: list[int]) -> str:
    """The one line a survivor prints."""
    import jax

    ckpt = PROGRESS.checkpointer
    complete = ckpt.complete_steps() if ckpt is not None else []
    newest = f"step {complete[-1]} ({ckpt.directory / str(complete[-1])})" if complete else "none"
    return (
        f"lost peer: process {', '.join(map(str, lost))} of {jax.process_count()} left the run "
        f"after step {PROGRESS.step} (this is process {jax.process_index()}); newest complete "
        f"checkpoint: {newest}; rerun every process with the same command to resume (exit "
        f"status {LOST_PEER_EXIT})"
    )


def leave(line: str) -> None:
    """Print `line` and exit with LOST_PEER_EXIT now, without JAX's or orbax's shutdown (they
    would wait for the lost process)."""
    sys.stdout.flush()
    sys.stderr.flush()
    # one write of the whole line: the runtime's C++ threads log to the same stream meanwhile,
    # and a line printed in pieces can take one of theirs in its middle
    os.write(sys.stderr.fileno(), f"\n{line}\n".encode())
    os._exit(LOST_PEER_EXIT)


def lost_processes(client, timeout_s: float, poll_s: float = 0.05) -> list[int]:
    """The processes the coordination service no longer counts alive, polled for up to
    `timeout_s` (by its heartbeat timeout it has marked a dead process); [] if none."""
    import jax

    everyone = list(range(jax.process_count()))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            alive = client.get_live_nodes(everyone)
        except jax.errors.JaxRuntimeError:  # the service is gone with its process, 0
            return [0]
        lost = [p for p in everyone if p not in alive]
        if lost or time.monotonic() > deadline:
            return lost
        time.sleep(poll_s)


class _HeldRecords(logging.Filter):
    """Keeps the records of the logger it filters instead of letting them through."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


@contextlib.contextmanager
def absl_records_held():
    """Hold absl's log records (orbax logs through absl) inside the block; log them at its end.
    A block left by `leave` (os._exit) never logs them."""
    logger = logging.getLogger("absl")
    held = _HeldRecords()
    logger.addFilter(held)
    try:
        yield held
    finally:
        logger.removeFilter(held)
        for record in held.records:
            logger.handle(record)


def _jax_runtime_error(error: BaseException | None) -> bool:
    """Whether `error` or one of its causes is JAX's runtime error (a failed collective, or a
    failed barrier under orbax's TimeoutError)."""
    import jax

    while error is not None:
        if isinstance(error, jax.errors.JaxRuntimeError):
            return True
        error = error.__cause__
    return False


def stop_if_peer_lost(error: BaseException) -> None:
    """After `error` in a multi-process run: when a peer is gone, say so and exit (does not
    return); else return, and the caller re-raises."""
    from jax._src import distributed

    client = distributed.global_state.client
    timeout = PROGRESS.heartbeat_timeout_s
    if not _jax_runtime_error(error) or client is None or timeout is None:
        return
    with absl_records_held():
        lost = lost_processes(client, timeout + 5.0)  # + the service's own sweep interval
        if lost:
            leave(lost_peer_line(lost))


def initialize_distributed(heartbeat_timeout_s: int, **kwargs) -> None:
    """`jax.distributed.initialize(**kwargs)` with `heartbeat_timeout_s`."""
    import jax

    jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_s, **kwargs)
    PROGRESS.heartbeat_timeout_s = heartbeat_timeout_s
