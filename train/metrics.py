"""The run's metrics log: `metrics.jsonl` (one JSON object per logged step), with the lines a
resumed run supersedes kept in `metrics.superseded.jsonl`, and the same scalars as TensorBoard
event files in `tensorboard/` (tensorboardX's writer): `tensorboard --logdir RUN_DIR/tensorboard`.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from pathlib import Path


class Metrics:
    """metrics.jsonl and tensorboard/ (process 0 only).

    A run that starts at step S continues metrics.jsonl after its lines up to S. Lines after S
    (logged by an earlier run past its last checkpoint) are moved to metrics.superseded.jsonl,
    each with `"superseded_at": S`; `superseded` counts them.

    TensorBoard gets every numeric field of each line but `step`, which is its x axis (the host
    step counter); `applied` as 1 or 0; a null (a non-finite loss) is left out. The events are
    written and flushed with each line, in this thread (tensorboardX's `RecordWriter` and
    protobufs, not its queue-and-thread `SummaryWriter`), so the event file holds what
    metrics.jsonl holds. Each run adds its own event file to the directory (the name ends in
    the process id); it begins with the purge mark that tensorboardX's `purge_step` writes, a
    session start at step S + 1, by which TensorBoard hides what an earlier run logged after S,
    as metrics.jsonl sets it aside.

    metrics.jsonl is the record: a failed event write (a full disk) prints one warning and the
    run goes on without TensorBoard; a failed metrics.jsonl write stops it (train/main.py).
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
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.record_writer import RecordWriter

        tb_dir = run_dir / "tensorboard"
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        try:
            tb_dir.mkdir(parents=True, exist_ok=True)
            while (tb_dir / name).exists():  # never overwrite another run's events
                name += "+"
            self.tb = RecordWriter(str(tb_dir / name))
            self._event(Event(file_version="brain.Event:2"))
            self._event(Event(step=start + 1, session_log=SessionLog(status=SessionLog.START)))
        except OSError as e:
            self._tensorboard_failed(e)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.proto.summary_pb2 import Summary

            values = [
                Summary.Value(tag=k, simple_value=float(v))
                for k, v in record.items()
                if k != "step" and isinstance(v, int | float)
            ]
            if not values:
                return
            try:
                self._event(Event(step=record["step"], summary=Summary(value=values)))
                self.tb.flush()
            except OSError as e:
                self._tensorboard_failed(e)

    def close(self):
        """Flush and close the TensorBoard file (once; later calls do nothing)."""
        if self.tb is not None:
            try:
                self.tb.close()
            except OSError as e:
                self._tensorboard_failed(e)
            self.tb = None

    def _event(self, event) -> None:
        event.wall_time = time.time()
        self.tb.write(event.SerializeToString())

    def _tensorboard_failed(self, error: OSError) -> None:
        """One warning; no more events this run (metrics.jsonl goes on)."""
        tb, self.tb = self.tb, None
        if tb is not None:
            try:
                tb.close()  # the file is closed even when its last flush fails
            except OSError:
                pass
        print(
            f"warning: TensorBoard events are no longer written ({error}); "
            f"{self.path.name} goes on",
            file=sys.stderr,
        )


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
