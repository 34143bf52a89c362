"""Subprocess jobs run one after another in a background thread from the start of the session
(tests/shared_fixtures.py's `start_early` queues the ones the collected tests use): their work
runs beside the tests that come before theirs, on the core those leave idle, and a test waits for
its job's result (`finished`).
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

Command = tuple[list[str], dict]  # argv, environment


class Queue:
    """Named lists of commands, run one after another (a name's list stops at its first failure)
    in a background thread."""

    def __init__(self, jobs: dict[str, list[Command]]):
        self.jobs = jobs
        self.results: dict[str, tuple[int, str]] = {}
        self.events = {name: threading.Event() for name in jobs}
        self.current: subprocess.Popen | None = None
        self.stopped = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for name, commands in self.jobs.items():
            status = (0, "")
            for argv, env in commands:
                if self.stopped:
                    status = (-1, "stopped before it ran")
                    break
                self.current = subprocess.Popen(
                    argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
                )
                _, err = self.current.communicate()
                status = (self.current.returncode, err.decode()[-3000:])
                if status[0]:
                    break
            self.results[name] = status
            self.events[name].set()

    def finished(self, name: str) -> tuple[int, str]:
        """(exit status, stderr's end) of `name`'s commands, once they are done."""
        self.events[name].wait()
        return self.results[name]

    def stop(self) -> None:
        """Run nothing more and kill the command in progress (a session stopped early)."""
        self.stopped = True
        if self.current is not None and self.current.poll() is None:
            self.current.kill()
