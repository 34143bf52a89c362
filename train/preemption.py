"""Preemption: the step at which a run that a scheduler asked to stop saves and exits.

SLURM, Kubernetes and spot instances end a job with SIGTERM and a short grace period. The trainer
checks `PreemptionWatch.reached(step)` after every step; when it says so, the loop saves that
step's checkpoint, waits for the write, and exits with `PREEMPTED_EXIT`.

- One process: SIGTERM and SIGINT (Ctrl-C) are caught here. The step in flight finishes, and
  signals that arrive while the run saves are noted and ignored, so nothing interrupts the save.
- Several processes: the notice comes from JAX's distributed runtime, whose preemption service
  catches SIGTERM in whichever process gets it and tells the others; orbax's
  `CheckpointManager.reached_preemption(step)` (JAX's `reached_preemption_sync_point`) then
  returns True at the same step on every process, so all of them save the same step. A
  scheduler should signal every process (SLURM's `scancel` and Kubernetes do); one is enough.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

import jax

# EX_TEMPFAIL of sysexits.h: the run stopped cleanly and can be retried. A scheduler tells it
# from a success (0: the run finished) and from a failure (1, or 2 for a stop with a message).
PREEMPTED_EXIT = 75


class PreemptionWatch:
    """Whether this run has been asked to stop, checked once per step (`reached`)."""

    def __init__(self, reached_sync_point: Callable[[int], bool]):
        self.reached_sync_point = reached_sync_point
        self.received: str | None = None  # the first signal's name (one process)
        self.several = jax.process_count() > 1
        self.previous = {}
        if not self.several:  # several processes: the distributed runtime owns SIGTERM
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._note)

    def _note(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = name
            print(f"\n{name} received: finishing this step, then saving", file=sys.stderr)
        else:  # during the step or the save: ignored until the checkpoint is written
            print(f"{name} received again: ignored until the checkpoint is saved", file=sys.stderr)

    def reached(self, step: int) -> bool:
        """True at the step every process saves at after a preemption notice."""
        if self.several:
            return bool(self.reached_sync_point(step))
        return self.received is not None

    def close(self) -> None:
        """Give the signals back their earlier handlers (the process goes on, e.g. in tests)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
