"""The first thing to run on a Trainium instance: `python -m train.neuron_smoke [--cores 2|64]`.

Four short checks of the `tiny` preset, built the way the trainer builds it (its mesh from
`train.cli.mesh_from_flag`, `train.build.build_model`, `init_on_host=true`, `scan_unroll=true`),
each printed as PASS or FAIL with its numbers; the exit status is 1 if any fails:

- `processes`: a 2-process start. Two subprocesses, each with half of the cores and the
  environment of `train.neuron.neuron_env` (one instance, two processes), join through
  `jax.distributed` on 127.0.0.1 as `train.main` does; each reports its process index and device
  counts, and a jitted sum over an array spread across both processes' devices is checked.
  It runs first, before this process takes any core (a NeuronCore belongs to one process).
- `muon`: two optimizer steps with Muon's `a2a` and `gather` modes on the same gradients; every
  AdamW leaf must be bit-identical, the Muon updates within 1e-5 of the largest entry with fp32
  Newton-Schulz, 2^-5 with bf16; reports the difference and whether they are bit-identical, as
  they are on XLA's CPU backend (docs/design.md s4.2: one arithmetic for every layout; a device
  compiler that orders a batched product's sums by batch size would break that, and this says so).
- `step`: one training step with 2 accumulated micro-batches of one sequence per device; the
  loss and gradient norm must be finite and the update applied.
- `checkpoint`: an orbax save of the state (after `step`) and its restore through
  train/checkpoint.py, compared bit for bit.

Without the Neuron plugin (no `libneuronxla`) it runs on `--cores` simulated CPU devices
(`--xla_force_host_platform_device_count`), which is how this project tests it: it has not been
run on Trainium hardware. With the plugin it sets the variables of `neuron_env` for one process
on cores 0..cores-1 and the rbg PRNG, as the launcher does; `--checks` picks a subset.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from train.neuron import DEFAULT_CACHE_DIR, neuron_env

CHECKS = ("processes", "muon", "step", "checkpoint")
REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m train.neuron_smoke", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--cores", type=int, default=2, help="devices to use (2 or 64 on trn2)")
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"comma list of {', '.join(CHECKS)}")
    ap.add_argument(
        "--backend",
        choices=("auto", "neuron", "cpu"),
        default="auto",
        help="auto: neuron when libneuronxla is installed, else simulated CPU devices",
    )
    ap.add_argument("--lnc", type=int, default=2, help="logical NeuronCore size on Neuron")
    ap.add_argument("--cache-dir", help=f"compile cache (Neuron default {DEFAULT_CACHE_DIR})")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the 2-process start")
    ap.add_argument("--result", help="also write the checks and their figures to this JSON file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one of the 2
    args = ap.parse_args(argv)
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        ap.error(f"unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    if args.cores < 2 or args.cores % 2:
        ap.error(
            f"--cores must be even and at least 2 (two processes share them), got {args.cores}"
        )
    args.checks = [c for c in CHECKS if c in checks]
    if args.backend == "auto":
        args.backend = "neuron" if importlib.util.find_spec("libneuronxla") else "cpu"
    return args


def simulate_cpu_devices(n: int) -> None:
    """n simulated CPU devices (before JAX starts its backend)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    os.environ["JAX_PLATFORMS"] = "cpu"


REPORTS: list[dict] = []  # every check's outcome, for --result


def report(name: str, ok: bool, text: str, seconds: float, **figures) -> bool:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {text} ({seconds:.1f} s)", flush=True)
    REPORTS.append({"check": name, "passed": ok, "seconds": round(seconds, 1), **figures})
    return ok


