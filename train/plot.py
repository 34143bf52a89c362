"""Draw a run's loss and throughput curves: `python -m train.plot RUN_DIR [--out FILE.png]`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics (is {run_dir} a run directory?)")
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    return out


def plot(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    out = Path(out) if out else Path(run_dir) / "curves.png"

    def series(key):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(*series("loss"), label="train loss")
    if series("val_loss")[0]:
        ax1.plot(*series("val_loss"), "o-", label="validation loss")
    ax1.set_xlabel("step")
    ax1.set_ylabel("cross-entropy (nats/token)")
    ax1.legend()
    ax1.grid(alpha=0.3)
    steps, tps = series("tokens_per_s")
    ax2.plot(steps, tps, color="tab:green", label="tokens/s")
    ax2.set_xlabel("step")
    ax2.set_ylabel("tokens/s")
    ax2.grid(alpha=0.3)
    steps, mfu = series("mfu")
    if steps:
        ax3 = ax2.twinx()
        ax3.plot(steps, [100 * m for m in mfu], color="tab:orange", alpha=0.6, label="MFU")
        ax3.set_ylabel("MFU (%)")
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.plot", description=__doc__)
    ap.add_argument("run_dir")
    ap.add_argument("--out", help="PNG path (default RUN_DIR/curves.png)")
    args = ap.parse_args(argv)
    print(plot(args.run_dir, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
