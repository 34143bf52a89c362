"""The accelerator a run trains on (train/backend.py) and the peak its MFU is measured against
(train/peak.py): an accelerator asked for and missing stops the run with the install to use;
MFU is against the device's published peak, a matmul rate timed once only where the table has no
entry."""

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from shared_fixtures import REPO, START_ENV

from laplace_spec.config import ConfigError
from train import backend, peak


@pytest.mark.parametrize(
    "argv, env, install",
    [
        (["--platform", "gpu"], {}, "bash scripts/install.sh cuda"),
        ([], {"JAX_PLATFORMS": "tpu"}, "bash scripts/install.sh tpu"),
    ],
)
def test_an_accelerator_asked_for_and_missing_stops_the_run(tmp_path, argv, env, install):
    """The real command on this CPU machine: one error line naming the install, exit 2, nothing
    trained or written (before, `--platform` did not exist, and JAX_PLATFORMS=tpu ended in a
    traceback from inside JAX)."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "train.main", "--config", "tiny", "--run-dir", str(run), *argv]
    done = subprocess.run(
        cmd, cwd=REPO, env={**START_ENV, **env}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and install in errors[0] and "Traceback" not in done.stderr
    assert "cannot start the" in errors[0] and "no " in errors[0]  # no plugin installed
    assert not run.exists()


def test_a_platform_name_jax_does_not_know_is_refused(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "metal")
    with pytest.raises(ConfigError, match="JAX_PLATFORMS=metal: not a platform"):
        backend.requested(None)
    assert backend.requested("gpu") == "cuda"


def test_a_cpu_run_on_a_machine_with_an_accelerator_says_so(tmp_path, monkeypatch):
    """Asked for nothing, JAX runs on the CPU: a note when a device file shows a GPU."""
    assert backend.check(None) is None  # this machine: no accelerator, nothing to say
    fake = tmp_path / "nvidia0"
    fake.touch()
    monkeypatch.setitem(backend.DEVICE_FILES, "cuda", str(fake))
    note = backend.check(None)
    assert note.startswith(f"note: this machine has a cuda device ({fake}) but JAX has no cuda")
    assert "bash scripts/install.sh cuda" in note
    assert backend.check("cpu") is None  # the CPU asked for: nothing to say
    assert backend.devices_line().startswith("devices: 8 x 'cpu' (cpu, jax 0.10.0), 1 process")


@pytest.mark.parametrize(
    "kind, tflops",
    [
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100-PCIE-40GB", 312),
        ("NVIDIA A100 80GB PCIe", 312),
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA H200 NVL", 835),
        ("NVIDIA GH200 480GB", 989),
        ("NVIDIA B200", 2250),
        ("TPU v4", 275),
        ("TPU v5 lite", 197),
        ("TPU v5", 459),
        ("TPU v5p", 459),
        ("TPU v6 lite", 918),
        ("NC_v3d", 166.75),
        ("NC_v3", 83.375),
        ("NC_v2", 95),
    ],
)
def test_the_peak_table_knows_the_common_accelerators(kind, tflops):
    assert peak.peak_flops_per_device(kind) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize(
    "kind", ["cpu", "TPU v4 lite", "NVIDIA H1000", "NVIDIA GeForce RTX 4090", "TPU v5 litex"]
)
def test_a_kind_the_table_lacks_is_not_guessed(kind):
    assert peak.peak_flops_per_device(kind) is None


def _mesh(kind, platform, n):
    device = SimpleNamespace(platform=platform, device_kind=kind)
    return SimpleNamespace(devices=np.array([device] * n, dtype=object), size=n)


def test_mfu_is_against_the_published_peak_and_the_probe_only_where_the_table_lacks_one():
    """8 H100s: the table's peak, no probe (before, every kind but Neuron's was measured with an
    fp32 matmul); a kind the table lacks: the probe, once, and the note says so."""
    probes = []

    def probe(mesh):
        probes.append(mesh)
        return 1.5e11

    flops, note = peak.mesh_peak(_mesh("NVIDIA H100 80GB HBM3", "gpu", 8), 0.0, probe)
    assert flops == 8 * 989e12 and not probes
    assert note.startswith("note: MFU against the published peak: 8 x 'NVIDIA H100 80GB HBM3'")
    flops, note = peak.mesh_peak(_mesh("NVIDIA L4", "gpu", 2), 0.0, probe)
    assert flops == 1.5e11 and len(probes) == 1
    assert "timed once now" in note and "no gpu device kind 'NVIDIA L4'" in note
    flops, note = peak.mesh_peak(_mesh("NC_v3d", "neuron", 64), 5e15, probe)
    assert flops == 5e15 and len(probes) == 1  # set: neither table nor probe
