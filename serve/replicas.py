"""Replicas: vLLM's data parallel on CPU, each engine's threads bound to its own cores.

`python -m serve.vllm_adapter --data-parallel-size N` serves N whole engines behind one API
server (vLLM starts `EngineCore_DP0..N-1`, each with its worker). vLLM gives the worker threads
of local data-parallel rank r the r-th '|'-separated core list of VLLM_CPU_OMP_THREADS_BIND;
vLLM 0.32's automatic binding would put every replica on the same cores (those of the first
NUMA node), so the adapter sets the variable from `resolve_replicas`:

    default                   the cores this process may use (os.sched_getaffinity; SMT siblings
                              kept in one replica) cut into N equal consecutive slices
    --cpu-cores-per-replica K N slices of K cores, the rest left free
    --bind "0-3|4-7"          explicit lists, checked: one per replica, usable, unshared
    VLLM_CPU_OMP_THREADS_BIND already set: taken as --bind (`nobind`: no binding)

Fewer cores than replicas, or lists that do not fit, are a ValueError naming the flag at fault
(the adapter's command line turns it into a usage error).
"""

from __future__ import annotations

import os
from pathlib import Path

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def available_cores() -> list[int]:
    """The CPU ids this process may run on (os.sched_getaffinity), in topology order: by
    package, then physical core, so that SMT siblings are adjacent (one replica, not two)."""
    if hasattr(os, "sched_getaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
    else:  # pragma: no cover - not Linux
        cpus = list(range(os.cpu_count() or 1))

    def topology(cpu: int) -> tuple[int, int, int]:
        base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = int((base / "physical_package_id").read_text())
            core = int((base / "core_id").read_text())
        except (OSError, ValueError):
            return (0, cpu, cpu)
        return (package, core, cpu)

    return sorted(cpus, key=topology)


def parse_core_list(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8] (the syntax of one VLLM_CPU_OMP_THREADS_BIND group)."""
    cores: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ValueError(f"cannot read core list {text!r} (want e.g. '0-3,8')")
        cores += range(int(lo), int(hi) + 1) if sep else [int(lo)]
    return cores


def format_core_list(cores) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8'."""
    out: list[str] = []
    cores = sorted(cores)
    i = 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        out.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(out)


def replica_binding(
    replicas: int,
    *,
    cores_per_replica: int | None = None,
    bind: str | None = None,
    available: list[int] | None = None,
    bind_source: str = "--bind",
) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for `replicas` data-parallel engines: one core list per
    replica, separated by '|' (e.g. '0|1', '0-3|4-7'); vLLM gives local DP rank r the r-th list.

    bind: explicit lists, checked (one per replica, cores this process may use, no core in two
    replicas). Otherwise the available cores (`available_cores()`) are cut into `replicas`
    consecutive slices of `cores_per_replica` (default: as many as divide evenly); the cores
    left over stay free. None (vLLM's own binding) for one replica given neither option.
    Raises ValueError naming the flag at fault.
    """
    if replicas < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {replicas}")
    avail = available_cores() if available is None else list(available)
    if bind is not None and cores_per_replica is not None:
        raise ValueError("give --bind or --cpu-cores-per-replica, not both")
    if bind is not None:
        groups = bind.split("|")
        if len(groups) != replicas:
            raise ValueError(
                f"{bind_source}={bind!r} has {len(groups)} core list(s) for "
                f"--data-parallel-size {replicas}: give one per replica, separated by '|' "
                f"(e.g. {'|'.join(map(str, avail[:replicas]))!r})"
            )
        lists = []
        for g in groups:
            try:
                lists.append(parse_core_list(g))
            except ValueError as e:
                raise ValueError(f"{bind_source}={bind!r}: {e}") from None
        outside = sorted({c for cores in lists for c in cores} - set(avail))
        if outside:
            raise ValueError(
                f"{bind_source}={bind!r} names cores {outside} that this process may not use "
                f"(os.sched_getaffinity: {format_core_list(avail)})"
            )
        for r, cores in enumerate(lists):
            for s in range(r):
                if shared := sorted(set(cores) & set(lists[s])):
                    raise ValueError(
                        f"{bind_source}={bind!r}: replicas {s} and {r} share cores {shared}; "
                        "give each replica its own cores"
                    )
        return "|".join(format_core_list(cores) for cores in lists)
    if replicas == 1 and cores_per_replica is None:
        return None
    if len(avail) < replicas:
        raise ValueError(
            f"--data-parallel-size {replicas} needs at least {replicas} CPU cores (one per "
            f"replica); this process may use {len(avail)}: {format_core_list(avail)}"
        )
    k = len(avail) // replicas if cores_per_replica is None else cores_per_replica
    if k < 1:
        raise ValueError(f"--cpu-cores-per-replica must be at least 1, got {k}")
    if k * replicas > len(avail):
        raise ValueError(
            f"--data-parallel-size {replicas} x --cpu-cores-per-replica {k} needs "
            f"{k * replicas} CPU cores; this process may use {len(avail)}: "
            f"{format_core_list(avail)}"
        )
    return "|".join(format_core_list(avail[r * k : (r + 1) * k]) for r in range(replicas))


_DP_FLAGS = ("--data-parallel-size", "-dp")


def resolve_replicas(args, bind_cores: bool = True) -> None:
    """Settle args.data_parallel_size (ours or vLLM's flag through --vllm-arg, which is then
    taken out of the passthrough) and args.replica_bind (the VLLM_CPU_OMP_THREADS_BIND value to
    set, or None to leave the environment alone; always None without `bind_cores`: on a GPU
    each replica takes its own device, vLLM's business). ValueError names the flag at fault."""
    passed, args.vllm_arg = _pop_data_parallel_size(list(args.vllm_arg))
    n = args.data_parallel_size
    if passed is not None and n is not None and passed != n:
        raise ValueError(f"--data-parallel-size {n} and --vllm-arg --data-parallel-size {passed}")
    args.data_parallel_size = n = n if n is not None else (passed if passed is not None else 1)
    if not bind_cores:
        if args.bind is not None or args.cpu_cores_per_replica is not None:
            raise ValueError(
                "--bind and --cpu-cores-per-replica bind CPU cores: on a GPU, drop them"
            )
        args.replica_bind = None
        return
    bind, source = args.bind, "--bind"
    env = os.environ.get(BIND_ENV, "auto")
    if bind is None and args.cpu_cores_per_replica is None and env not in ("auto", ""):
        if n == 1 or env == "nobind":  # the user's own setting, passed on as it is
            args.replica_bind = None
            return
        bind, source = env, BIND_ENV
    args.replica_bind = replica_binding(
        n, cores_per_replica=args.cpu_cores_per_replica, bind=bind, bind_source=source
    )


def _pop_data_parallel_size(vllm_args: list[str]) -> tuple[int | None, list[str]]:
    """vLLM's own --data-parallel-size given through --vllm-arg: (its value, the other args)."""
    size, rest, i = None, [], 0
    while i < len(vllm_args):
        a = vllm_args[i]
        name, eq, value = a.partition("=")
        if name.replace("_", "-") in _DP_FLAGS:
            if not eq:
                if i + 1 >= len(vllm_args):
                    raise ValueError(f"--vllm-arg={a} has no value")
                i, value = i + 1, vllm_args[i + 1]
            try:
                size = int(value)
            except ValueError:
                raise ValueError(f"--vllm-arg={name}={value!r}: not an integer") from None
        else:
            rest.append(a)
        i += 1
    return size, rest
