"""The training loop: for each step a batch, the jitted step, evaluation, the metrics line, the
checkpoint and the stops (non-finite steps in a row, preemption); then the end of the run (the
last checkpoint written, the logs closed, a greedy sample). `Trainer` is everything the loop
needs (train.startup.set_up builds it); `Hooks` let tests and tools step in."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from laplace_jax.sharding import logical_sharding, one_device
from train import lost_peer
from train.checkpoint import Checkpointer
from train.config import RunConfigs
from train.metrics import Metrics, json_number
from train.preemption import PREEMPTED_EXIT, PreemptionWatch
from train.profiling import StepTrace
from train.step import EVAL_BATCH_AXES, TRAIN_BATCH_AXES, TRAIN_MASK_AXES


@dataclasses.dataclass
class Hooks:
    """In-process hooks into the loop (not on the command line; for tests and tools).

    `batch(step, tokens)` returns the host batch [A, M, T + 1] that step `step` (1-based) trains
    on instead of `tokens` (with `--task`, `tokens` and the result are pairs (tokens, answer mask
    [A, M, T])); `after_step(step)` runs once step `step` is logged and its checkpoint
    (if any) started.
    """

    batch: Callable[[int, np.ndarray], np.ndarray] | None = None
    after_step: Callable[[int], None] | None = None


@dataclasses.dataclass
class Trainer:
    """Everything the loop needs, built by `set_up`."""

    cfg: RunConfigs
    mesh: Any
    say: Callable[..., None]
    main_proc: bool
    ckpt_dir: Path
    layout: tuple[int, int, int]  # (global sequences B, accumulation steps A, micro-batch M)
    batches: Any  # train.data.BatchIterator
    val_batches: list
    tokenizer_src: Path | None
    train_step: Callable
    eval_step: Callable
    state: dict
    start: int
    ckpt: Checkpointer
    metrics: Metrics
    meta: dict
    trace: StepTrace  # --profile-steps
    flops_per_token: float
    peak: float  # FLOP/s of the mesh, the MFU denominator (train/peak.py `mesh_peak`)
    no_bar: bool = False

    @property
    def tokens_per_step(self) -> int:
        return self.layout[0] * self.cfg.model.seq_len


# ---- the loop -------------------------------------------------------------------------------


def train_loop(t: Trainer, hooks: Hooks, watch: PreemptionWatch) -> int:
    """Steps t.start+1 .. steps: train, evaluate, log, checkpoint. 0; 2 after too many
    non-finite steps in a row; PREEMPTED_EXIT after a preemption notice (`watch`), once the
    step it arrived in is checkpointed."""
    tc, (_, A, M) = t.cfg.train, t.layout
    batch_sharding = logical_sharding(t.mesh, TRAIN_BATCH_AXES)
    global_shape = (A, M, t.cfg.model.seq_len + 1)
    bar = tqdm(total=tc.steps, initial=t.start, disable=not t.main_proc or t.no_bar, unit="step")
    window = [0, 0.0]  # tokens and seconds of timed steps since the last metrics line
    for step in range(t.start, tc.steps):
        done = step + 1
        t.trace.before(done)
        t_step = time.perf_counter()  # step time: data, dispatch, compute (not eval or saves)
        local = next(t.batches)  # tokens, or (tokens, answer mask) with --task
        if hooks.batch is not None:
            local = hooks.batch(done, local)
        if isinstance(local, tuple):  # a task: the loss counts the answer positions only
            tokens, mask = local
            batch = jax.make_array_from_process_local_data(batch_sharding, tokens, global_shape)
            mask_shape = (*global_shape[:2], global_shape[2] - 1)
            mask_sharding = logical_sharding(t.mesh, TRAIN_MASK_AXES)
            mask = jax.make_array_from_process_local_data(mask_sharding, mask, mask_shape)
            t.state, m = t.train_step(t.state, batch, mask)
        else:
            batch = jax.make_array_from_process_local_data(batch_sharding, local, global_shape)
            t.state, m = t.train_step(t.state, batch)
        m = jax.device_get(m)
        if step > t.start:  # the first step of a process includes compilation
            window[0] += t.tokens_per_step
            window[1] += time.perf_counter() - t_step
        t.trace.after(done, t.state)
        if not m["applied"]:
            t.say(
                f"\nstep {done}: loss {m['loss']} / grad norm {m['grad_norm']} not finite; "
                f"update skipped ({m['bad_streak']} in a row)"
            )
        is_last = done == tc.steps
        val_loss = None
        if t.val_batches and (is_last or (tc.eval_every and done % tc.eval_every == 0)):
            val_loss = evaluate(t)
        regular = done % tc.log_every == 0 or step == t.start or is_last
        if regular or val_loss is not None or not m["applied"]:
            log_step(t, done, m, val_loss, window, bar)
            window[:] = [0, 0.0]
        bar.update(1)
        if m["bad_streak"] >= tc.max_bad_steps:
            bar.close()
            stop_on_bad_streak(t, int(m["bad_streak"]))
            return 2
        saved = (done % tc.ckpt_every == 0 or is_last) and m["bad_streak"] == 0
        if saved:
            save_checkpoint(t, done)
        lost_peer.PROGRESS.step = done
        if hooks.after_step is not None:
            hooks.after_step(done)
        if watch.reached(done):
            bar.close()
            return stop_on_preemption(t, done, saved or m["bad_streak"] > 0)
    bar.close()
    return 0


def save_checkpoint(t: Trainer, done: int) -> None:
    params, opt_state = t.state["params"], t.state["opt_state"]
    t.ckpt.save(done, params, opt_state, t.batches.get_state(), t.meta)


def stop_on_preemption(t: Trainer, done: int, saved: bool) -> int:
    """Save step `done` (unless saved already, or its update was skipped as non-finite: then
    the last good checkpoint stays the newest), wait for the write, say where it is."""
    if not saved:
        save_checkpoint(t, done)
    t.ckpt.wait()
    steps = t.ckpt.all_steps()
    who = f" (process {jax.process_index()})" if jax.process_count() > 1 else ""
    if steps:
        saved_to = f"checkpoint saved to {t.ckpt_dir / str(steps[-1])}"
    else:  # every step so far was skipped as non-finite
        saved_to = "no checkpoint (no finite step yet)"
    print(  # every process says it: each saved its part of the same step
        f"\npreempted at step {steps[-1] if steps else done}{who}: {saved_to}; rerun the same "
        f"command to resume (exit status {PREEMPTED_EXIT})",
        flush=True,
    )
    return PREEMPTED_EXIT


def log_step(t: Trainer, done: int, m: dict, val_loss, window, bar) -> None:
    """One metrics.jsonl line; `lr` is the rate optax applied this step (see train/step.py)."""
    tps = window[0] / window[1] if window[1] > 0 else float("nan")
    record = {
        "step": done,
        "loss": float(m["loss"]),
        "grad_norm": float(m["grad_norm"]),
        "lr": float(m["lr"]),
        "tokens_per_s": tps,
        "mfu": tps * t.flops_per_token / t.peak,
        "applied": bool(m["applied"]),
        "tokens": done * t.tokens_per_step,
    }
    if val_loss is not None:
        record["val_loss"] = val_loss
    t.metrics.write({k: json_number(v) for k, v in record.items()})
    post = {"loss": f"{record['loss']:.3f}", "tok/s": f"{tps:,.0f}", "mfu": f"{record['mfu']:.1%}"}
    if val_loss is not None:
        post["val"] = f"{val_loss:.3f}"
    bar.set_postfix(post, refresh=False)


def stop_on_bad_streak(t: Trainer, streak: int) -> None:
    t.ckpt.wait()
    steps = t.ckpt.all_steps()
    last_good = t.ckpt_dir / str(steps[-1]) if steps else "none"
    t.say(
        f"\nstopping: {streak} non-finite steps in a row "
        f"(max_bad_steps={t.cfg.train.max_bad_steps}); last good checkpoint: {last_good}"
    )


def evaluate(t: Trainer) -> float:
    M, seq_len = t.layout[2], t.cfg.model.seq_len
    sharding = logical_sharding(t.mesh, EVAL_BATCH_AXES)
    losses = [
        t.eval_step(
            t.state["params"], jax.make_array_from_process_local_data(sharding, b, (M, seq_len + 1))
        )
        for b in t.val_batches
    ]
    return float(np.mean(jax.device_get(losses)))


# ---- the end --------------------------------------------------------------------------------


def finish(t: Trainer, status: int) -> int:
    """Stop a trace still running, wait for the last checkpoint, close the logs; after a good
    run, print a greedy sample. The run has finished and saved by then: a sample that fails is
    one warning line, and the exit status stays the run's."""
    t.trace.close(t.state)
    t.ckpt.close()
    t.metrics.close()
    tc = t.cfg.train
    if status == 0 and tc.sample_tokens and t.tokenizer_src is not None:
        try:
            params = sample_params(t.state["params"])
            if t.main_proc:
                print_sample(params, t.cfg.model, t.tokenizer_src, tc)
        except Exception as e:  # noqa: BLE001  the checkpoint and logs are complete already
            step = (t.ckpt.complete_steps() or ["none"])[-1]
            print(
                f"warning: the end-of-run sample failed ({type(e).__name__}: {e}); the run "
                f"finished, its newest checkpoint is step {step}",
                file=sys.stderr,
            )
    return status


def sample_params(params):
    """The parameters on one device (sharding.one_device), however the mesh shards them: the
    greedy sample's programs then run on that device alone, with no collective. They travel
    through the host (a copy of each shard, no device program); with several processes every
    process takes part in gathering them, and only the main one samples."""
    if jax.process_count() > 1:  # the shards span several hosts
        host = multihost_utils.process_allgather(params, tiled=True)
    else:
        host = jax.device_get(params)
    return jax.device_put(host, one_device())


def print_sample(params, cfg, tokenizer_path, tcfg) -> None:
    from tokenizers import Tokenizer

    from laplace_jax.generate import greedy_generate

    tok = Tokenizer.from_file(str(tokenizer_path))
    prompt = tok.encode(tcfg.sample_prompt, add_special_tokens=False).ids or [0]
    new = greedy_generate(params, cfg, np.array(prompt, np.int32), tcfg.sample_tokens)
    text = tok.decode(list(prompt) + [int(t) for t in new])
    print(f"greedy sample ({tcfg.sample_tokens} tokens):\n{text}")
