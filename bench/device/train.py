"""The training part: the project's Laplace 3B training step on one device.

The step is the trainer's own (`train.build.build_model` -> `train.step.make_train_step`) from the
run configs `train.config.resolve` gives the `laplace-3b` preset with `compute_dtype=bfloat16`
(fp32 master weights), Muon + AdamW (`OPTIMIZER_PRESETS["laplace-3b"]`), `remat=layer` and
document resets after the end-of-text id (`EOT_ID`; every `doc_len`-th token of the batch is one),
seq 2,048, on a 1-device mesh, parameters and optimizer state initialised on the device.

The micro-batch: the largest that fits (`search_micro_batch`). Each size tried is compiled
ahead of time (`lower(...).compile()` on abstract inputs) and XLA's memory analysis
(`train.plan.memory`) predicts its peak; a size predicted over `SAFETY` x the device's memory
limit is not run, one predicted to fit is run once, and an out-of-memory is caught. From the first
size's peak, the part extrapolates (peak = fixed + M x per-sequence bytes) the largest size that
should fit, then tries that, stepping down when it does not fit; a few compiles at most.

The figures: rounds of (a bf16 matmul probe, one step) after the warm-up; tokens/s per round and
MFU = `training_flops_per_token` x tokens/s / the same round's bf16 matmul rate (model FLOPs: the
rematerialised forward is not counted). Headlines `train_tokens_per_s_3b`, `train_mfu_3b`: medians.
"""

from __future__ import annotations

import functools
import time

import jax
import numpy as np

from bench.device.part import Part, is_out_of_memory, spread
from train.peak import peak_flops_per_device

EOT_ID = 50256  # GPT-2's end-of-text: the id the 3B recipe's data resets at (bench/results/plan)
SAFETY = 0.9  # a compiled step may plan to use this share of the device's memory limit
GIB = 1024**3
SIZES = {
    "real": {
        "preset": "laplace-3b",
        "seq_len": 2048,
        "doc_len": 512,
        "first_micro_batch": 8,
        "max_micro_batch": 128,
        "multiple": 2,
        "max_tries": 4,
        "max_rounds": 6,
        "min_rounds": 2,
        "matmul_n": 8192,
        "matmul_reps": 10,
    },
    "dry": {
        "preset": "tiny",
        "seq_len": 64,
        "doc_len": 16,
        "first_micro_batch": 2,
        "max_micro_batch": 4,
        "multiple": 1,
        "max_tries": 2,
        "max_rounds": 2,
        "min_rounds": 2,
        "matmul_n": 256,
        "matmul_reps": 3,
    },
}


