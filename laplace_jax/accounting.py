"""Parameter and FLOP accounting, computed from shapes only (`jax.eval_shape`).

State and KV-cache bytes are derived from the config alone: `LaplaceConfig.state_bytes_per_sequence`
and `LaplaceConfig.kv_cache_bytes` (laplace_spec/config.py).
"""

from __future__ import annotations

import math

from flax import traverse_util

from laplace_jax.model import abstract_params
from laplace_spec.config import LaplaceConfig
from laplace_spec.param_groups import is_muon_path


def parameter_counts(config: LaplaceConfig) -> dict[str, int]:
    """Muon matrices (count and parameters), AdamW parameters and the total, without weights."""
    shapes = traverse_util.flatten_dict(abstract_params(config), sep="/")
    muon = {p: s for p, s in shapes.items() if is_muon_path(p)}
    muon_params = sum(math.prod(s.shape) for s in muon.values())
    total = sum(math.prod(s.shape) for s in shapes.values())
    return {
        "muon_matrices": len(muon),
        "muon_params": muon_params,
        "adamw_params": total - muon_params,
        "total_params": total,
    }


def gla_flops_per_token(config: LaplaceConfig) -> int:
    """Forward FLOPs per token of the chunked GLA beyond the weight matmuls, all GLA layers.

    Per head and token: Q K^T and A V inside the chunk (2 C d_k + 2 C d_v), its write into the
    state and the read of the previous state (2 d_k d_v each).
    """
    C, dk, dv = config.chunk_size, config.d_k, config.d_v
    per_head = 2 * C * (dk + dv) + 4 * dk * dv
    return config.n_gla_layers * config.n_heads * per_head


def attention_flops_per_token(config: LaplaceConfig) -> int:
    """Forward FLOPs per token of softmax attention, all attention layers (every layer of the
    `token_mixer="attention"` baseline, a hybrid's attention layers).

    Per head and token: q K^T and P V over the whole square (2 T d_k + 2 T d_v at T = seq_len),
    as FlashAttention's count does; the causal half is not subtracted.
    """
    T, dk, dv = config.seq_len, config.d_k, config.d_v
    return config.n_attention_layers * config.n_heads * 2 * T * (dk + dv)


def training_flops_per_token(config: LaplaceConfig) -> int:
    """Model FLOPs of one training token: 6 x parameters (the write-up's count) + 3 x the token
    mixers' terms (the GLA layers' and the attention layers')."""
    mixers = gla_flops_per_token(config) + attention_flops_per_token(config)
    return 6 * parameter_counts(config)["total_params"] + 3 * mixers
