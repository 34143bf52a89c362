"""docs/training.md: the default run (bench.default_run) and train.prepare's memory on a large
corpus (bench.prepare_memory)."""

from __future__ import annotations

from bench.report.fmt import load, minutes

PAGE = "docs/training.md"


def default_run() -> str:
    d = load("default_run")
    h, val = d["headline"], d["validation"]
    losses = " -> ".join(f"{v['val_loss']:.2f}" for v in val)
    steps = ", ".join(str(v["step"]) for v in val)
    return (
        f"`python -m bench.default_run` ran it in a fresh run directory with a fresh corpus cache "
        f"on this project's {d['machine']['cores']}-core CPU machine: "
        f"{minutes(h['wall_s'])} including the corpus build; training loss "
        f"{h['first_loss']:.2f} (step {d['first_step']}) to {h['last_loss']:.2f} "
        f"(step {h['steps']}), validation loss {losses} at steps {steps} "
        "(`bench/results/default_run.json`)."
    )


def prepare_memory() -> str:
    d = load("prepare_memory")
    h = d["headline"]
    return (
        f"`python -m bench.prepare_memory` prepared a {h['corpus_gb']:g} GB JSON-lines corpus "
        f"({d['corpus_rows']:,} documents, {d['tokens']:,} tokens) with `--workers "
        f"{h['workers']}` in {minutes(d['wall_s'])}: the resident memory of the whole process "
        f"tree peaked at {h['peak_rss_mib_total']:,.0f} MiB (the reading process "
        f"{h['peak_rss_mib_parent']:,.0f} MiB, the largest worker "
        f"{h['peak_rss_mib_largest_worker']:,.0f} MiB; `bench/results/prepare_memory.json`)."
    )


BLOCKS = {"default-run": default_run, "prepare-memory": prepare_memory}
