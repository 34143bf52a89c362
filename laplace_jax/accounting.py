"""Parameter, state and FLOP accounting, computed from shapes only (`jax.eval_shape`)."""

from __future__ import annotations

import math

from laplace_jax.config import LaplaceConfig
from laplace_jax.model import abstract_params, flat_paths, is_muon_path

FP32_BYTES = 4
BF16_BYTES = 2


def parameter_counts(config: LaplaceConfig) -> dict[str, int]:
    """Muon matrices (count and parameters), AdamW parameters and the total, without weights."""
    shapes = flat_paths(abstract_params(config))
    muon = {p: s for p, s in shapes.items() if is_muon_path(p)}
    muon_params = sum(math.prod(s.shape) for s in muon.values())
    total = sum(math.prod(s.shape) for s in shapes.values())
    return {
        "muon_matrices": len(muon),
        "muon_params": muon_params,
        "adamw_params": total - muon_params,
        "total_params": total,
    }


def state_bytes_per_sequence(config: LaplaceConfig, conv_window: int | None = None) -> dict:
    """Recurrent-state bytes of one sequence (fp32): GLA matrices plus the conv input window.

    The model keeps the last `conv_width` conv inputs (4 for 3B: 29,491,200 bytes, the write-up's
    29.5 MB); a decoder that keeps only the `conv_width - 1` past inputs would need 29,196,288.
    """
    W = config.conv_width if conv_window is None else conv_window
    L, H = config.n_layers, config.n_heads
    gla = L * H * config.d_k * config.d_v * FP32_BYTES
    conv = L * W * config.d_model * FP32_BYTES
    return {"gla": gla, "conv": conv, "total": gla + conv}


def kv_cache_bytes(config: LaplaceConfig, n_tokens: int) -> int:
    """bf16 K and V of a comparable softmax transformer (same width and depth) at n_tokens."""
    return 2 * config.n_layers * config.d_model * BF16_BYTES * n_tokens


def gla_flops_per_token(config: LaplaceConfig) -> int:
    """Forward FLOPs per token of the chunked GLA beyond the weight matmuls, all layers.

    Per head and token: Q K^T and A V inside the chunk (2 C d_k + 2 C d_v), its write into the
    state and the read of the previous state (2 d_k d_v each).
    """
    C, dk, dv = config.chunk_size, config.d_k, config.d_v
    per_head = 2 * C * (dk + dv) + 4 * dk * dv
    return config.n_layers * config.n_heads * per_head


def training_flops_per_token(config: LaplaceConfig) -> int:
    """Model FLOPs of one training token: 6 x parameters (the write-up's count) + 3 x GLA terms."""
    return 6 * parameter_counts(config)["total_params"] + 3 * gla_flops_per_token(config)