# ---- processes: a 2-process start ----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child() -> int:
    """One of the two processes: join, then a jitted sum across both processes' devices."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    from laplace_jax.sharding import FSDP, replicated
    from train.cli import mesh_from_flag
    from train.distributed import maybe_initialize_distributed

    maybe_initialize_distributed(False)  # reads JAX_COORDINATOR_ADDRESS etc., as train.main does
    n = jax.device_count()
    mesh = mesh_from_flag(None)  # the trainer's default mesh: every device of both processes
    values = np.arange(1, n + 1, dtype=np.float32)  # every device adds a part of the sum
    x = jax.make_array_from_callback(
        (n,), NamedSharding(mesh, PartitionSpec(FSDP)), lambda i: values[i]
    )
    total = jax.jit(jnp.sum, out_shardings=replicated(mesh))(x)
    answer = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "devices": n,
        "sum": float(total),
        "expected": float(values.sum()),
    }
    print(json.dumps(answer), flush=True)
    return 0


def check_processes(args, cache_dir: str) -> bool:
    t0 = time.perf_counter()
    coordinator, root_comm = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "train.neuron_smoke", "--child", f"--backend={args.backend}"]
    procs = []
    for rank in range(2):
        env = {**os.environ}
        env.update(
            neuron_env(
                1,
                0,
                coordinator=coordinator,
                cores_per_instance=args.cores,
                logical_nc=args.lnc,
                processes_per_instance=2,
                local_rank=rank,
                cache_dir=cache_dir,
                rt_root_comm=root_comm,
            )
        )
        if args.backend == "cpu":
            env["XLA_FLAGS"] = " ".join(
                [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
                + [f"--xla_force_host_platform_device_count={args.cores // 2}"]
            )
        pipe = subprocess.PIPE
        procs.append(
            subprocess.Popen(command, cwd=REPO, env=env, stdout=pipe, stderr=pipe, text=True)
        )
    try:
        outputs = [p.communicate(timeout=args.timeout) for p in procs]
    except subprocess.TimeoutExpired:
        return report(
            "processes", False, f"no answer within {args.timeout:.0f} s", time.perf_counter() - t0
        )
    finally:  # a hung pair must not outlive the check
        for p in procs:
            p.kill()
    reports = []
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if p.returncode != 0 or not lines:
            tail = " | ".join(err.strip().splitlines()[-3:])
            return report(
                "processes",
                False,
                f"process {rank} exited {p.returncode}: {tail}",
                time.perf_counter() - t0,
            )
        reports.append(json.loads(lines[-1]))
    want_local = args.cores // 2
    ok = [r["process_index"] for r in reports] == [0, 1] and all(
        r["process_count"] == 2
        and r["local_devices"] == want_local
        and r["devices"] == args.cores
        and r["sum"] == r["expected"]
        for r in reports
    )
    text = "; ".join(
        f"process {r['process_index']} of {r['process_count']}: {r['local_devices']} of "
        f"{r['devices']} devices, sum {r['sum']:g} (expected {r['expected']:g})"
        for r in reports
    )
    return report("processes", ok, text, time.perf_counter() - t0)


# ---- in-process checks ----------------------------------------------------------------------


def build(args):
    """The trainer's tiny-preset set-up on `--cores` devices: (cfg, mesh, parts, state)."""
    import jax

    from train import config as train_config
    from train.build import build_model, restore_or_init
    from train.checkpoint import Checkpointer
    from train.cli import mesh_from_flag

    m = args.cores  # one sequence per device per micro-step, 2 micro-steps
    overrides = [
        "init_on_host=true",
        "scan_unroll=true",
        f"micro_batch_size={m}",
        f"global_batch_tokens={2 * m * 64}",
        "sample_tokens=0",
    ]
    cfg = train_config.resolve("tiny", overrides, {})
    mesh = mesh_from_flag(f"fsdp={args.cores}")  # as `train.main --mesh fsdp=N` makes it
    parts = build_model(cfg, mesh)
    with tempfile.TemporaryDirectory() as empty:  # no checkpoint: a new state
        ckpt = Checkpointer(empty, async_save=False)
        state, _, _ = restore_or_init(cfg, parts, ckpt, None)
        ckpt.close()
    assert jax.tree.leaves(state["params"])[0].sharding.mesh.size == args.cores
    return cfg, mesh, parts, state


