"""The run directory's own files: `--restart` moving the old run aside, and `config.json` with
the tokenizer copy (the checkpoints are train/checkpoint.py's, `metrics.jsonl` and
`tensorboard/` train/metrics.py's, `profile/` train/profiling.py's)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from train.tokenizer_source import copy_companions


def restart_aside(run_dir: Path, ckpt_dir: Path, say) -> None:
    """--restart: move the checkpoints and metrics into RUN_DIR/restarted-<time>/ (process 0)."""
    names = ("metrics.jsonl", "metrics.superseded.jsonl", "tensorboard")
    corrupt = ckpt_dir.with_name(ckpt_dir.name + "-corrupt")
    found = [p for p in (ckpt_dir, corrupt, *(run_dir / n for n in names)) if p.exists()]
    if found and jax.process_index() == 0:
        dest = run_dir / f"restarted-{time.strftime('%Y%m%d-%H%M%S')}"
        while dest.exists():
            dest = dest.with_name(dest.name + "+")
        dest.mkdir(parents=True)
        for p in found:
            shutil.move(str(p), str(dest / p.name))
        say(f"restart: moved {', '.join(p.name for p in found)} into {dest}; starting at step 0")
    multihost_utils.sync_global_devices("laplace: restart")


def write_run_files(args, cfg, run_dir, tokenizer_src, mesh, layout, data: dict, peak: dict):
    """config.json and the tokenizer copy (process 0); the checkpoint meta they share. Beside the
    three configs, config.json records what the run was given or measured (data, tokenizer,
    mesh, batch, MFU's peak): `--config` reads the configs back and skips those."""
    tokenizer_ref = None
    main_proc = jax.process_index() == 0
    if tokenizer_src is not None:
        tokenizer_ref = str((run_dir / "tokenizer.json").absolute())
        if main_proc and Path(tokenizer_src).resolve() != Path(tokenizer_ref).resolve():
            shutil.copyfile(tokenizer_src, tokenizer_ref)
            copy_companions(tokenizer_src, run_dir)  # tokenizer_config.json, ...: for the export
    B, A, M = layout
    run_config = {
        "model": cfg.model.to_dict(),
        "optimizer": cfg.optim.to_dict(),
        "train": cfg.train.to_dict(),
        "data": data,
        "tokenizer": tokenizer_ref,
        "tokenizer_source": str(tokenizer_src) if tokenizer_src else None,
        "mesh": dict(mesh.shape),
        "processes": jax.process_count(),
        "batch": {"sequences": B, "accum_steps": A, "micro_batch": M},
        "peak": peak,
    }
    if main_proc:
        (run_dir / "config.json").write_text(json.dumps(run_config, indent=2))
    meta = {k: run_config[k] for k in ("model", "optimizer", "train", "tokenizer")}
    meta["tokenizer_source"] = run_config["tokenizer_source"]
    meta["config"] = meta["model"]  # the name export/ looks for first
    return meta
