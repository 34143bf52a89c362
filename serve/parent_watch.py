"""A vLLM child process ends when the process that started it is gone.

vLLM 0.32 starts its engine cores (one per data-parallel replica) and, with more than one
replica, a data-parallel coordinator as multiprocessing children of the API server, and their
workers as children of the engine core; it has no parent-death handling of its own. A server
killed with SIGKILL (a script's `kill -9`, the OOM killer, a supervisor that signals one process
rather than its group) therefore left them running, each holding its memory and its share of a
`--state-dir`, and a restarted server ran beside them.

The watch: a daemon thread compares `os.getppid()` with the parent's pid every POLL_S; when they
differ, the parent is gone (the kernel handed the process to init or a subreaper), and the
process sends itself SIGTERM, which vLLM's own handlers turn into an orderly shutdown (its
children and shared-memory files included), then SIGKILL after GRACE_S if it is still there. Its
own children see the same and follow: an engine and its worker are gone within
2 x (POLL_S + GRACE_S). Who starts it:

    the plugin           in every process vLLM starts with `spawn` (vLLM's choice on a CPU,
                         and wherever CUDA is already initialised): engine cores, workers
    serve.vllm_adapter   re-imported as `__mp_main__` in each process its server spawns, so
                         also those that load no plugin (the data-parallel coordinator); and in
                         its own process, a fork hook: every process it forks (vLLM's default
                         method elsewhere) watches it from its first instruction, because a
                         forked child inherits "plugins loaded" and runs no plugin

A process started any other way (the API server itself, `python -m serve.vllm_adapter`, `vllm
serve`) is not watched: its parent is a shell or a supervisor, whose exit must not end a server.

A polling thread rather than Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG)`): that signal
fires when the *thread* that forked the child exits, and which thread of the API server starts an
engine is vLLM's business.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading

POLL_S = 0.5
GRACE_S = 3.0
_started = False
_hooked = False
_forker: int | None = None  # in a forked child: the pid of the process that forked it


def watch_parent(parent_pid: int | None = None) -> bool:
    """Start the watch of `parent_pid` (by default the parent of a process `multiprocessing`
    started), once per process; whether it started."""
    global _started
    if parent_pid is None and multiprocessing.parent_process() is not None:
        parent_pid = os.getppid()  # the process that started this one (a forkserver's, too)
    if parent_pid is None or parent_pid == 1 or _started:
        return False
    _started = True
    watch = threading.Thread(target=_watch, args=(parent_pid,), name="parent-watch", daemon=True)
    watch.start()
    return True


def watch_in_forked_children() -> None:
    """Called by a server on itself: every process it forks, and they fork, watches its parent
    (the hook is set once per process)."""
    global _hooked
    if not _hooked:
        _hooked = True
        os.register_at_fork(before=_note_forker, after_in_child=_watch_after_fork)


def _note_forker() -> None:
    """In the parent, just before the fork: its pid, which the child inherits (the child's own
    os.getppid() would already name init if the parent died before the child's first step)."""
    global _forker
    _forker = os.getpid()


def _watch_after_fork() -> None:
    global _started
    _started = False  # a new process: the parent's watch (if any) did not come with the fork
    watch_parent(_forker)


def _watch(parent_pid: int) -> None:
    stop = threading.Event()
    while os.getppid() == parent_pid:
        stop.wait(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)  # vLLM's shutdown: children, shared memory
    stop.wait(GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)
