"""The formats every page's figures share, and reading a result file."""

from __future__ import annotations

import json
from collections.abc import Callable

from bench.common import RESULTS


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f}%"


def ratio(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}x"


def spread(s: dict, fmt: Callable[[float], str] = ratio) -> str:
    """`median (min to max)` of a {"median", "min", "max"} record."""
    return f"{fmt(s['median'])} ({fmt(s['min'])} to {fmt(s['max'])})"


def sci(x: float, digits: int = 3) -> str:
    """9.52e15, not 9.52e+15."""
    return f"{x:.{digits}g}".replace("e+", "e")


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} minutes"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
