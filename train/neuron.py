"""Start the trainer on AWS Trainium (trn2): the Neuron environment of one trainer process and
the launcher (the peak-FLOP table that replaces the CPU matmul probe is train/peak.py).

    python -m train.neuron launch --instances N --index I --coordinator HOST:PORT \\
        [--cores 64] [--lnc 2] [--cache-dir DIR] [--cc-flags "..."] [--dry-run] -- TRAIN_ARGS

runs `python -m train.main TRAIN_ARGS` (on instance I of N) with the environment of
`neuron_env` and, unless TRAIN_ARGS set them, `scan_unroll=true` (the Neuron compiler needs the
whole backward graph), `init_on_host=true` (RNG init compiles slowly on a NeuronCore) and
`peak_flops` from `NEURON_CORE_PEAK` of train/peak.py (the MFU denominator). `--dry-run` prints the
environment and the command and exits. The launcher `exec`s the trainer (the same process id), so a
scheduler's SIGTERM reaches `train.main` itself, which saves and exits 75 (train/preemption.py).
If the runtime rejects Muon's all_to_all, add `muon_mode=gather` to
TRAIN_ARGS: the gather form uses only all-gathers (docs/design.md s4), the one-flag fallback.

This project has not run any of this on Trainium hardware: the environment builder is unit
tested and `python -m train.neuron_smoke` runs here on simulated CPU devices. Run that smoke
script first on a real instance.

Choices, and the documentation they follow (AWS Neuron docs, awsdocs-neuron.readthedocs-hosted.com):

- One process per instance, owning all its logical NeuronCores: the Neuron JAX training
  tutorial (AXLearn on trn2, "Fuji 8B ... Pretraining") sets, per node,
  `NEURON_PJRT_PROCESSES_NUM_DEVICES` to the device count of every process as a comma list
  (`64,64,...`), `NEURON_PJRT_PROCESS_INDEX` to the node's index, `NEURON_RT_ROOT_COMM_ID` to
  `MASTER_ADDR:MASTER_PORT` and gives JAX's coordinator another port (41000 and 41001 there;
  here the runtime takes the coordinator's port + 1). `processes_per_instance` > 1 splits an
  instance's cores into equal consecutive ranges (the smoke script's 2-process start uses it).
- `NEURON_RT_VISIBLE_CORES`: "Range of specific NeuronCores needed by the process", an integer
  or a range like `1-3` (Neuron Runtime configuration guide); a NeuronCore is reserved by one
  process at a time.
- `NEURON_LOGICAL_NC_CONFIG`: "controls how many physical NeuronCores are grouped to make up a
  logical NeuronCore" (Logical NeuronCore configuration page); 2 on trn2 gives 64 logical cores
  per trn2.48xlarge (LNC=1 gives 128; trn1 supports only 1). The compiler is told the same
  through the runtime's setting: the docs do not support a different `--lnc` at compile time.
- Persistent compile cache: `NEURON_COMPILE_CACHE_URL` is where libneuronxla keeps compiled NEFFs
  (`--cache_dir` in NEURON_CC_FLAGS would take precedence); `JAX_COMPILATION_CACHE_DIR` is JAX's
  own cache, as the Neuron JAX tutorial sets it. The default lives on local disk and persists
  across runs; with several instances, a shared file system path lets them share NEFFs.
- `NEURON_CC_FLAGS`: `--auto-cast=none`. neuronx-cc's default casts fp32 matmuls to bf16 ("By
  default, the Neuron Compiler will automatically cast FP32 matrix multiplication operations to
  BF16", mixed-precision guide; the release notes announce the default moving to none). The
  model chooses its own compute dtype (`compute_dtype`), keeps what must stay fp32 in fp32
  (loss, norms, the decay cumsums, fp32 master weights and optimizer state), and the fp32 tests
  and the Muon a2a-versus-gather comparison assume the declared dtypes are the computed ones.
  Integers (neuronx-cc 2.27, Neuron 2.32 release notes): `--native-int64=enabled` runs int64
  natively "without precision loss on trn2 and later" (pass `--native-int64=disabled` on trn1);
  `--implicit-integer-downcast=none` makes an integer op without a native datapath (dot,
  scatter, all_reduce, reduce_scatter, pow) a compile error (NCC_EVRF060/061) instead of a
  silent fp32 emulation that loses integers above 2^24. Both are the defaults announced for
  the release after 2.32; pinning them keeps behaviour fixed across SDK versions. The trainer's
  device programs hold no 64-bit integers and no integer dot or collective (the Neuron census of
  `python -m train.plan`), so neither flag should trigger.
- JAX's coordinator: `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`, what
  `train.distributed.maybe_initialize_distributed` reads, set only when there is more than one
  process.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence

from laplace_spec.config import ConfigError
from train import cli
from train.peak import NEURON_CORE_PEAK

DEFAULT_CC_FLAGS: tuple[str, ...] = (
    "--auto-cast=none",
    "--native-int64=enabled",
    "--implicit-integer-downcast=none",
)
# The settings the launcher adds to train.main's unless given (`peak_flops` comes with them):
# the Neuron compiler needs the whole backward graph, and RNG init compiles slowly on a core.
LAUNCH_SETTINGS: dict[str, str] = {"scan_unroll": "true", "init_on_host": "true"}

DEFAULT_CACHE_DIR = "/var/tmp/neuron-compile-cache"  # Neuron's usual local NEFF cache location


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def _host_port(name: str, value: str) -> tuple[str, int]:
    host, sep, port = str(value).rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65534:
        raise ConfigError(f"{name} must be HOST:PORT with a port in 1..65534, got {value!r}")
    return host, int(port)


def neuron_env(
    n_instances: int,
    instance_index: int,
    *,
    coordinator: str | None = None,
    cores_per_instance: int = 64,
    logical_nc: int = 2,
    processes_per_instance: int = 1,
    local_rank: int = 0,
    cache_dir: str = DEFAULT_CACHE_DIR,
    cc_flags: Sequence[str] = DEFAULT_CC_FLAGS,
    rt_root_comm: str | None = None,
) -> dict[str, str]:
    """The environment variables of one trainer process (a pure function: nothing is set).

    `n_instances` machines, this one `instance_index` (0-based); each runs
    `processes_per_instance` processes (default one, owning all `cores_per_instance` logical
    NeuronCores; this is process `local_rank` of them). `coordinator` (HOST:PORT, the host of
    process 0) is required with more than one process: JAX's coordinator listens there and the
    Neuron runtime's root communicator on the next port (or `rt_root_comm`). See the module
    docstring for what each variable does and where that is documented.

    Raises ConfigError (a ValueError) naming the argument at fault.
    """
    _positive_int("n_instances", n_instances)
    _positive_int("cores_per_instance", cores_per_instance)
    _positive_int("processes_per_instance", processes_per_instance)
    if isinstance(instance_index, bool) or not isinstance(instance_index, int):
        raise ConfigError(f"instance_index must be an integer, got {instance_index!r}")
    if not 0 <= instance_index < n_instances:
        raise ConfigError(
            f"instance_index must be in 0..{n_instances - 1} (n_instances={n_instances}), "
            f"got {instance_index}"
        )
    if logical_nc not in (1, 2):
        raise ConfigError(
            f"logical_nc must be 1 or 2 (physical cores per logical core), got {logical_nc!r}"
        )
    if cores_per_instance % processes_per_instance:
        raise ConfigError(
            f"processes_per_instance ({processes_per_instance}) must divide cores_per_instance "
            f"({cores_per_instance})"
        )
    if isinstance(local_rank, bool) or not isinstance(local_rank, int):
        raise ConfigError(f"local_rank must be an integer, got {local_rank!r}")
    if not 0 <= local_rank < processes_per_instance:
        raise ConfigError(
            f"local_rank must be in 0..{processes_per_instance - 1}, got {local_rank}"
        )
    if not cache_dir:
        raise ConfigError("cache_dir must be a directory path, got an empty one")
    if isinstance(cc_flags, str):
        raise ConfigError("cc_flags must be a sequence of flags, not one string")

    n_processes = n_instances * processes_per_instance
    cores = cores_per_instance // processes_per_instance  # devices of each process
    first = local_rank * cores
    env = {
        "NEURON_LOGICAL_NC_CONFIG": str(logical_nc),
        "NEURON_RT_VISIBLE_CORES": str(first) if cores == 1 else f"{first}-{first + cores - 1}",
        "NEURON_PJRT_PROCESSES_NUM_DEVICES": ",".join([str(cores)] * n_processes),
        "NEURON_PJRT_PROCESS_INDEX": str(instance_index * processes_per_instance + local_rank),
        "NEURON_COMPILE_CACHE_URL": str(cache_dir),
        "JAX_COMPILATION_CACHE_DIR": os.path.join(str(cache_dir), "jax"),
        "NEURON_CC_FLAGS": " ".join(cc_flags),
    }
    if coordinator is None:
        if n_processes > 1:
            raise ConfigError(
                f"coordinator (HOST:PORT of process 0) is required with {n_processes} processes"
            )
        return env
    host, port = _host_port("coordinator", coordinator)
    if rt_root_comm is not None:
        _host_port("rt_root_comm", rt_root_comm)
    env["NEURON_RT_ROOT_COMM_ID"] = rt_root_comm or f"{host}:{port + 1}"
    env["JAX_COORDINATOR_ADDRESS"] = f"{host}:{port}"
    env["JAX_NUM_PROCESSES"] = str(n_processes)
    env["JAX_PROCESS_ID"] = env["NEURON_PJRT_PROCESS_INDEX"]
    return env


# ---- the launcher ---------------------------------------------------------------------------


def unset_settings(overrides: list[str], wanted: dict[str, str]) -> list[str]:
    """`key=value` for each of `wanted` that the `key=value` `overrides` do not set."""
    given = {item.partition("=")[0].removeprefix("train.") for item in overrides}
    return [f"{k}={v}" for k, v in wanted.items() if k not in given]


def train_settings(train_args: list[str], n_devices: int, logical_nc: int) -> list[str]:
    """The `key=value` settings the launcher adds to the train.main arguments: each one unless
    the arguments already set it. `peak_flops` is the table's trn2 peak times the mesh's devices
    (`--mesh` if given, else every device of the run). A bad `--mesh` is train.main's
    ConfigError."""
    args = cli.parse_args(train_args)
    if args.mesh:
        data, fsdp, context = cli.mesh_sizes(args.mesh)
        n_devices = data * fsdp * context
    peak = NEURON_CORE_PEAK[f"trn2-lnc{logical_nc}"] * n_devices
    wanted = {**LAUNCH_SETTINGS, "peak_flops": f"{peak:.6g}"}
    return unset_settings(args.overrides, wanted)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(launcher options, train.main arguments after `--`)."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    ours, train_args = argv[:split], argv[split + 1 :]
    ap = argparse.ArgumentParser(
        prog="python -m train.neuron",
        description="Start python -m train.main on Trainium with the Neuron environment.",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    la = sub.add_parser(
        "launch",
        help="run train.main on this instance",
        description="Run `python -m train.main TRAIN_ARGS` on instance INDEX of N. Add "
        "muon_mode=gather to TRAIN_ARGS if the runtime rejects Muon's all_to_all.",
        usage="python -m train.neuron launch --instances N --index I [--coordinator HOST:PORT] "
        "[options] -- TRAIN_ARGS",
    )
    la.add_argument("--instances", type=int, default=1, help="instances in the run (default 1)")
    la.add_argument("--index", type=int, default=0, help="this instance's index, 0-based")
    la.add_argument("--coordinator", help="HOST:PORT of instance 0 (needed with N > 1)")
    la.add_argument("--cores", type=int, default=64, help="logical NeuronCores per instance")
    la.add_argument("--lnc", type=int, default=2, help="physical cores per logical core (1|2)")
    la.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="persistent compile cache")
    la.add_argument(
        "--cc-flags",
        help=f"neuronx-cc flags, replacing the default {' '.join(DEFAULT_CC_FLAGS)!r}",
    )
    la.add_argument("--dry-run", action="store_true", help="print the environment and exit")
    return ap.parse_args(ours), train_args


def launch(opts: argparse.Namespace, train_args: list[str]) -> int:
    """Print the environment and command, then (unless --dry-run) exec train.main."""
    cc_flags = shlex.split(opts.cc_flags) if opts.cc_flags is not None else DEFAULT_CC_FLAGS
    env = neuron_env(
        opts.instances,
        opts.index,
        coordinator=opts.coordinator,
        cores_per_instance=opts.cores,
        logical_nc=opts.lnc,
        cache_dir=opts.cache_dir,
        cc_flags=cc_flags,
    )
    added = train_settings(train_args, opts.instances * opts.cores, opts.lnc)
    command = [sys.executable, "-m", "train.main", *train_args, *added]
    for key, value in env.items():
        was = os.environ.get(key)
        note = f"  # replaces {was!r}" if was is not None and was != value else ""
        print(f"export {key}={shlex.quote(value)}{note}")
    print(shlex.join(command))
    sys.stdout.flush()
    if opts.dry_run:
        return 0
    os.execve(sys.executable, command, {**os.environ, **env})
    return 1  # not reached


def main(argv: list[str] | None = None) -> int:
    opts, train_args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return launch(opts, train_args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
