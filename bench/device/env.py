"""The environment check: what is installed and which accelerators JAX and PyTorch see.

Runs first, in its own process (it initialises both frameworks on the GPU, with JAX's
preallocation off). The parent decides from its record which parts run (`run.plan_parts`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform

from bench.device.part import Part

DISTS = (
    "jax",
    "jaxlib",
    "jax-cuda12-plugin",
    "jax-cuda13-plugin",
    "flax",
    "optax",
    "orbax-checkpoint",
    "torch",
    "triton",
    "fla-core",
    "transformers",
    "einops",
    "numpy",
)
PROJECT_JAX = "0.10.0"  # pyproject.toml's pin


def versions() -> dict:
    out = {}
    for dist in DISTS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def check_jax() -> dict:
    try:
        import jax

        devices = jax.devices()
    except Exception as e:  # noqa: BLE001 - recorded, not raised
        return {"ok": False, "accelerator": False, "error": f"{type(e).__name__}: {e}"[:500]}
    d = devices[0]
    stats = d.memory_stats() or {}  # None on CPU
    return {
        "ok": True,
        "backend": jax.default_backend(),
        "accelerator": d.platform != "cpu",
        "device_count": len(devices),
        "platform": d.platform,
        "device_kind": d.device_kind,
        "bytes_limit": stats.get("bytes_limit"),
    }


def check_torch() -> dict:
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return {"ok": False, "cuda": False, "error": f"{type(e).__name__}: {e}"[:500]}
    out = {
        "ok": True,
        "version": torch.__version__,
        "cuda": bool(torch.cuda.is_available()),
        "cuda_version": torch.version.cuda,
    }
    if out["cuda"]:
        props = torch.cuda.get_device_properties(0)
        out.update(
            device_name=props.name,
            total_memory=props.total_memory,
            capability=list(torch.cuda.get_device_capability(0)),
        )
    return out


def check_fla(torch_info: dict) -> dict:
    """fla-core installed? its Triton chunk kernel importable (only tried with CUDA)?"""
    out = {
        "installed": importlib.util.find_spec("fla") is not None,
        "triton_installed": importlib.util.find_spec("triton") is not None,
    }
    out["triton_kernel"] = False
    if not out["installed"]:
        out["why_not"] = "fla-core is not installed (bring its wheel: pip install fla-core==0.6.0)"
    elif not out["triton_installed"]:
        out["why_not"] = "triton is not installed"
    elif not torch_info.get("cuda"):
        out["why_not"] = "no CUDA device for PyTorch: fla's Triton kernels need a GPU"
    else:
        try:
            from fla.ops.simple_gla import chunk_simple_gla  # noqa: F401

            out["triton_kernel"] = True
        except Exception as e:  # noqa: BLE001
            out["why_not"] = f"import fla.ops.simple_gla failed: {type(e).__name__}: {e}"[:500]
    return out


def run(part: Part) -> None:
    found = {
        "python": platform.python_version(),
        "versions": versions(),
        "project_jax_pin": PROJECT_JAX,
    }
    found["jax"] = check_jax()
    found["torch"] = check_torch()
    found["fla"] = check_fla(found["torch"])
    jax_version = found["versions"].get("jax")
    if jax_version and jax_version != PROJECT_JAX:
        found["note"] = (
            f"jax {jax_version} here, the project pins {PROJECT_JAX}: only APIs "
            "present in both are used (bench/device/__init__.py)"
        )
    part.result["found"] = found
    j, t, f = found["jax"], found["torch"], found["fla"]
    part.say(
        f"jax {jax_version}: {j.get('backend')} x{j.get('device_count')} "
        f"({j.get('device_kind')}); torch {t.get('version')}: cuda={t.get('cuda')} "
        f"{t.get('device_name', '')}; triton {found['versions'].get('triton')}; "
        f"fla-core {found['versions'].get('fla-core')}: Triton kernel "
        f"{'yes' if f['triton_kernel'] else 'no (' + f.get('why_not', '?') + ')'}"
    )
    part.finish("ok")
