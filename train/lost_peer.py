"""A lost peer: a process of a multi-process run that dies without notice (a kernel panic, an
OOM kill, a spot reclaim), and how the processes left say so and stop.

Every training step all-reduces across the processes, so within one step of a death XLA
raises `jax.errors.JaxRuntimeError` in the survivors (on CPU, Gloo's "Connection reset by
peer"). The error does not say whether a peer died or something else broke. Each process
therefore keeps a pulse: a thread of its own adds one to its counter in the coordination
service's key-value store every `pulse_s` seconds (`Pulse`). After such an error a survivor
watches the counters (`silent_processes`): a process whose counter has not moved twice within
`--heartbeat-timeout` seconds is lost; when every counter moves, the error is not ours to
explain and it goes on.

Why not the service's own heartbeats: the service marks a process dead after its heartbeat
timeout, and at that same moment (JAX's service is not recoverable) it tells every other
process to fail, and their clients abort from their own thread (exit 134, a stack dump). Its
list of live processes (`get_live_nodes`) changes only at that moment, so a survivor that
asked it raced its own abort, and lost about one time in six here. (JAX's
`jax_enable_recoverability` would keep the service from telling the others to fail; it is not
used: the service calls it experimental, and with it the shutdown barrier at a run's end no
longer waits for every process.) So the service's heartbeat timeout is set well beyond ours
(`runtime_heartbeat_timeout_s`): the survivors' verdict and exit come first, and the runtime's
abort stays as a backstop for a survivor that never reaches ours (one held in a collective that
does not fail).

While the counters are watched, Python's log records through absl (orbax's) are held back: a
save in flight fails its commit barrier once a process is gone, and orbax's background thread
then logs that failure with a traceback. A lost peer explains it (the save is not committed,
the line names the newest complete checkpoint), so the held records are dropped when a peer is
lost and logged as they were when none is.

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
their own thread (exit 134). jax 0.10 takes no other callback from Python: its client factory
accepts a `missed_heartbeat_callback`, but calling a Python one ends in `std::bad_cast` (the
status it is handed has no Python form). The survivors still stop promptly and the rerun
resumes as above; only the line is missing.

The time from a death to the survivors' exit is at most the heartbeat timeout plus the step in
flight: `--heartbeat-timeout` (DEFAULT_HEARTBEAT_TIMEOUT_S). Importing this module imports no
JAX (train/cli.py reads its constants).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time

# EX_UNAVAILABLE of sysexits.h: a service the run needs (a peer process) is gone; rerunning
# every process resumes. Apart from 0 (finished), 1 (a bug), 2 (a stop with a message) and
# 75 (preempted, train/preemption.py).
LOST_PEER_EXIT = 69
# Seconds a process's pulse may stay still before it counts as lost. Long enough for a loaded
# 64-core host or a congested network between hosts to miss a few beats (a thread of its own
# beats, not the training step); short against a step of minutes' checkpoints.
DEFAULT_HEARTBEAT_TIMEOUT_S = 60
PULSE_KEY = "laplace/pulse/"  # + the process index: its counter in the service's key-value store


def pulse_s(heartbeat_timeout_s: float) -> float:
    """Seconds between two beats: at least five beats within the timeout, at most one a second
    (one small request to the service per process)."""
    return min(1.0, heartbeat_timeout_s / 5)


def runtime_heartbeat_timeout_s(heartbeat_timeout_s: int) -> int:
    """The coordination service's own heartbeat timeout, after which it aborts every process:
    past a survivor's verdict (the step in flight, then `heartbeat_timeout_s` of watching), with
    as long again and 10 s for that step."""
    return 2 * heartbeat_timeout_s + 10


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


class Pulse:
    """This process's pulse: a daemon thread adding one to its counter (PULSE_KEY + index) every
    `interval_s` seconds, until `stop` or until the service is gone."""

    def __init__(self, client, index: int, interval_s: float):
        self.client, self.key, self.interval_s = client, f"{PULSE_KEY}{index}", interval_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="laplace-pulse", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while not self.stopped.is_set():
            try:
                self.client.key_value_increment(self.key, 1)
            except Exception:  # noqa: BLE001  the service is gone (process 0 lost, or shut down)
                return
            self.stopped.wait(self.interval_s)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


def _beats(client) -> dict[int, int]:
    """Every process's pulse counter, in one request."""
    return {int(k[len(PULSE_KEY) :]): int(v) for k, v in client.key_value_dir_get(PULSE_KEY)}


def silent_processes(client, timeout_s: float, poll_s: float) -> list[int]:
    """The other processes whose pulse did not move twice within `timeout_s` seconds of
    watching ([] as soon as every one has); [0] when the service itself is gone (it runs in
    process 0). Two moves, not one: a beat sent just before its process died may still land."""
    import jax

    me = jax.process_index()
    others = {p for p in range(jax.process_count()) if p != me}
    try:
        first = _beats(client)
        deadline = time.monotonic() + timeout_s
        alive: set[int] = set()
        while alive != others and time.monotonic() < deadline:
            time.sleep(poll_s)
            now = _beats(client)
            alive |= {p for p in others if now.get(p, 0) >= first.get(p, 0) + 2}
    except jax.errors.JaxRuntimeError:  # the service is gone with its process, 0
        return [0]
    return sorted(others - alive)


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
        lost = silent_processes(client, timeout, poll_s=pulse_s(timeout) / 2)
        if lost:
            leave(lost_peer_line(lost))


def initialize_distributed(heartbeat_timeout_s: int, **kwargs) -> None:
    """`jax.distributed.initialize(**kwargs)`, the service's heartbeat timeout beyond
    `heartbeat_timeout_s` (runtime_heartbeat_timeout_s), and this process's pulse."""
    import jax
    from jax._src import distributed

    runtime_timeout = runtime_heartbeat_timeout_s(heartbeat_timeout_s)
    jax.distributed.initialize(heartbeat_timeout_seconds=runtime_timeout, **kwargs)
    client = distributed.global_state.client
    pulse = Pulse(client, jax.process_index(), pulse_s(heartbeat_timeout_s))
    atexit.register(pulse.stop)  # before JAX's client goes (atexit runs the last registered first)
    PROGRESS.heartbeat_timeout_s = heartbeat_timeout_s
