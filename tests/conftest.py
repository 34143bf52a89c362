"""Test session set-up, before JAX is imported anywhere: 8 simulated CPU devices (with the
tests' compile flags, tests/xla_env.py), one XLA compilation cache for every JAX process of the
run, and the fixtures several test files share (tests/shared_fixtures.py).

The cache is a fresh directory per run (nothing carries from one run to the next), shared by
this process and the trainer subprocesses it starts (they inherit the environment): a program
that several tests compile (the tiny trainer's step on one mesh) compiles once. It keeps the
programs that take a second or more to compile: caching every small one (thousands of eager
ops and kernel tests) costs more than it saves. Its size limit turns on JAX's file lock, so two
processes never read an entry while it is being written.
"""

import os
import shutil
import tempfile

from xla_env import xla_flags

os.environ["XLA_FLAGS"] = xla_flags(8, os.environ.get("XLA_FLAGS", ""))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="laplace-tests-xla-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "1"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(4 << 30)
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"]
else:  # set by the caller (or by the run that started this one): theirs to keep
    _OWN_CACHE = None

import shared_fixtures  # noqa: E402
from shared_fixtures import (  # noqa: E402, F401
    compiled_hybrid_run,
    compiled_varlen_run,
    hybrid_recall_run,
    hybrid_replica_server,
    hybrid_state_dir,
    hybrid_store_server,
    killed_store_server,
    mqar_task_runs,
    prefix_flag_server,
    readme_tour,
    replica_server,
    spaces_export,
    spaces_resume_server,
    spaces_server,
    spaces_state_dir,
    state_dir,
    store_server,
    tiny_export,
    tiny_hybrid_export,
    vllm_engine,
    vllm_serve_server,
    wide_vocab_run,
)


def pytest_collection_finish(session):
    """Start the subprocess jobs the collected tests will need (shared_fixtures.start_early)."""
    if not session.config.option.collectonly:
        shared_fixtures.start_early(session.items, session.config._tmp_path_factory)


def pytest_runtest_teardown(item, nextitem):
    """Start the jobs that wait for a test to end (shared_fixtures.start_after)."""
    shared_fixtures.start_after(item)


def pytest_sessionfinish(session, exitstatus):
    """A skipped test is a failed run: every dependency the tests use is pinned and installed by
    scripts/install.sh, so a skip means a broken install or a test that cannot run, never a pass."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped and session.exitstatus == 0:
        reporter.write_line(f"error: {len(skipped)} test(s) skipped; the run must skip none")
        session.exitstatus = 1


def pytest_unconfigure(config):
    shared_fixtures.stop_early()
    if _OWN_CACHE:  # the run that made it removes it
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
