"""The README's five-minute tour as a job: the block between `<!-- tour -->` and `<!-- /tour -->`,
line for line in one bash process, in a fresh directory that holds the set-up's `.venv` (this
interpreter's environment) and nothing else. Only its settings are made tiny, by the
substitutions of `TINY`, each of which must apply: a tour that changes under them fails
tests/test_tour.py until this file follows it.

shared_fixtures.start_early starts it when the tests are collected (its training, export, server
start and evaluation take a minute or two, beside the tests before test_tour.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- tour -->\n```bash\n(.*?)```\n<!-- /tour -->", re.S)
PORT = "8000"


def tour() -> str:
    """The README's tour, as a user copies it."""
    found = BLOCK.findall((REPO / "README.md").read_text())
    assert len(found) == 1, "README.md has no tour block (or more than one)"
    return found[0]


def tiny(script: str, port: int) -> str:
    """The tour on tiny settings: the tiny preset for 4 steps instead of the default run (no
    set-up trained one here), and a free port instead of the tour's."""
    subs = [
        ("python -m train.main ", "python -m train.main --config tiny --steps 4 --no-progress "),
        (PORT, str(port)),
    ]
    for old, new in subs:
        assert old in script, f"the tour no longer has {old!r}: update tests/tour.py"
        script = script.replace(old, new)
    return script


@dataclasses.dataclass
class TourJob:
    proc: subprocess.Popen
    root: Path  # the directory it runs in
    stdout: Path
    stderr: Path

    def finished(self, timeout: float = 600) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) once the tour has run (killed after `timeout` s)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        self.stop()
        return self.proc.returncode, self.stdout.read_text(), self.stderr.read_text()

    def stop(self) -> None:
        """Kill what the tour left running (its server, should it have stopped early), then
        the shell, if it still runs: the whole process group."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def start(root: Path, port: int, env: dict) -> TourJob:
    """Run the tiny tour in ROOT (a fresh directory) in the background."""
    script = "set -euo pipefail\n" + tiny(tour(), port)
    (root / ".venv").symlink_to(sys.prefix)  # the set-up's environment
    env = {k: v for k, v in env.items() if k != "VIRTUAL_ENV"}
    out, err = root / "tour.stdout", root / "tour.stderr"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(
            ["bash", "-c", script], cwd=root, env=env, stdout=o, stderr=e, start_new_session=True
        )
    return TourJob(proc, root, out, err)
