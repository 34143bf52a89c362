"""`--profile-steps A:B`: a `jax.profiler` trace of training steps A..B in `RUN_DIR/profile/`
(`plugins/profile/<time>/`: `*.xplane.pb` for TensorBoard's profile plugin, and
`perfetto_trace.json.gz` for https://ui.perfetto.dev), from the main process only.

The trace starts before the first step of the range that the run trains (A, or the first step
after a resume inside the range) is dispatched, and stops once step B's results are ready (or
when the run ends first); the profiler's own start and stop fall outside the step timings. A
trace that cannot be started or written is a warning line, never the end of the run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax


class StepTrace:
    """The trace of steps `steps` = (A, B) or None (no trace) of a run that trains steps
    `start` + 1 .. `last`; `enabled` false on the processes other than the main one."""

    def __init__(self, steps, directory: Path, enabled: bool, start: int, last: int, say=print):
        self.directory = Path(directory)
        self.say = say
        self.active = False
        self.first = self.last = self.done = None  # the range this run traces; its last step run
        self.note = None
        if steps is None or not enabled:
            return
        first, last_wanted = max(steps[0], start + 1), min(steps[1], last)
        if first > last_wanted:
            self.note = (
                f"note: --profile-steps {steps[0]}:{steps[1]} lies outside the steps this run "
                f"trains ({start + 1}..{last}): no trace"
            )
            return
        self.first, self.last = first, last_wanted

    def before(self, step: int) -> None:
        """Before step `step` (1-based) is dispatched: start the trace at the range's first."""
        if step == self.first:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
            except (OSError, RuntimeError) as e:  # the trace is not worth the run
                print(f"warning: --profile-steps: no trace ({e})", file=sys.stderr)
                return
            self.active = True

    def after(self, step: int, state) -> None:
        """Once step `step` has run: at the range's last, wait for `state` and stop."""
        if self.active:
            self.done = step
        if step == self.last:
            self.close(state)

    def close(self, state=None) -> None:
        """Stop a running trace (waiting for `state` first, when given) and say where it is."""
        if not self.active:
            return
        self.active = False
        if state is not None:
            jax.block_until_ready(state)
        try:
            jax.profiler.stop_trace()
        except (OSError, RuntimeError) as e:
            print(f"warning: --profile-steps: the trace was not written ({e})", file=sys.stderr)
            return
        steps = f"{self.first}..{self.done or self.first}"
        self.say(
            f"\nprofile of steps {steps} written to {self.directory} (tensorboard --logdir "
            f"{self.directory}, or Perfetto: perfetto_trace.json.gz)"
        )
