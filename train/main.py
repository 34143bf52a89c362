"""Train a Laplace model: `python -m train.main [--config PRESET|file.json] [key=value ...]`.

With no arguments: the `small` preset on the embedded default corpus (the interpreter's standard
library, BPE-tokenised and cached on first use), on every device JAX sees, for a few minutes on
a CPU; it ends by printing a greedy sample. A run directory (default `runs/default`) holds
`metrics.jsonl`, `checkpoints/`, `config.json` and `tokenizer.json`; running again with the same
directory resumes from its newest good checkpoint on exactly the next batch. What a crashed run
logged after that checkpoint is moved from `metrics.jsonl` to `metrics.superseded.jsonl` (each
line with `superseded_at`), so `metrics.jsonl` is one clean curve and no logged line is lost.
The same scalars go to TensorBoard event files in `RUN_DIR/tensorboard/`; `--profile-steps A:B`
traces steps A..B with `jax.profiler` into `RUN_DIR/profile/`.

When no checkpoint can be restored (every one corrupt) the run stops with status 2 and changes
nothing; `--restart` starts over at step 0 after moving the checkpoints and metrics into
`RUN_DIR/restarted-<time>/`.

`key=value` overrides go to the model config (LaplaceConfig), the optimizer config
(OptimizerConfig) or the training config (TrainConfig), whichever has the key; prefix it with
`model.`, `optim.` or `train.` when a name is ambiguous. Unknown keys are errors. Whatever the
trainer chooses for the user (presets of a JSON model, the schedule fitted to the run, parameters
replicated because they do not divide over the mesh) is printed as a `note:` line at start-up.

`--task NAME[:key=value,...]` trains on a synthetic retrieval task instead of token shards
(train/tasks.py): `mqar[:num_pairs=4,vocab_size=V,power_a=0.01]` or
`passkey[:depth=0.5,vocab_size=V,num_digits=5]`, at the model's seq_len, vocab_size defaulting
to the model's. Batches are generated from (seed, step, process), so a resumed run continues the
same sequence; the loss counts the answer positions only; there is no validation loss or sample.

Several hosts: set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (or pass
`--distributed` where JAX detects the cluster itself, e.g. SLURM or Cloud TPU); each process reads
its own share of the data windows.

Tests and tools drive the loop in-process through `Hooks` (`main(argv, hooks=...)`), which are
not on the command line.

Reading order: `main` (below) parses the flags (train/cli.py) and turns the errors a user can
fix into one `error:` line and status 2; `run` sets the run up (train/startup.py: configs, data
or task, mesh, model and state, run files, in that order), then runs the loop and ends the run
(train/loop.py).
"""

from __future__ import annotations

from absl import logging as absl_logging

absl_logging.set_verbosity(absl_logging.ERROR)  # grain and orbax are chatty at import

import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from laplace_spec.config import ConfigError  # noqa: E402
from train import cli, lost_peer  # noqa: E402
from train.checkpoint import (  # noqa: E402
    DiskFull,
    NoUsableCheckpoint,
    RestoreError,
    is_disk_full,
)
from train.loop import Hooks, finish, train_loop  # noqa: E402
from train.preemption import PreemptionWatch  # noqa: E402
from train.startup import set_up  # noqa: E402


def run(args, hooks: Hooks | None = None) -> int:
    """Set up, train, finish: the run's exit status. Whatever happens, the started checkpoint
    save is finished (or abandoned when the disk is full) and the trace and logs are closed."""
    t = set_up(args)
    lost_peer.PROGRESS.step = t.start  # the checkpointer is set by set_up
    watch = PreemptionWatch(t.ckpt.manager.reached_preemption)
    try:
        return finish(t, train_loop(t, hooks or Hooks(), watch))
    except (jax.errors.JaxRuntimeError, TimeoutError) as e:  # several processes: a peer may be
        # gone (a failed collective; orbax's TimeoutError when its commit barrier failed)
        lost_peer.stop_if_peer_lost(e)  # if so, one line and LOST_PEER_EXIT; else:
        t.ckpt.close()
        raise
    except DiskFull:
        t.ckpt.abandon()
        raise
    except OSError as e:
        if not is_disk_full(e):
            t.ckpt.close()
            raise
        t.ckpt.abandon()
        what = f"writing {t.metrics.path} failed; it keeps every complete line"
        raise DiskFull(what, t.metrics.path.parent, None, t.ckpt.complete_steps()) from None
    except BaseException:
        t.ckpt.close()  # let a started save finish; the exception goes on
        raise
    finally:
        watch.close()
        t.trace.close()  # each of these does nothing when already closed
        t.metrics.close()


def main(argv=None, hooks: Hooks | None = None) -> int:
    """The run's exit status; with several processes, this one's end is told to the others
    first (train/lost_peer.py `finished`), so that a process still finishing its own does not
    count this one, gone quiet, as lost."""
    status = run_to_status(argv, hooks)
    lost_peer.finished()
    return status


def run_to_status(argv=None, hooks: Hooks | None = None) -> int:
    """Parse, run, and turn the errors a user can fix into one `error:` line and status 2."""
    from train.shards import ShardError

    args = cli.parse_args(argv)
    t0 = time.perf_counter()
    try:
        if args.print_config:
            from train.config import config_yaml

            print(config_yaml(cli.resolve_configs(args)), end="")
            return 0
        status = run(args, hooks)
    except NoUsableCheckpoint as e:
        aside = Path(args.run_dir) / "restarted-<time>"
        print(
            f"error: {e}.\nTo start this run over at step 0, run the same command with "
            f"--restart: the checkpoints and metrics.jsonl are first moved into {aside}/",
            file=sys.stderr,
        )
        return 2
    except (ConfigError, RestoreError, DiskFull, ShardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if jax.process_index() == 0:
        print(f"wall time {time.perf_counter() - t0:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
