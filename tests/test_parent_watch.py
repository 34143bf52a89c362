"""serve/parent_watch.py's fork hook: a process the server forks ends when the server is killed
with SIGKILL (a forked child runs no vLLM plugin, so only the hook watches it). The spawned
processes of a real server, the plugin's route and the adapter's `__mp_main__` one, are killed in
tests/test_chat.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from shared_fixtures import running

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SERVER = """
import multiprocessing, sys, time
from serve.parent_watch import watch_in_forked_children
if sys.argv[1] == "hook":
    watch_in_forked_children()
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
child.start()
print(child.pid, flush=True)
time.sleep(120)
"""


def forked_child_after_sigkill(mode: str, wait_s: float) -> bool:
    """Start a 'server' that forks a sleeping child, SIGKILL the server: whether the child is
    still running `wait_s` later (it is ended either way)."""
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, mode], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    child = int(server.stdout.readline())
    os.kill(server.pid, signal.SIGKILL)
    server.wait(timeout=10)
    deadline = time.monotonic() + wait_s
    while running([child]) and time.monotonic() < deadline:
        time.sleep(0.1)
    still = bool(running([child]))
    if still:
        os.kill(child, signal.SIGKILL)
    return still


@pytest.mark.parametrize("mode", ["hook", "none"])
def test_a_forked_child_ends_with_its_killed_server(mode):
    """With the hook the child is gone within POLL_S + GRACE_S (its SIGTERM ends a plain sleep at
    once); without it (vLLM alone) it runs on (checked for 1.5 s: three polls)."""
    hook = mode == "hook"
    assert forked_child_after_sigkill(mode, wait_s=5.0 if hook else 1.5) == (not hook)
