"""The run's metrics log: `metrics.jsonl` (one JSON object per logged step), with the lines a
resumed run supersedes kept in `metrics.superseded.jsonl`, and TensorBoard when tensorboardX is
installed."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


class Metrics:
    """metrics.jsonl (process 0 only), plus TensorBoard when tensorboardX is installed.

    A run that starts at step S continues metrics.jsonl after its lines up to S. Lines after S
    (logged by an earlier run past its last checkpoint) are moved to metrics.superseded.jsonl,
    each with `"superseded_at": S`; `superseded` counts them.
    """

    def __init__(self, run_dir: Path, start: int, enabled: bool):
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        self.tb = None
        self.superseded = 0
        if not enabled:
            return
        if self.path.exists():
            self.superseded = _supersede_after(self.path, start)
        try:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:
            pass

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, int | float):
                    self.tb.add_scalar(k, v, record["step"])

    def close(self):
        if self.tb is not None:
            self.tb.close()


def _supersede_after(path: Path, start: int) -> int:
    """Move the lines of `path` after step `start` to `<stem>.superseded.jsonl`; their count."""
    keep, moved = [], []  # lines kept as they are; records moved
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash
            moved.append({"unparsed": line})
            continue
        if record.get("step", 0) <= start:
            keep.append(line)
        else:
            moved.append(record)
    if moved:
        with open(path.with_name(path.stem + ".superseded.jsonl"), "a") as f:
            for record in moved:
                f.write(json.dumps({**record, "superseded_at": start}) + "\n")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)
    return len(moved)


def json_number(v):
    """A metric as JSON: non-finite floats (a NaN loss) become null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
