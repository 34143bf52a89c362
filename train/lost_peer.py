"""A lost peer: a process of a multi-process run that dies without notice (a kernel panic, an
OOM kill, a spot reclaim), and how the processes left say so and stop.

Each process keeps a pulse: a thread of its own adds one to its counter in the coordination
service's key-value store every `pulse_s` seconds (`Pulse`). Two ways meet a death:

- A failed step. Every training step all-reduces across the processes, so within one step of
  a death XLA raises `jax.errors.JaxRuntimeError` in the survivors (on CPU, Gloo's "Connection
  reset by peer"). The error does not say whether a peer died or something else broke, so the
  survivor watches the counters (`silent_processes`): a process whose counter has not moved
  twice within `--heartbeat-timeout` seconds is lost; when every counter moves, the error is not
  ours to explain and it goes on (the caller re-raises).
- A wait that never fails. A survivor can be held where no error comes back: a barrier of a
  checkpoint (orbax waits at one before a save, at the commit of an asynchronous save, at the
  manager's close at the end of a run, and the processes agree on a restore), or a collective
  that hangs rather than fails (NCCL's, on a GPU). A watcher thread (`PeerWatch`) therefore reads
  the counters for the whole run: a process whose counter has stood still for the heartbeat
  timeout, and that has not said its run ended (`finished`: a process done with its run stops
  its pulse at exit while another still prints its sample), is lost.

Either way the same line and exit follow, whichever thread sees it first (`leave` lets one).

Why not the service's own heartbeats: the service marks a process dead after its heartbeat
timeout, and at that same moment (JAX's service is not recoverable) it tells every other
process to fail, and their clients abort from their own thread (exit 134, a stack dump). Its
list of live processes (`get_live_nodes`) changes only at that moment, so a survivor that
asked it raced its own abort, and lost about one time in six here. (JAX's
`jax_enable_recoverability` would keep the service from telling the others to fail; it is not
used: the service calls it experimental, and with it the shutdown barrier at a run's end no
longer waits for every process.) So the service's heartbeat timeout is set well beyond ours
(`runtime_heartbeat_timeout_s`): the survivors' verdict and exit come first, and the runtime's
abort stays as a backstop.

While the counters are watched after a failed step, Python's log records through absl (orbax's)
are held back: a save in flight fails its commit barrier once a process is gone, and orbax's
background thread then logs that failure with a traceback. A lost peer explains it (the save is
not committed, the line names the newest complete checkpoint), so the held records are dropped
when a peer is lost and logged as they were when none is. (The watcher's verdict comes before
the service fails that barrier: its timeout is the runtime's, beyond ours.)

The survivor then prints one line (which process was lost, the step reached, the newest
complete checkpoint, the unfinished one if a save was in flight, what to do) and leaves at once
with `LOST_PEER_EXIT` through `os._exit`: a normal exit would run JAX's shutdown, which waits at
a barrier for the lost process (the shutdown timeout, 5 minutes) and then aborts, and orbax's
wait for a save in flight, whose commit needs every process. That save is simply not finished:
orbax writes a step into a temporary directory and renames it only once every process has
written its part (its commit protocol), so an unfinished save leaves no directory a rerun takes
for a checkpoint; the rerun removes it (train/checkpoint.py) and restores the newest step every
process committed (`complete_steps`).

Not covered: the loss of process 0, which runs the coordination service. The other processes'
distributed clients then fail their next call to it within a second and abort the process from
their own thread (exit 134). jax 0.10 takes no other callback from Python: its client factory
accepts a `missed_heartbeat_callback`, but calling a Python one ends in `std::bad_cast` (the
status it is handed has no Python form). The survivors still stop promptly and the rerun
resumes as above; only the line is missing. Nor a peer killed after it finished its run (in
JAX's shutdown barrier, every checkpoint committed): the runtime's backstop ends the others.

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
KEYS = "laplace/"  # this module's keys in the service's key-value store:
PULSE_KEY = KEYS + "pulse/"  # + the process index: its counter
FINISHED_KEY = KEYS + "finished/"  # + the process index: set when its run has ended on its own


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
    watch: PeerWatch | None = None  # the watcher thread, likewise


PROGRESS = Progress()


def lost_peer_line(lost: list[int]) -> str:
    """The one line a survivor prints."""
    import jax

    ckpt = PROGRESS.checkpointer
    complete = ckpt.complete_steps() if ckpt is not None else []
    newest = f"step {complete[-1]} ({ckpt.directory / str(complete[-1])})" if complete else "none"
    unfinished = ckpt.unfinished_saves() if ckpt is not None else []
    if unfinished:  # a save in flight, never committed
        newest += f"; unfinished, removed by the rerun: {', '.join(unfinished)}"
    return (
        f"lost peer: process {', '.join(map(str, lost))} of {jax.process_count()} left the run "
        f"after step {PROGRESS.step} (this is process {jax.process_index()}); newest complete "
        f"checkpoint: {newest}; rerun every process with the same command to resume (exit "
        f"status {LOST_PEER_EXIT})"
    )


_LEAVING = threading.Lock()  # held by the one thread that prints the line and exits


def leave(line: str) -> None:
    """Print `line` and exit with LOST_PEER_EXIT now, without JAX's or orbax's shutdown (they
    would wait for the lost process). A second thread that gets here waits for the exit."""
    _LEAVING.acquire()
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


def _by_process(entries, prefix: str) -> dict[int, int]:
    """{process index: value} of the key-value entries under `prefix`."""
    return {int(k[len(prefix) :]): int(v) for k, v in entries if k.startswith(prefix)}


def _beats(client) -> dict[int, int]:
    """Every process's pulse counter, in one request."""
    return _by_process(client.key_value_dir_get(PULSE_KEY), PULSE_KEY)


