"""Test session set-up: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_sessionfinish(session, exitstatus):
    """A skipped test is a failed run: every dependency the tests use is pinned and installed by
    scripts/install.sh, so a skip means a broken install or a test that cannot run, never a pass."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped and session.exitstatus == 0:
        reporter.write_line(f"error: {len(skipped)} test(s) skipped; the run must skip none")
        session.exitstatus = 1
