"""Every page whose figures `python -m bench.report` renders or checks, and the command itself.

A page with a module here has its blocks rendered from that module's `BLOCKS`; every other page
of the manual (docs/*.md) is checked for stray figures too, so prose anywhere may quote a figure
only inside a block. The specification pages (docs/design.md, docs/parameters.md) are the
exception: their numbers are the design's definitions and derivations (shapes, constants,
modelled figures with their assumptions), which the code's tests hold them to.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.report import (
    benchmarks,
    development,
    home,
    hybrid,
    long_context,
    readme,
    retrieval,
    serving,
    training,
    trainium,
)
from bench.report.check import check, render, stray_figures

ROOT = Path(__file__).resolve().parents[2]
MODULES = (
    readme,
    home,
    training,
    long_context,
    hybrid,
    serving,
    trainium,
    retrieval,
    benchmarks,
    development,
)
SPECIFICATION = ("docs/design.md", "docs/parameters.md")


def pages() -> dict[str, dict]:
    """{page path relative to the repository: its blocks}, every page of README.md and docs/."""
    out = {m.PAGE: m.BLOCKS for m in MODULES}
    for path in sorted((ROOT / "docs").glob("*.md")):
        name = str(path.relative_to(ROOT))
        if name not in SPECIFICATION:
            out.setdefault(name, {})
    return out


def check_all() -> list[str]:
    """Everything wrong with every page (empty when all are rendered and clean)."""
    problems = []
    for page, blocks in pages().items():
        path = ROOT / page
        if not path.is_file():
            problems.append(f"{page}: missing (bench/report/ renders blocks into it)")
            continue
        problems += check(path.read_text(), blocks, page)
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__)
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    args = ap.parse_args(argv)
    if args.check:
        problems = check_all()
        for p in problems:
            print(p, file=sys.stderr)
        return 1 if problems else 0
    strays = []
    for page, blocks in pages().items():
        path = ROOT / page
        path.write_text(render(path.read_text(), blocks, page))
        strays += stray_figures(path.read_text(), page)
        print(f"rendered {len(blocks)} blocks into {page}")
    for s in strays:
        print(f"stray figure: {s}", file=sys.stderr)
    return 1 if strays else 0
