"""What every part of `bench.device` shares: its record, its deadline, its figures.

A part runs in a child process (`run.py` starts it). Its record is a dict saved to the file the
parent gave it after every step worth keeping (atomically), so whatever happens to the child
later (out of memory, a kill at the deadline) the parent reads what was measured until then.
Nothing here imports JAX or PyTorch: the decode part must not initialise JAX on the GPU.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import traceback
from pathlib import Path


class Part:
    """The record of one part: status, skips, errors and its data, saved as it goes."""

    def __init__(self, name: str, path: str | Path, deadline: float, dry_run: bool):
        self.name, self.path, self.deadline, self.dry_run = name, Path(path), deadline, dry_run
        self.start = time.time()
        self.result = {"part": name, "status": "running", "skips": [], "errors": []}

    def remaining(self) -> float:
        """Seconds left of this part's budget."""
        return self.deadline - time.time()

    def say(self, message: str) -> None:
        print(f"[{self.name} {time.time() - self.start:6.1f}s] {message}", flush=True)

    def skip(self, what: str, reason: str) -> None:
        self.result["skips"].append({"what": what, "reason": reason})
        self.say(f"skip {what}: {reason}")
        self.save()

    def error(self, what: str, exc: BaseException) -> None:
        """Record an exception (its message and the tail of its traceback); the part goes on."""
        tail = "".join(traceback.format_exception(exc))[-2000:]
        self.result["errors"].append(
            {"what": what, "error": f"{type(exc).__name__}: {exc}"[:600], "traceback_tail": tail}
        )
        self.say(f"error in {what}: {type(exc).__name__}: {str(exc)[:300]}")
        self.save()

    def save(self) -> None:
        self.result["elapsed_s"] = round(time.time() - self.start, 2)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=2, default=_plain) + "\n")
        os.replace(tmp, self.path)

    def finish(self, status: str) -> None:
        self.result["status"] = status
        self.save()


def _plain(x):
    """numpy scalars and the like in the record -> plain Python numbers."""
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def spread(values) -> dict | None:
    """{median, min, max, n} of per-round figures (None for no rounds)."""
    values = [float(v) for v in values]
    if not values:
        return None
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def is_out_of_memory(exc: BaseException) -> bool:
    """XLA's RESOURCE_EXHAUSTED or CUDA's out of memory, by message (the exception classes differ
    between JAX releases and frameworks)."""
    text = f"{type(exc).__name__} {exc}".lower()
    return "resource_exhausted" in text or "out of memory" in text or "outofmemory" in text


def rel_error(got, want) -> dict:
    """||got - want|| / ||want|| (L2, float64) and max|got - want| / max|want|."""
    import numpy as np

    g = np.asarray(got, np.float64)
    w = np.asarray(want, np.float64)
    diff = g - w
    scale = float(np.linalg.norm(w)) or 1.0
    peak = float(np.abs(w).max()) or 1.0
    return {
        "rel_l2": float(np.linalg.norm(diff)) / scale,
        "max_abs_over_max": float(np.abs(diff).max()) / peak,
        "finite": bool(np.isfinite(g).all()),
    }
