"""The command: the environment check, then each part in its own process under its budget.

The parent imports neither JAX nor PyTorch until the parts are done (it would hold GPU memory):
it starts `python -m bench.device --part NAME` per part, reads the record the part saved, and at
the end writes the result with `bench.common.write_result` (which records the machine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, write_result

PARTS = ("gla", "train", "decode")
# Seconds per part, its own start-up included (the total stays under about 8 minutes on an
# H200); the dry run's budgets are caps, it ends well before them.
BUDGETS = {
    "real": {"env": 45, "gla": 90, "train": 200, "decode": 140},
    "dry": {"env": 60, "gla": 90, "train": 120, "decode": 90},
}
GRACE_S = 20  # a part still running this long after its budget is killed
# Each part's JAX memory settings: JAX shares the GPU with PyTorch in `env` and `gla`; the
# training step gets most of it; decode (PyTorch only) keeps JAX off the GPU if it is imported.
CHILD_ENV = {
    "env": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    "gla": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    "train": {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92"},
    "decode": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
}
HEADLINE = {
    "gla": ("gla_over_fla_triton_T8192",),
    "train": ("train_tokens_per_s_3b", "train_mfu_3b", "train_mfu_published_peak_3b"),
    "decode": ("decode_tokens_per_s_3b_1280",),
}
# The write-up's figures the headlines stand beside (docs/design.md s6): not measured here.
REFERENCES = {
    "train_tokens_per_s_trn2_48xlarge": 120_000,
    "trn2_chips_per_instance": 16,
    "train_tokens_per_s_per_trn2_chip": 7_500,
    "decode_tokens_per_s_trn2_48xlarge_1280": 11_544,
    "source": "the public write-up, docs/design.md s6 (one trn2.48xlarge: 16 Trainium2 chips)",
}
DEFAULT_OUT = RESULTS / "device.json"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.device", description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on any machine (CPU)")
    ap.add_argument(
        "--out",
        type=Path,
        help="result file (default: bench/results/device.json; "
        "the dry run: a file in the temp directory)",
    )
    ap.add_argument("--parts", default=",".join(PARTS), help=f"a subset of {','.join(PARTS)}")
    ap.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="PART=SECONDS",
        help="override one part's budget",
    )
    ap.add_argument("--part", help=argparse.SUPPRESS)  # internal: run one part (a child)
    ap.add_argument("--part-out", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown part(s) {', '.join(unknown)}: choose from {', '.join(PARTS)}")
    budgets = dict(BUDGETS["dry" if args.dry_run else "real"])
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in budgets or not seconds:
            ap.error(f"--budget {item!r}: expected PART=SECONDS, PART one of {', '.join(budgets)}")
        budgets[name] = float(seconds)
    args.budgets = budgets
    return args


def child(args) -> int:
    """Run one part in this process (started by `spawn`): its record goes to --part-out."""
    import importlib

    from bench.device.part import Part

    part = Part(args.part, args.part_out, args.deadline, args.dry_run)
    part.save()
    try:
        importlib.import_module(f"bench.device.{args.part}").run(part)
    except BaseException as e:  # noqa: BLE001 - the record says what went wrong
        part.error("part", e)
        part.finish("error")
        return 1
    return 0


def spawn(name: str, budget: float, dry_run: bool, workdir: Path) -> dict:
    """Run part `name` in a child process; kill its process group GRACE_S after its budget."""
    out = workdir / f"{name}.json"
    start = time.time()
    cmd = [
        sys.executable,
        "-m",
        "bench.device",
        "--part",
        name,
        "--part-out",
        str(out),
        "--deadline",
        str(start + budget),
    ] + (["--dry-run"] if dry_run else [])
    env = dict(os.environ)
    for key, value in CHILD_ENV[name].items():  # a setting of the caller's wins
        env.setdefault(key, value)
    print(f"== {name}: budget {budget:.0f} s", flush=True)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    status = None
    try:
        rc = proc.wait(timeout=budget + GRACE_S)
    except subprocess.TimeoutExpired:
        kill(proc)
        rc = proc.wait()
        status = "timeout"
    except BaseException:  # Ctrl-C: the child is in its own session, end it too
        kill(proc)
        raise
    record = {"part": name, "status": "crashed", "skips": [], "errors": []}
    if out.is_file():
        try:
            record = json.loads(out.read_text())
        except json.JSONDecodeError:
            pass
    if status is None and rc != 0 and record.get("status") in ("running", "crashed", None):
        status = "crashed"
    if status is not None:
        record["status"] = status
        record.setdefault("errors", []).append(
            {
                "what": "part",
                "error": f"{status}: exit code {rc} after {time.time() - start:.0f} "
                f"s (budget {budget:.0f} s + {GRACE_S} s grace); the record is what it had saved",
            }
        )
    record["wall_s"] = round(time.time() - start, 2)
    record["exit_code"] = rc
    print(f"== {name}: {record['status']} in {record['wall_s']:.0f} s", flush=True)
    return record


def kill(proc) -> None:
    """End the child's process group (its compile workers too), if it is still there."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def plan_parts(env: dict, parts: list[str], dry_run: bool) -> dict:
    """{part: reason} of the parts that cannot run here. The dry run runs all on any machine;
    without the env check's findings (it failed) every part runs and records its own trouble."""
    found = env.get("found")
    if not found:
        return {}
    jax_info, torch_info = found.get("jax", {}), found.get("torch", {})
    skip = {}
    for name in parts:
        if name in ("gla", "train") and not jax_info.get("ok"):
            skip[name] = f"JAX is not usable: {jax_info.get('error', 'the env check failed')}"
        elif name == "decode" and not torch_info.get("ok"):
            skip[name] = f"PyTorch is not usable: {torch_info.get('error', 'the env check failed')}"
        elif dry_run:
            continue
        elif name in ("gla", "train") and not jax_info.get("accelerator"):
            skip[name] = (
                f"JAX sees no accelerator (backend {jax_info.get('backend')}): the 3B "
                "shapes are for a GPU; run --dry-run on a CPU"
            )
        elif name == "decode" and not torch_info.get("cuda"):
            skip[name] = (
                "PyTorch sees no CUDA device: 1,280 sequences of 3B state are for a "
                "GPU; run --dry-run on a CPU"
            )
    return skip


