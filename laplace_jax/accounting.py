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


def attention_share(form: str, context: int) -> float:
    """The share of the whole T x T square of scores an attention layer computes: all of it on
    one device and in the gather form (every device scores every key block, masking the future
    ones); in the ring form over S > 1 slices (laplace_jax/attention_ring.py) each device scores
    (2 S + 1) pairs of half slices, (2 S + 1) / (4 S) of the square (the causal half and one
    diagonal's worth)."""
    if form == "ring" and context > 1:
        return (2 * context + 1) / (4 * context)
    return 1.0


def attention_flops_per_token(config: LaplaceConfig, share: float = 1.0) -> float:
    """Forward FLOPs per token of softmax attention, all attention layers (every layer of the
    `token_mixer="attention"` baseline, a hybrid's attention layers).

    Per head and token: q K^T and P V over `share` of the whole square (2 T d_k + 2 T d_v at
    T = seq_len, times `share`: `attention_share`); share 1 is FlashAttention's count, the
    causal half not subtracted.
    """
    T, dk, dv = config.seq_len, config.d_k, config.d_v
    return config.n_attention_layers * config.n_heads * 2 * T * (dk + dv) * share


def training_flops_per_token(config: LaplaceConfig, attention: float = 1.0) -> float:
    """Model FLOPs of one training token: 6 x parameters (the write-up's count) + 3 x the token
    mixers' terms (the GLA layers' and the attention layers', `attention` the share of the
    square the attention computes: `attention_share`). The trainer's MFU counts the whole
    square (share 1, FlashAttention's count, whichever form runs); train.plan's modelled step
    time counts the share the run's form scores."""
    mixers = gla_flops_per_token(config) + attention_flops_per_token(config, attention)
    return 6 * parameter_counts(config)["total_params"] + 3 * mixers
