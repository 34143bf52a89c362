"""docs/development.md: the test suite's time (bench.test_suite)."""

from __future__ import annotations

from bench.report.fmt import load, minutes

PAGE = "docs/development.md"


def test_suite() -> str:
    d = load("test_suite")
    h = d["headline"]
    slowest = d["slowest"][0]
    return (
        f"`python -m bench.test_suite` (`bench/results/test_suite.json`) ran the command above on "
        f"this project's {d['machine']['cores']}-core CPU machine ({d['machine']['cpu']}): "
        f"{h['tests_passed']} tests passed and {h['tests_skipped']} were skipped in "
        f"{minutes(h['wall_s'])}, against a budget of {minutes(d['budget_s'])}; the slowest "
        f"phase took {slowest['seconds']:.0f} s (`{slowest['test'].split('::')[-1]}`, its "
        f"{slowest['phase']})."
    )


BLOCKS = {"test-suite": test_suite}
