"""The XLA flags of every JAX process a test run starts (this one, set by tests/conftest.py
before JAX starts, and the trainer subprocesses): `devices` simulated CPU devices, and XLA's
CPU backend compiling at LLVM optimisation level 0.

The tests run thousands of tiny programs once each, so compiling is most of their time and
running them little: at level 0 `tests/test_context_training.py` takes 124 s instead of 157 s
here. The programs (the HLO, XLA's own passes, the fp32 arithmetic) are the same; only LLVM's
optimisation of the generated machine code is skipped. Benchmarks and users' runs keep XLA's
default."""

COMPILE_FLAGS = ("--xla_backend_optimization_level=0",)
# CPU devices of each process in the tests that run several JAX processes. One, not two: with two
# devices in each of two processes, XLA:CPU's Gloo collectives now and then delivered a message
# of the wrong size mid-run (gloo's "Received data size doesn't match expected size. 10240 vs
# 128", both processes aborting; every rank's log showed the same collectives in the same order),
# in 2 of 9 runs of 40 steps here; with one device each, 0 of 25 runs of 40 steps.
DEVICES_PER_PROCESS = 1


def xla_flags(devices: int, inherited: str = "") -> str:
    """XLA_FLAGS for a process of `devices` CPU devices (`inherited`: flags to keep, whose
    device count is replaced)."""
    kept = [f for f in inherited.split() if "device_count" not in f and f not in COMPILE_FLAGS]
    return " ".join([*kept, *COMPILE_FLAGS, f"--xla_force_host_platform_device_count={devices}"])