def next_size(m, rec, limit, best, *, max_size, multiple, safety=SAFETY):
    """The next micro-batch to try after trying `m` (record `rec`), or None to stop.

    With a memory limit and a predicted peak: peak(M) = fixed + M x per_seq, fitted through this
    attempt (`fixed`: the arguments plus one fp32 gradient, the bytes that do not grow with M), and
    the largest multiple of `multiple` under safety x limit. After a run that fitted, grow to it
    (if larger); after a size predicted over the limit, take it (below m); after an out-of-memory
    that was predicted to fit, three quarters of m. Without a limit: halve after a failure only.
    Never a size at or below the best that already ran."""
    ran = bool(rec.get("ran"))
    if limit is None or rec.get("peak") is None:
        nxt = None if ran else m // 2
    else:
        per_seq = max((rec["peak"] - rec["fixed"]) / m, 1.0)
        fit = int((safety * limit - rec["fixed"]) // per_seq) // multiple * multiple
        if ran:
            nxt = min(fit, max_size) if fit > m else None
        elif rec.get("predicted_over"):
            nxt = min(fit, m - multiple)
        else:  # out of memory although predicted to fit
            nxt = (m * 3 // 4) // multiple * multiple
    if nxt is None or nxt < 1 or (best is not None and nxt <= best):
        return None
    return nxt


def search_micro_batch(attempt, first, limit, *, max_size, multiple, max_tries, time_ok):
    """(largest micro-batch that ran or None, the attempts). `attempt(m)` compiles and, if it is
    predicted to fit, runs size m: a record with `ran`, `peak`, `fixed`, `predicted_over`.
    `time_ok(attempts)` is asked before every attempt after the first."""
    attempts, best, m = [], None, first
    while m is not None and len(attempts) < max_tries:
        if attempts and not time_ok(attempts):
            break
        rec = attempt(m)
        attempts.append(rec)
        if rec.get("ran") and (best is None or m > best):
            best = m
        m = next_size(m, rec, limit, best, max_size=max_size, multiple=multiple)
        if m is not None and any(a["micro_batch"] == m for a in attempts):
            break
    return best, attempts


@functools.cache
def _matmul_probe(n: int):
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    return f, a


def bf16_matmul_flops(n: int, reps: int) -> float:
    """FLOP/s of one [n, n] x [n, n] bf16 matmul, best of `reps`, measured now."""
    f, a = _matmul_probe(n)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


class Trainer:
    """The compiled steps of one model at several micro-batch sizes, and its train state."""

    def __init__(self, size: dict):
        import jax

        from laplace_jax.accounting import parameter_counts, training_flops_per_token
        from laplace_jax.sharding import make_mesh
        from train import config as train_config
        from train.build import build_model

        self.size, T = size, size["seq_len"]
        probe = train_config.resolve(size["preset"], [], {})
        self.eot = EOT_ID if EOT_ID < probe.model.vocab_size else probe.model.vocab_size - 1
        overrides = [
            f"seq_len={T}",
            "compute_dtype=bfloat16",
            "remat=layer",
            "doc_reset=on",
            f"eot_id={self.eot}",
        ]
        self.cfg = train_config.resolve(size["preset"], overrides, {})
        self.mesh = make_mesh(1)
        self.parts = build_model(self.cfg, self.mesh, eot_id=self.eot)
        self.flops_per_token = training_flops_per_token(self.cfg.model)
        self.n_params = parameter_counts(self.cfg.model)["total_params"]
        self.param_bytes = 4 * self.n_params  # fp32: one gradient's bytes
        stats = jax.devices()[0].memory_stats() or {}
        self.limit = stats.get("bytes_limit")
        self.state = None
        self.programs = {}

    def describe(self) -> dict:
        m, t = self.cfg.model, self.cfg.train
        return {
            "preset": self.size["preset"],
            "params": self.n_params,
            "flops_per_token": self.flops_per_token,
            "seq_len": m.seq_len,
            "compute_dtype": m.compute_dtype,
            "remat": t.remat,
            "eot_id": self.eot,
            "doc_len": self.size["doc_len"],
            "optimizer": self.cfg.optim.to_dict(),
            "memory_limit_bytes": self.limit,
            "safety": SAFETY,
            "devices": 1,
        }

    def ensure_state(self):
        """The train state, (re)initialised on the device when missing or donated away."""
        import jax
        import jax.numpy as jnp

        from laplace_jax.model import init_params

        leaves = [] if self.state is None else jax.tree.leaves(self.state)
        if leaves and not any(x.is_deleted() for x in leaves):
            return
        self.state = None
        p = self.parts
        params = jax.jit(lambda k: init_params(self.cfg.model, k), out_shardings=p["p_shard"])(
            jax.random.key(0)
        )
        opt_state = jax.jit(p["tx"].init, out_shardings=p["o_shard"])(params)
        bad = jax.device_put(jnp.zeros((), jnp.int32), p["state_shard"]["bad_streak"])
        self.state = {"params": params, "opt_state": opt_state, "bad_streak": bad}

    def batch(self, m: int):
        """[1, m, T + 1] random tokens, an end-of-text every `doc_len` tokens (packed documents)."""
        import jax

        from laplace_jax.sharding import logical_sharding
        from train.step import TRAIN_BATCH_AXES

        T, d = self.cfg.model.seq_len, self.size["doc_len"]
        rng = np.random.default_rng(m)
        tokens = rng.integers(0, self.cfg.model.vocab_size, (1, m, T + 1), dtype=np.int32)
        tokens[..., d - 1 :: d] = self.eot
        return jax.device_put(tokens, logical_sharding(self.mesh, TRAIN_BATCH_AXES))

    def compile(self, m: int):
        import jax
        import jax.numpy as jnp

        from laplace_jax.sharding import logical_sharding
        from train.step import TRAIN_BATCH_AXES

        p, T = self.parts, self.cfg.model.seq_len
        state = {
            "params": p["abs_params"],
            "opt_state": p["abs_opt"],
            "bad_streak": jax.ShapeDtypeStruct(
                (), jnp.int32, sharding=p["state_shard"]["bad_streak"]
            ),
        }
        batch = jax.ShapeDtypeStruct(
            (1, m, T + 1), jnp.int32, sharding=logical_sharding(self.mesh, TRAIN_BATCH_AXES)
        )
        return p["train_step"].lower(state, batch).compile()

    def step(self, m: int) -> tuple[float, dict]:
        """One step of size m (compiled before): (seconds, metrics as floats)."""
        import jax

        self.ensure_state()
        program, batch = self.programs[m]
        t0 = time.perf_counter()
        self.state, metrics = program(self.state, batch)
        jax.block_until_ready(metrics)
        seconds = time.perf_counter() - t0
        return seconds, {k: float(v) for k, v in metrics.items()}

    def attempt(self, m: int) -> dict:
        """Compile size m, check its predicted peak, run it once if predicted to fit."""
        from train.plan import memory

        rec = {"micro_batch": m, "ran": False}
        t0 = time.perf_counter()
        try:
            program = self.compile(m)
        except Exception as e:  # noqa: BLE001 - only an out-of-memory is an answer here
            if not is_out_of_memory(e):
                raise
            rec.update(compile_s=time.perf_counter() - t0, error=f"compile: {str(e)[:300]}")
            return rec
        rec["compile_s"] = time.perf_counter() - t0
        mem = memory(program, (self.limit or float("inf")) / GIB)
        rec.update(memory=mem, peak=mem["peak"], fixed=mem["arguments"] + self.param_bytes)
        if self.limit is not None and mem["peak"] > SAFETY * self.limit:
            rec["predicted_over"] = True
            return rec
        self.ensure_state()
        self.programs[m] = (program, self.batch(m))
        try:
            seconds, metrics = self.step(m)
        except Exception as e:  # noqa: BLE001
            if not is_out_of_memory(e):
                raise
            del self.programs[m]
            rec["error"] = f"run: {str(e)[:300]}"
            return rec
        rec.update(ran=True, first_step_s=seconds, loss=metrics["loss"])
        return rec


def summarise(part: Part, rounds: list, tokens: int) -> None:
    keys = ("step_s", "tokens_per_s", "mfu", "bf16_matmul_flops_per_s")
    figures = {k: spread([r[k] for r in rounds]) for k in keys}
    published = [r["mfu_published_peak"] for r in rounds if r["mfu_published_peak"] is not None]
    if published:
        figures["mfu_published_peak"] = spread(published)
    part.result.update(tokens_per_step=tokens, figures=figures)
    part.result["headline"] = {
        "train_tokens_per_s_3b": figures["tokens_per_s"]["median"],
        "train_mfu_3b": figures["mfu"]["median"],
        "train_mfu_published_peak_3b": (
            figures["mfu_published_peak"]["median"] if published else None
        ),
    }


def run(part: Part) -> None:
    size = SIZES["dry" if part.dry_run else "real"]
    t0 = time.perf_counter()
    trainer = Trainer(size)
    part.result["config"] = trainer.describe()
    part.result["build_s"] = time.perf_counter() - t0
    kind = jax.devices()[0].device_kind
    published = peak_flops_per_device(kind)  # the trainer's MFU denominator, per device
    part.result.update(device_kind=kind, published_peak_flops_per_s=published)
    part.say(
        f"device kind {kind!r}: published dense bf16 peak "
        + ("not in train/peak.py's table" if published is None else f"{published / 1e12:g} TFLOP/s")
    )
    bf16_matmul_flops(size["matmul_n"], 1)  # compile the probe before the state takes memory
    part.say(
        f"{size['preset']}: {trainer.n_params:,} parameters, memory limit "
        f"{'unknown' if trainer.limit is None else f'{trainer.limit / GIB:.1f} GiB'}"
    )
    attempts = part.result.setdefault("attempts", [])

    def attempt(m):
        rec = trainer.attempt(m)
        attempts.append(rec)
        part.say(
            f"micro-batch {m}: compile {rec.get('compile_s', 0):.1f} s, predicted peak "
            f"{rec.get('peak', 0) / GIB:.2f} GiB, "
            + ("ran" if rec["ran"] else rec.get("error", "predicted over the limit"))
        )
        part.save()
        return rec

    def time_ok(done):
        last = done[-1]
        need = 1.5 * last.get("compile_s", 0) + 4 * last.get("first_step_s", 0) + 10
        return part.remaining() > need

    best, _ = search_micro_batch(
        attempt,
        size["first_micro_batch"],
        trainer.limit,
        max_size=size["max_micro_batch"],
        multiple=size["multiple"],
        max_tries=size["max_tries"],
        time_ok=time_ok,
    )
    part.result["micro_batch"] = best
    if best is None:
        part.result["headline"] = dict.fromkeys(
            ("train_tokens_per_s_3b", "train_mfu_3b", "train_mfu_published_peak_3b")
        )
        part.skip("rounds", "no micro-batch size ran (see attempts)")
        part.finish("partial")
        return
    tokens = best * trainer.cfg.model.seq_len
    rounds = part.result.setdefault("rounds", [])
    while len(rounds) < size["max_rounds"]:
        last = rounds[-1]["step_s"] if rounds else 0.0
        if len(rounds) >= size["min_rounds"] and part.remaining() < 2 * last + 5:
            break
        if rounds and part.remaining() < last + 3:
            break
        rate = bf16_matmul_flops(size["matmul_n"], size["matmul_reps"])
        seconds, metrics = trainer.step(best)
        tps = tokens / seconds
        rounds.append(
            {
                "step_s": seconds,
                "tokens_per_s": tps,
                "bf16_matmul_flops_per_s": rate,
                "mfu": trainer.flops_per_token * tps / rate,
                "mfu_published_peak": (
                    trainer.flops_per_token * tps / published if published else None
                ),
                "loss": metrics["loss"],
                "applied": metrics["applied"],
            }
        )
        part.say(
            f"round {len(rounds)}: {seconds:.3f} s/step, {tps:,.0f} tokens/s, "
            f"MFU {rounds[-1]['mfu']:.1%} (bf16 matmul {rate / 1e12:.1f} TFLOP/s)"
        )
        summarise(part, rounds, tokens)  # after every round: a kill later keeps the figures
        part.save()
    complete = len(rounds) >= size["min_rounds"] and not part.result["errors"]
    part.finish("ok" if complete else "partial")
