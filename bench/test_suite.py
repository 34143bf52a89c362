"""`python -m bench.test_suite`: the README's test command, timed, its counts recorded.

Runs `python -m pytest -q` (exactly what `.ci/run` runs, plus pytest's `--durations` report,
which changes nothing else) and writes bench/results/test_suite.json: the counts of pytest's
closing line (passed, failed, skipped, ...), the wall time, and the slowest test phases (where to
trim when the suite grows). Run it alone on the machine: the time is what a user waits for the
whole suite.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

from bench.common import write_result

SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|warnings?)")
DURATION = re.compile(r"^([\d.]+)s (setup|call|teardown) +(\S+)$")  # pytest --durations lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.test_suite", description=__doc__)
    ap.add_argument("--slowest", type=int, default=25, help="how many slowest phases to record")
    args = ap.parse_args(argv)
    command = [sys.executable, "-m", "pytest", "-q", f"--durations={args.slowest}"]
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    lines = done.stdout.strip().splitlines()
    closing = lines[-1] if lines else ""
    counts = {kind.rstrip("s"): int(n) for n, kind in SUMMARY.findall(closing)}
    print(done.stdout[-2000:])
    if done.returncode != 0 or not counts.get("passed"):
        raise SystemExit(f"error: the test run exited {done.returncode}: {closing!r}")
    headline = {"tests_passed": counts["passed"], "wall_s": round(seconds, 1)}
    slowest = [
        {"seconds": float(m[1]), "phase": m[2], "test": m[3]}
        for line in lines
        if (m := DURATION.match(line.strip()))
    ]
    print(
        write_result(
            "test_suite",
            headline,
            command=" ".join(["python", *command[1:]]),
            closing=closing,
            slowest=slowest,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
