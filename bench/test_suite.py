"""`python -m bench.test_suite`: the README's test command, timed, its counts recorded.

Runs `python -m pytest -q` (exactly what `.ci/run` runs) and writes bench/results/test_suite.json:
the counts of pytest's closing line (passed, failed, skipped, ...) and the wall time. Run it alone
on the machine: the time is what a user waits for the whole suite.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

from bench.common import write_result

SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|warnings?)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.test_suite", description=__doc__)
    ap.parse_args(argv)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q"], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    lines = done.stdout.strip().splitlines()
    closing = lines[-1] if lines else ""
    counts = {kind.rstrip("s"): int(n) for n, kind in SUMMARY.findall(closing)}
    print(done.stdout[-2000:])
    if done.returncode != 0 or not counts.get("passed"):
        raise SystemExit(f"error: the test run exited {done.returncode}: {closing!r}")
    headline = {"tests_passed": counts["passed"], "wall_s": round(seconds, 1)}
    print(write_result("test_suite", headline, command="python -m pytest -q", closing=closing))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
