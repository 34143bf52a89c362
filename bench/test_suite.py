"""`python -m bench.test_suite`: the README's test command, timed, its counts recorded.

Runs `python -m pytest -q` (exactly what `.ci/run` runs, plus pytest's `--durations` report,
which changes nothing else) and writes bench/results/test_suite.json: the counts of pytest's
closing line (passed, failed, skipped, ...), the wall time, and the slowest test phases (where to
trim when the suite grows). Run it alone on the machine: the time is what a user waits for the
whole suite.

The suite has a budget, BUDGET_S (the README states it beside the test command): the run prints
every phase over 30 s, warns about any over 60 s (none may be, unless the test says why it cannot
be smaller), writes the result either way, and exits 1 when the total is over the budget or a
test was skipped.
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
BUDGET_S = 25 * 60  # the whole suite on a 2-core CPU machine, alone
SLOW_PHASE_S = 30.0  # phases printed
MAX_PHASE_S = 60.0  # phases warned about


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.test_suite", description=__doc__)
    ap.add_argument("--slowest", type=int, default=40, help="how many slowest phases to record")
    args = ap.parse_args(argv)
    command = [sys.executable, "-m", "pytest", "-q", f"--durations={args.slowest}"]
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    lines = done.stdout.strip().splitlines()
    closing = lines[-1] if lines else ""
    counts = {kind.rstrip("s"): int(n) for n, kind in SUMMARY.findall(closing)}
    failures = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    print("\n".join(failures) or "(no failures)")
    slowest = [
        {"seconds": float(m[1]), "phase": m[2], "test": m[3]}
        for line in lines
        if (m := DURATION.match(line.strip()))
    ]
    slow = [p for p in slowest if p["seconds"] > SLOW_PHASE_S]
    print(f"phases over {SLOW_PHASE_S:.0f} s: {len(slow)}")
    for p in slow:
        flag = f"  <- over {MAX_PHASE_S:.0f} s" if p["seconds"] > MAX_PHASE_S else ""
        print(f"  {p['seconds']:7.1f} s  {p['phase']:<8} {p['test']}{flag}")
    if len(slow) == len(slowest):
        print(f"  (only the {len(slowest)} slowest are listed: raise --slowest to see the rest)")
    if done.returncode != 0 or not counts.get("passed"):
        print(done.stdout[-20000:])  # the failures' reports
        raise SystemExit(f"error: the test run exited {done.returncode}: {closing!r}")
    headline = {
        "tests_passed": counts["passed"],
        "tests_skipped": counts.get("skipped", 0),
        "wall_s": round(seconds, 1),
    }
    print(
        write_result(
            "test_suite",
            headline,
            command=" ".join(["python", *command[1:]]),
            closing=closing,
            budget_s=BUDGET_S,
            slowest=slowest,
        )
    )
    within = seconds <= BUDGET_S
    print(
        f"the suite took {seconds / 60:.1f} minutes of its {BUDGET_S / 60:.0f}-minute budget"
        + ("" if within else ": OVER BUDGET")
    )
    return 0 if within and headline["tests_skipped"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