def check_muon(cfg, mesh, parts) -> bool:
    """Two steps of the whole optimizer in `gather` and `a2a` modes on the same gradients."""
    import jax
    import numpy as np
    import optax
    from flax.traverse_util import flatten_dict

    from laplace_spec.param_groups import is_muon_path
    from train import config as train_config
    from train.build import init_params_on_host

    t0 = time.perf_counter()
    shard = parts["p_shard"]
    rng = np.random.default_rng(5)
    grads = [
        jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), parts["abs_params"])
        for _ in range(2)
    ]
    updates = {}
    for mode in ("gather", "a2a"):
        opt_cfg = cfg.optim.replace(muon_mode=mode)
        tx, _, o_shard = train_config.build_optimizer(opt_cfg, parts["abs_params"], shard, mesh)
        params = init_params_on_host(cfg.model, cfg.train.seed, shard)
        state = jax.jit(tx.init, out_shardings=o_shard)(params)
        step = jax.jit(
            tx.update, in_shardings=(shard, o_shard, shard), out_shardings=(shard, o_shard)
        )
        updates[mode] = []
        for g in grads:
            upd, state = step(jax.device_put(g, shard), state, params)
            params = optax.apply_updates(params, upd)
            updates[mode].append(flatten_dict(jax.device_get(upd), sep="/"))
    worst, adamw_equal, identical = 0.0, True, True
    for gather, a2a in zip(updates["gather"], updates["a2a"], strict=True):
        for path, ref in gather.items():
            ref, got = np.asarray(ref), np.asarray(a2a[path])
            identical &= bool(np.array_equal(got, ref))
            if not is_muon_path(path):
                adamw_equal &= bool(np.array_equal(got, ref))
            else:
                scale = float(np.max(np.abs(ref))) or 1.0
                worst = max(worst, float(np.max(np.abs(got - ref))) / scale)
    bound = 1e-5 if cfg.optim.ns_dtype == "float32" else 2.0**-5
    ok = adamw_equal and worst <= bound
    text = (
        f"max |a2a - gather| = {worst:.3g} of the largest Muon update entry (bound {bound:.3g}, "
        f"{cfg.optim.ns_dtype} Newton-Schulz); bit-identical: {'yes' if identical else 'no'}; "
        f"AdamW leaves bit-identical: {'yes' if adamw_equal else 'NO'}; "
        "fallback if a2a fails on the device: muon_mode=gather"
    )
    return report(
        "muon", ok, text, time.perf_counter() - t0, max_a2a_minus_gather=worst, bound=bound
    )


def check_step(cfg, mesh, parts, state):
    """(passed, new state): one step of 2 accumulated micro-batches."""
    import jax
    import numpy as np

    from laplace_jax.sharding import logical_sharding
    from train.config import batch_layout
    from train.step import TRAIN_BATCH_AXES

    t0 = time.perf_counter()
    _, A, M = batch_layout(cfg.train, cfg.model.seq_len, mesh.size)
    tokens = np.random.default_rng(0).integers(0, 256, (A, M, cfg.model.seq_len + 1), np.int32)
    batch = jax.device_put(tokens, logical_sharding(mesh, TRAIN_BATCH_AXES))
    state, m = parts["train_step"](state, batch)
    m = jax.device_get(m)
    loss, norm = float(m["loss"]), float(m["grad_norm"])
    ok = bool(np.isfinite(loss) and np.isfinite(norm) and m["applied"])
    text = (
        f"{A} micro-batches x {M} sequences of {cfg.model.seq_len} tokens: loss {loss:.4f} "
        f"(ln vocab = {np.log(cfg.model.vocab_size):.4f}), grad norm {norm:.4f}, "
        f"applied {bool(m['applied'])}"
    )
    return report("step", ok, text, time.perf_counter() - t0), state