def _beats_and_finished(client) -> tuple[dict[int, int], set[int]]:
    """Every process's pulse counter, and the processes whose runs have ended, in one request."""
    entries = client.key_value_dir_get(KEYS)
    return _by_process(entries, PULSE_KEY), set(_by_process(entries, FINISHED_KEY))


class PeerWatch:
    """The other processes' pulses, read by a daemon thread of this process every `poll_s`
    seconds until `stop`: a process whose counter has stood still for `timeout_s` seconds and
    that has not finished its run is lost, and the thread prints the line and leaves (`leave`).
    The service unreachable as long counts as process 0 (it runs there) lost."""

    def __init__(self, client, timeout_s: float, poll_s: float):
        import jax

        self.client, self.timeout_s, self.poll_s = client, timeout_s, poll_s
        me = jax.process_index()
        self.others = [p for p in range(jax.process_count()) if p != me]
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="laplace-peer-watch", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        import jax

        moved: dict[int, tuple[int | None, float]] = {}  # process -> (counter, when it last moved)
        reached = time.monotonic()  # when the service last answered
        while not self.stopped.wait(self.poll_s):
            now = time.monotonic()
            try:
                beats, done = _beats_and_finished(self.client)
            except jax.errors.JaxRuntimeError:
                if now - reached >= self.timeout_s:
                    leave(lost_peer_line([0]))
                continue
            reached = now
            for p in self.others:
                if p not in moved or moved[p][0] != beats.get(p):
                    moved[p] = (beats.get(p), now)
            lost = [p for p in self.others if p not in done and now - moved[p][1] >= self.timeout_s]
            if lost and not self.stopped.is_set():
                leave(lost_peer_line(lost))

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


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
    watch = PeerWatch(client, heartbeat_timeout_s, pulse_s(heartbeat_timeout_s))
    # both stop before JAX's client goes (atexit runs the last registered first)
    atexit.register(pulse.stop)
    atexit.register(watch.stop)
    PROGRESS.heartbeat_timeout_s, PROGRESS.watch = heartbeat_timeout_s, watch


def finished() -> None:
    """This process's run has ended on its own (with whatever status the trainer returns): the
    others stop watching its pulse, which stops at its exit, and it stops watching theirs. Does
    nothing in a one-process run."""
    import jax
    from jax._src import distributed

    if PROGRESS.watch is None:
        return
    PROGRESS.watch.stop()
    distributed.global_state.client.key_value_set(f"{FINISHED_KEY}{jax.process_index()}", "1")
