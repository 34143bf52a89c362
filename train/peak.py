"""The MFU denominator on Neuron: the peak dense BF16 FLOP/s of a device by its kind (a table
with its sources), of a whole mesh, and the trainer's choice between the table and its CPU
matmul probe (`with_table_peak`). Imports no JAX: the launcher and `train.plan` read the table.
"""

from __future__ import annotations

import dataclasses

# Peak dense BF16 FLOP/s of one logical NeuronCore (the MFU denominator, per device).
# - Trainium2 architecture page: a Trainium2 chip's "Eight NeuronCore-v3 ... collectively
#   deliver ... 667 BF16/FP16/TF32 TFLOPS" (dense; 1,299 FP8). LNC=2 makes 4 logical cores of
#   a chip, LNC=1 makes 8. (The NeuronCore-v3 page gives 79 TFLOPS for one Tensor Engine, 5%
#   below a chip's eighth.) train/plan.py's modelled step time uses the LNC=2 entry.
# - Trainium architecture page (trn1): a Trainium chip's "Two NeuronCore-v2 delivering ...
#   190 FP16/BF16/cFP8/TF32 TFLOPS".
PEAK_FLOPS: dict[str, float] = {
    "trn2-lnc2": 667e12 / 4,  # 166.75 TFLOP/s per logical core, 10.67 PFLOP/s per trn2.48xlarge
    "trn2-lnc1": 667e12 / 8,  # 83.375 TFLOP/s
    "trn1": 190e12 / 2,  # 95 TFLOP/s per NeuronCore-v2
}

# `device_kind` of a JAX Neuron device -> PEAK_FLOPS key. "NC_v3d" is what AXLearn's Neuron
# kernels test for LNC=2 (`lnc = 2 if jax.devices()[0].device_kind == "NC_v3d" else 1`);
# "NC_v3" and "NC_v2" follow that naming and are not confirmed by a document.
DEVICE_KINDS: dict[str, str] = {"NC_v3d": "trn2-lnc2", "NC_v3": "trn2-lnc1", "NC_v2": "trn1"}


def peak_flops_per_device(backend: str, device_kind: str) -> float | None:
    """Peak dense BF16 FLOP/s of one device from `PEAK_FLOPS`; None off Neuron or for a device
    kind the table does not know (the trainer then measures a matmul rate)."""
    if backend != "neuron":
        return None
    key = DEVICE_KINDS.get(device_kind)
    return PEAK_FLOPS[key] if key else None


def mesh_peak_flops(mesh) -> float | None:
    """The whole mesh's peak from the table (per-device peak x devices), or None."""
    device = mesh.devices.flat[0]
    per_device = peak_flops_per_device(device.platform, device.device_kind)
    return None if per_device is None else per_device * mesh.size


def with_table_peak(cfg, mesh):
    """On Neuron with `peak_flops=0`: the mesh's peak from the table in train/peak.py (the
    matmul probe would time the compiled fp32 matmul, not the bf16 peak), with a note line.
    Elsewhere, or for a device kind the table lacks (noted), the probe stays.

    `cfg` is a train.config.RunConfigs; so is the result."""
    device = mesh.devices.flat[0]
    if cfg.train.peak_flops or device.platform != "neuron":
        return cfg
    peak = mesh_peak_flops(mesh)
    if peak is None:
        note = (
            f"note: Neuron device kind {device.device_kind!r} is not in the peak table "
            f"({', '.join(DEVICE_KINDS)}): MFU uses a measured matmul rate; set peak_flops=F"
        )
        return dataclasses.replace(cfg, notices=(*cfg.notices, note))
    note = (
        f"note: peak_flops={peak:.4g} FLOP/s (the MFU denominator): {mesh.size} x "
        f"{device.device_kind} from the Neuron peak table (train/peak.py); set peak_flops=F"
    )
    train = dataclasses.replace(cfg.train, peak_flops=peak)
    return dataclasses.replace(cfg, train=train, notices=(*cfg.notices, note))
