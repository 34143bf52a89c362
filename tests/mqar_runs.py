"""The MQAR training runs of tests/test_tasks.py and tests/test_hybrid_recall.py: `train.main`
on one CPU device in a subprocess, a minute or two each, run by the background queue
(tests/background.py) from the start of the session, or by the test itself when nothing queued
it (a test run alone).
"""

from __future__ import annotations

import sys
from pathlib import Path

VOCAB = 256  # the hybrid's MQAR task vocabulary (bench.retrieval's): 127 keys, chance 1/128
RECALL_STEPS = 400


def task_args(run_dir: Path, steps: int, *extra: str) -> list[str]:
    """MQAR (64, 4) over a 32-token task vocabulary (15 keys, 16 values: chance is 1/16) on the
    tiny preset widened to d_model 128, 200 steps of 32 sequences (measured: 95% accuracy; 91%
    and 99% with seeds 1 and 2; 120 steps are too few: 24%)."""
    return [
        *_widened("mqar:num_pairs=4,vocab_size=32", run_dir, steps),
        "total_steps=200",
        "sample_tokens=0",
        *extra,
    ]


def recall_args(run_dir: Path) -> list[str]:
    """The 3:1 hybrid (three GLA layers, then attention; d_model 128) trained RECALL_STEPS steps
    on MQAR (64, 4) over VOCAB tokens, checkpointed at its end."""
    return [
        *_widened(f"mqar:num_pairs=4,vocab_size={VOCAB}", run_dir, RECALL_STEPS),
        f"total_steps={RECALL_STEPS}",
        f"ckpt_every={RECALL_STEPS}",
        "sample_tokens=0",
        "n_layers=4",
        "attention_every=4",
    ]


def task_runs(root: Path) -> list[list[str]]:
    """tests/test_tasks.py's: ROOT/run, 200 steps straight; ROOT/part, 4 steps, then resumed
    to 6."""
    return [
        task_args(root / "run", 200, "ckpt_every=200"),
        task_args(root / "part", 4, "ckpt_every=4"),
        task_args(root / "part", 6, "ckpt_every=4"),
    ]


def recall_runs(root: Path) -> list[list[str]]:
    """tests/test_hybrid_recall.py's: ROOT/run."""
    return [recall_args(root / "run")]


RUNS = {"mqar_task_runs": task_runs, "hybrid_recall_run": recall_runs}  # fixture -> its runs


def _widened(task: str, run_dir: Path, steps: int) -> list[str]:
    return [
        "--config",
        "tiny",
        "--task",
        task,
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--steps",
        str(steps),
        "--mesh",
        "fsdp=1",
        "global_batch_tokens=2048",
        "eval_every=0",
        "d_model=128",
        "d_v=32",
        "d_k=16",
        "ffn_dim=256",
        "warmup_steps=20",
    ]


def commands(runs: list[list[str]], env: dict) -> list[tuple[list[str], dict]]:
    """`python -m train.main ARGS` for each run, on one CPU device at XLA's default optimisation
    (the tests' compile flags, tests/xla_env.py, would make these runs twice as slow)."""
    env = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    return [([sys.executable, "-m", "train.main", *args], env) for args in runs]