def check_checkpoint(cfg, parts, state) -> bool:
    """An orbax save of params and optimizer state, restored and compared bit for bit."""
    import jax
    import numpy as np

    from train.checkpoint import Checkpointer

    t0 = time.perf_counter()
    meta = {"model": cfg.model.to_dict()}
    with tempfile.TemporaryDirectory() as d:
        ckpt = Checkpointer(Path(d) / "checkpoints", keep=1, async_save=True)
        try:
            ckpt.save(1, state["params"], state["opt_state"], {"smoke": 1}, meta)
            ckpt.wait()
            restored = ckpt.restore_latest(parts["abs_params"], parts["abs_opt"], meta)
        finally:
            ckpt.close()
    saved = {"params": state["params"], "opt_state": state["opt_state"]}
    back = {"params": restored["params"], "opt_state": restored["opt_state"]}
    pairs = list(zip(jax.tree.leaves(saved), jax.tree.leaves(back), strict=True))
    same = sum(bool(np.array_equal(jax.device_get(a), jax.device_get(b))) for a, b in pairs)
    sharded = all(a.sharding == b.sharding for a, b in pairs if hasattr(a, "sharding"))
    nbytes = sum(a.nbytes for a, _ in pairs)
    ok = (
        restored["step"] == 1
        and restored["data"] == {"smoke": 1}
        and same == len(pairs)
        and sharded
    )
    text = (
        f"step {restored['step']}: {same} of {len(pairs)} arrays ({nbytes / 1e6:.2f} MB) "
        f"bit-identical after restore, shardings kept: {'yes' if sharded else 'NO'}"
    )
    return report("checkpoint", ok, text, time.perf_counter() - t0)


def run_checks(args) -> int:
    t_start = time.perf_counter()
    cache_dir = args.cache_dir or (DEFAULT_CACHE_DIR if args.backend == "neuron" else None)
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = cache_dir or str(Path(tmp) / "cache")  # CPU: leave no cache behind
        if args.backend == "neuron":
            os.environ.update(
                neuron_env(
                    1, 0, cores_per_instance=args.cores, logical_nc=args.lnc, cache_dir=cache_dir
                )
            )
        else:
            simulate_cpu_devices(args.cores)
        print(
            f"Laplace Neuron smoke test: backend {args.backend}, {args.cores} devices, "
            f"checks {', '.join(args.checks)}",
            flush=True,
        )
        results = []
        if "processes" in args.checks:  # first: the children need the cores this one would hold
            results.append(check_processes(args, cache_dir))
        rest = [c for c in args.checks if c != "processes"]
        if rest:
            results += in_process_checks(args, rest)
    failed = results.count(False)
    print(
        f"{len(results) - failed} of {len(results)} checks passed"
        + ("" if not failed else "; FAILED")
    )
    if args.result:
        summary = {
            "command": "python -m train.neuron_smoke " + " ".join(sys.argv[1:]),
            "backend": args.backend,
            "cores": args.cores,
            "passed": len(results) - failed,
            "checks": len(results),
            "wall_s": round(time.perf_counter() - t_start, 1),
            "reports": REPORTS,
        }
        Path(args.result).write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if failed else 0


def in_process_checks(args, checks: list[str]) -> list[bool]:
    import jax

    if args.backend == "neuron":
        jax.config.update("jax_default_prng_impl", "rbg")  # as train.main does on Neuron
    device = jax.devices()[0]
    print(f"devices: {jax.device_count()} x {device.device_kind} ({device.platform})", flush=True)
    t0 = time.perf_counter()
    try:
        cfg, mesh, parts, state = build(args)
    except Exception as e:  # noqa: BLE001 - every check needs it: report and stop
        traceback.print_exc()
        return [report("set-up", False, f"{type(e).__name__}: {e}", time.perf_counter() - t0)]
    print(f"set-up: tiny preset, host init, mesh of {mesh.size} ({time.perf_counter() - t0:.1f} s)")
    results = []
    for name in checks:
        t0 = time.perf_counter()
        try:
            if name == "muon":
                results.append(check_muon(cfg, mesh, parts))
            elif name == "step":
                ok, state = check_step(cfg, mesh, parts, state)
                results.append(ok)
            elif name == "checkpoint":
                results.append(check_checkpoint(cfg, parts, state))
        except Exception as e:  # noqa: BLE001 - a failed check is reported, the others run
            traceback.print_exc()
            results.append(
                report(name, False, f"{type(e).__name__}: {e}", time.perf_counter() - t0)
            )
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child()
    return run_checks(args)


if __name__ == "__main__":
    sys.exit(main())