def headline_of(parts: dict, dry_run: bool) -> dict:
    """The four keys; null in the dry run (not 3B figures) and where a part did not measure."""
    out = {}
    for name, keys in HEADLINE.items():
        got = parts.get(name, {}).get("headline") or {}
        for key in keys:
            value = got.get(key)
            out[key] = None if dry_run or value is None else float(value)
    return out


def table(result: dict) -> str:
    lines = [f"{'part':8s} {'status':9s} {'wall s':>7s}  notes"]
    for name, rec in result["parts"].items():
        notes = "; ".join(f"skip {s['what']}: {s['reason']}" for s in rec.get("skips", []))
        notes += "".join(f"; error {e['what']}: {e['error'][:120]}" for e in rec.get("errors", []))
        lines.append(
            f"{name:8s} {rec.get('status', '?'):9s} {rec.get('wall_s', 0):7.0f}  "
            f"{notes.lstrip('; ')}"
        )
    lines.append("")
    ref = result["references"]
    chip = ref["train_tokens_per_s_per_trn2_chip"]
    instance = ref["decode_tokens_per_s_trn2_48xlarge_1280"]
    beside = {
        "gla_over_fla_triton_T8192": "our time / fla Triton's (> 1: ours slower)",
        "train_tokens_per_s_3b": f"one device; write-up: {chip:,} per trn2 chip",
        "train_mfu_3b": "against the bf16 matmul rate measured in the same rounds",
        "train_mfu_published_peak_3b": "against the device kind's published peak (train/peak.py)",
        "decode_tokens_per_s_3b_1280": f"one device; write-up: {instance:,} on a trn2.48xlarge",
    }
    for key, value in result["headline"].items():
        shown = "null" if value is None else f"{value:,.4g}"
        lines.append(f"{key:30s} {shown:>12s}   {beside[key]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.part:
        return child(args)
    start = time.time()
    mode = "dry run (tiny shapes)" if args.dry_run else "real run"
    print(f"bench.device: {mode}; parts {', '.join(args.parts)}; budgets {args.budgets}")
    with tempfile.TemporaryDirectory(prefix="bench_device_") as tmp:
        workdir = Path(tmp)
        env = spawn("env", args.budgets["env"], args.dry_run, workdir)
        skip = plan_parts(env, args.parts, args.dry_run)
        parts = {}
        for name in args.parts:
            if name in skip:
                print(f"== {name}: skipped: {skip[name]}", flush=True)
                parts[name] = {
                    "part": name,
                    "status": "skipped",
                    "skips": [{"what": name, "reason": skip[name]}],
                    "errors": [],
                }
                continue
            parts[name] = spawn(name, args.budgets[name], args.dry_run, workdir)
    skips = [{"part": name, **s} for name, rec in parts.items() for s in rec.get("skips", [])]
    result = {
        "headline": headline_of(parts, args.dry_run),
        "dry_run": args.dry_run,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "wall_s": round(time.time() - start, 1),
        "budgets_s": args.budgets,
        "environment": env.get("found", {}),
        "environment_status": env.get("status"),
        "skips": skips,
        "parts": parts,
        "references": REFERENCES,
        "notes": (
            "each part ran in its own process under its own budget; a headline ratio or rate is "
            "the median over interleaved rounds, its min and max beside it in the part; "
            "gla_over_fla_triton_T8192 is our forward+backward time over fla Triton's; "
            "train_mfu_3b counts model FLOPs (training_flops_per_token) against the bf16 matmul "
            "rate probed in the same rounds, train_mfu_published_peak_3b against the published "
            "dense bf16 peak of the device kind (train/peak.py; null for a kind the table lacks), "
            "as the trainer logs it; decode ran on random weights (bf16) with fp32 "
            "state; dry-run headlines are null (tiny shapes are not 3B figures)"
        ),
    }
    out = args.out
    measured = any(rec.get("status") not in ("skipped",) for rec in parts.values())
    if out is None:
        if args.dry_run or not measured:
            out = Path(tempfile.gettempdir()) / "bench_device_dry_run.json"
            if not args.dry_run:
                print(f"nothing measured: {DEFAULT_OUT} is left as it is")
        else:
            out = DEFAULT_OUT
    path = write_result("device", result.pop("headline"), path=out, **result)
    result = json.loads(path.read_text())
    print()
    print(table(result))
    print(f"\nwrote {path} in {result['wall_s']:.0f} s")
    return 0
