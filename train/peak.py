"""The MFU denominator: a device's published peak dense BF16 FLOP/s, looked up by its JAX
`device_kind`, and the trainer's choice between that table and a matmul rate measured once at
start, for the kinds the table lacks (the CPU among them). Imports no JAX: the Neuron launcher and
`train.plan` read the table.

Sources (dense: NVIDIA's datasheets give BF16 with 2:4 sparsity, twice these):
- A100: 312 TFLOPS (624 sparse). H100 SXM: 989 (1,979); H100 PCIe: 756 (1,513); H100 NVL: 835
  (1,671). H200 SXM: 989 (1,979); H200 NVL: 835 (1,671). GH200: its H100's 989. B200 (HGX):
  2,250 (4,500).
- Cloud TPU pages, BF16 per chip (one JAX device): v4 275, v5e ("TPU v5 lite") 197, v5p
  ("TPU v5") 459, v6e ("TPU v6 lite", Trillium) 918 TFLOPS.
- Trainium2 architecture page: a chip's "Eight NeuronCore-v3 ... collectively deliver ... 667
  BF16/FP16/TF32 TFLOPS" (dense); LNC=2 makes 4 logical cores of a chip, LNC=1 makes 8. Trainium
  (trn1): a chip's "Two NeuronCore-v2 delivering ... 190 FP16/BF16/cFP8/TF32 TFLOPS".
"""

from __future__ import annotations

# Peak dense BF16 FLOP/s of one logical NeuronCore, by configuration: the launcher's
# `peak_flops`, and train/plan.py's modelled step time (the LNC=2 entry).
NEURON_CORE_PEAK: dict[str, float] = {
    "trn2-lnc2": 667e12 / 4,  # 166.75 TFLOP/s per logical core, 10.67 PFLOP/s per trn2.48xlarge
    "trn2-lnc1": 667e12 / 8,  # 83.375 TFLOP/s
    "trn1": 190e12 / 2,  # 95 TFLOP/s per NeuronCore-v2
}

# Peak dense BF16 FLOP/s of one JAX device, by `device_kind`. An NVIDIA kind carries its memory
# and form after the model's name ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"), so NVIDIA
# keys match as prefixes (the longest wins: "NVIDIA H100 PCIe" before "NVIDIA H100"); the others
# match whole. The Neuron kinds: "NC_v3d" is what AXLearn's Neuron kernels test for LNC=2; "NC_v3"
# and "NC_v2" follow that naming and are not confirmed by a document.
PEAK_FLOPS: dict[str, float] = {
    "NVIDIA A100": 312e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA GH200": 989e12,
    "NVIDIA B200": 2250e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5": 459e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "NC_v3d": NEURON_CORE_PEAK["trn2-lnc2"],
    "NC_v3": NEURON_CORE_PEAK["trn2-lnc1"],
    "NC_v2": NEURON_CORE_PEAK["trn1"],
}


def table_key(device_kind: str) -> str | None:
    """The PEAK_FLOPS key of a device kind, or None when the table lacks it."""
    if device_kind in PEAK_FLOPS:
        return device_kind
    prefixes = [
        k
        for k in PEAK_FLOPS
        if k.startswith("NVIDIA ")
        and device_kind[len(k) : len(k) + 1] in (" ", "-")
        and device_kind.startswith(k)
    ]
    return max(prefixes, key=len, default=None)


def peak_flops_per_device(device_kind: str) -> float | None:
    """Published peak dense BF16 FLOP/s of one device of this kind, or None."""
    key = table_key(device_kind)
    return None if key is None else PEAK_FLOPS[key]


def mesh_peak(mesh, peak_flops: float, measure) -> tuple[float, str]:
    """(the whole mesh's peak FLOP/s, the start-up line saying where it came from): the
    `peak_flops` setting when given (per mesh), else the table's per-device peak x devices, else
    `measure(mesh)`, a matmul rate timed once now (for a kind the table lacks)."""
    device = mesh.devices.flat[0]
    kind = device.device_kind
    if peak_flops:
        return peak_flops, f"note: MFU against peak_flops={peak_flops:.4g} FLOP/s (set)"
    per_device = peak_flops_per_device(kind)
    if per_device is not None:
        peak = per_device * mesh.size
        return peak, (
            f"note: MFU against the published peak: {mesh.size} x {kind!r} at "
            f"{per_device / 1e12:.6g} TFLOP/s dense BF16 = {peak:.4g} FLOP/s (train/peak.py, "
            f"{table_key(kind)!r}); set peak_flops=F"
        )
    peak = measure(mesh)
    return peak, (
        f"note: MFU against a measured fp32 matmul rate, {peak / 1e9:.1f} GFLOP/s, timed once now: "
        f"the peak table (train/peak.py) has no {device.platform} device kind {kind!r}; set "
        "peak_flops=F"
    )
