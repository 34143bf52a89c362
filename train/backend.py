"""The accelerator a run trains on: which JAX backend it asks for (`--platform`, or the
`JAX_PLATFORMS` variable JAX itself reads), whether this JAX has it, and the start-up line that
names the backend and its devices.

A run that asks for an accelerator this JAX cannot reach stops before anything else, with one line
naming the install that brings it (exit 2): never a silent CPU run. A run that asks for nothing
takes JAX's default backend (the accelerator, when its plugin is installed); when that is the CPU
on a machine that shows an NVIDIA GPU, a TPU or a Neuron device, a note says so.
"""

from __future__ import annotations

import os

from laplace_spec.config import ConfigError

# --platform's names -> the JAX platform
PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "tpu": "tpu", "neuron": "neuron"}
# what brings each accelerator's JAX backend (docs/index.md, "Install")
INSTALLS = {
    "cuda": "bash scripts/install.sh cuda (jax[cuda13] beside PyPI's CUDA torch; docs/index.md)",
    "tpu": "bash scripts/install.sh tpu (jax[tpu], libtpu; docs/index.md)",
    "neuron": "the Neuron SDK's jax-neuronx on a trn1/trn2 instance (docs/trainium.md)",
    "cpu": "scripts/install.sh (jax and jaxlib; docs/index.md)",
}
# the packages that give JAX each backend
PLUGINS = {
    "cuda": ("jax-cuda13-plugin", "jax-cuda12-plugin"),
    "tpu": ("libtpu",),
    "neuron": ("jax-neuronx", "libneuronxla"),
}
# a device file that shows the accelerator is on the machine, whatever JAX has
DEVICE_FILES = {"cuda": "/dev/nvidia0", "tpu": "/dev/accel0", "neuron": "/dev/neuron0"}


def requested(flag: str | None) -> str | None:
    """The JAX platform the run asks for: `--platform`, else the first of JAX_PLATFORMS, else
    None (JAX's default)."""
    name = flag or os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip() or None
    if name is None:
        return None
    if name.lower() not in PLATFORMS:
        where = "--platform" if flag else "JAX_PLATFORMS"
        raise ConfigError(f"{where}={name}: not a platform ({', '.join(sorted(PLATFORMS))})")
    return PLATFORMS[name.lower()]


def select(flag: str | None) -> str | None:
    """Point JAX at `--platform`'s backend before it starts one (JAX_PLATFORMS does so itself);
    the requested platform, or None."""
    import jax

    platform = requested(flag)
    if flag is not None:
        jax.config.update("jax_platforms", platform)
    return platform


def check(platform: str | None) -> str | None:
    """ConfigError, one line naming the install, when the requested platform's backend cannot
    start; else a note when an unrequested CPU run sits on a machine with an accelerator, or
    None."""
    import jax

    try:
        backend = jax.default_backend()
    except Exception as e:  # RuntimeError; JAX 0.10 asserts when no plugin knows the platform
        if platform is None:
            raise
        why = _first_line(e) if plugin_installed(platform) else f"no {platform} plugin installed"
        raise ConfigError(
            f"JAX {jax.__version__} cannot start the {platform} backend this run asks for "
            f"({why}): install it with {INSTALLS[platform]}"
        ) from None
    if platform is not None and backend != platform:
        raise ConfigError(
            f"the run asks for {platform} but JAX {jax.__version__} runs on {backend}: install "
            f"the {platform} backend with {INSTALLS[platform]}"
        )
    if platform is None and backend == "cpu":
        for accel, path in DEVICE_FILES.items():
            if os.path.exists(path):
                return (
                    f"note: this machine has a {accel} device ({path}) but JAX has no {accel} "
                    f"backend: training on the CPU. Install it with {INSTALLS[accel]}, or pass "
                    "--platform cpu to say the CPU is meant"
                )
    return None


def devices_line() -> str:
    """`devices: 8 x 'NVIDIA H100 80GB HBM3' (cuda, jax 0.10.0), 1 process`."""
    import jax

    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    procs = jax.process_count()
    return (
        f"devices: {len(devices)} x {' + '.join(repr(k) for k in kinds)} ({jax.default_backend()}, "
        f"jax {jax.__version__}), {procs} process{'es' if procs > 1 else ''}"
    )


def plugin_installed(platform: str) -> bool:
    """Whether a package that gives JAX this backend is installed (the CPU's is jaxlib)."""
    from importlib import metadata

    for name in PLUGINS.get(platform, ("jaxlib",)):
        try:
            metadata.version(name)
            return True
        except metadata.PackageNotFoundError:
            continue
    return False


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
