"""Batched (variable-length) prefill: vLLM's Mamba2 varlen kernels and the vLLM path built on them.

Kernel level: vLLM's `mamba_chunk_scan_combined_varlen` and `causal_conv1d_fn`, called as the
state op calls them (dt = 1, A = log lambda, B = k, x = v, C = scale q; docs/design.md s12.3), over
sequences packed end to end (`cu_seqlens`, chunk boundaries from vLLM's own
`compute_varlen_chunk_metadata`) equal `gla_chunked` / `gla_recurrent` and `causal_conv` run one
sequence at a time, outputs and final states, from random nonzero initial states (fp32, abs 1e-5
relative to the magnitude). Engine level: vLLM with its chunked prefill forced to 64 tokens a step
(prompts continued across steps from their state pages) gives the greedy tokens of the PyTorch
model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from laplace_spec.config import PRESETS
from serve.kernels import causal_conv, gla_chunked, gla_recurrent

TINY = PRESETS["tiny"]
C = TINY.chunk_size  # 16
# 1, C-1, C, C+1, several hundred, and short ones next to long ones (conv windows < W)
LENGTHS = [1, C - 1, C, C + 1, 333, 2, 3 * C, 1, 5]


def _close(got, want, rtol=1e-5):
    err = (got - want).abs().max().item()
    assert err <= rtol * max(1.0, want.abs().max().item()), err


def _packed(lengths, seed):
    torch.manual_seed(seed)
    H, K, V, T = TINY.n_heads, TINY.d_k, TINY.d_v, sum(lengths)
    q, k, v = torch.randn(T, H, K), torch.randn(T, H, K), torch.randn(T, H, V)
    s0 = torch.randn(len(lengths), H, K, V)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
    return q, k, v, s0, cu


@pytest.mark.parametrize("lengths", [LENGTHS, [C + 1], [7, 7, 7]])
def test_vllm_chunk_scan_varlen_equals_per_sequence(lengths):
    from vllm.model_executor.layers.mamba.ops.ssd_combined import (
        mamba_chunk_scan_combined_varlen,
    )
    from vllm.v1.attention.backends.mamba2_attn import compute_varlen_chunk_metadata

    q, k, v, s0, cu = _packed(lengths, seed=len(lengths))
    log_decay = torch.tensor(TINY.log_decay(), dtype=torch.float32)  # head 0: lambda = 0.5
    scale = TINY.d_k**-0.5
    T = sum(lengths)
    cu_chunk, last_chunk, seq_idx = compute_varlen_chunk_metadata(cu, C)
    o = torch.empty(T, TINY.n_heads, TINY.d_v)
    s = mamba_chunk_scan_combined_varlen(
        v, torch.ones(T, TINY.n_heads), log_decay, k, scale * q, chunk_size=C, cu_seqlens=cu,
        cu_chunk_seqlens=cu_chunk, last_chunk_indices=last_chunk, seq_idx=seq_idx, out=o,
        initial_states=s0.transpose(-1, -2), state_dtype=torch.float32,
    ).transpose(-1, -2)  # fmt: skip
    assert s.shape == s0.shape
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        args = (q[None, a:b], k[None, a:b], v[None, a:b], log_decay, s0[i : i + 1], scale)
        o_ref, s_ref = gla_chunked(*args, C)
        _close(o[a:b], o_ref[0])
        _close(s[i], s_ref[0])
        if b - a <= 2 * C + 1:  # the definition too (a token loop: short ones only)
            o_def, s_def = gla_recurrent(*args)
            _close(o[a:b], o_def[0])
            _close(s[i], s_def[0])


def test_vllm_causal_conv_varlen_equals_per_sequence():
    """fp32: vLLM's prefill conv from each sequence's page (the last W - 1 inputs) gives the
    PyTorch conv's outputs, and leaves each page holding the last W - 1 inputs exactly (a
    sequence shorter than W keeps part of its old window)."""
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn

    torch.manual_seed(3)
    D, W, T, P = TINY.d_model, TINY.conv_width, sum(LENGTHS), len(LENGTHS)
    cu = torch.tensor([0, *np.cumsum(LENGTHS).tolist()], dtype=torch.int32)
    h, w, b = torch.randn(T, D), torch.randn(D, W), torch.randn(D)
    windows = torch.randn(P, W, D)
    pages = windows[:, 1:].clone()  # [P, W - 1, D]: vLLM's "SD" layout, page i for sequence i
    u = causal_conv1d_fn(
        h.transpose(0, 1), w, b, conv_states=pages.transpose(-1, -2), query_start_loc=cu,
        cache_indices=torch.arange(P, dtype=torch.int32),
        has_initial_state=torch.ones(P, dtype=torch.bool), activation="silu",
    ).transpose(0, 1)  # fmt: skip
    for i, (a, bb) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        u_ref, new_ref = causal_conv(h[None, a:bb], windows[i : i + 1], w, b)
        _close(u[a:bb], u_ref[0])
        assert torch.equal(pages[i], new_ref[0, 1:])  # a copy of inputs: exact


# ---- engine level: vLLM's chunked prefill, continued across steps from the state pages --------


def test_vllm_compiled_small_chunked_prefill_matches_pytorch(tiny_export, compiled_varlen_run):
    """Prompts of 300, 1 (after a long one: a used page), 17, 150 and 90 tokens in one call with
    64 tokens a step: steps mix decodes, prompt ends, prompt starts and continued chunks; then
    a 1-token and a long prompt alone. Every sequence: the greedy tokens of
    `serve.generation.greedy_generate` (the normal engine's are checked in tests/test_vllm.py).
    The engine runs vLLM's compile mode (on CPU: traced once with a symbolic token count, then
    inductor), so the compiled state op is held to the same tokens; it is built and run in a
    subprocess of the background queue (tests/compiled_engines.py: about a minute to build)."""
    from compiled_engines import N_NEW, VARLEN_BUDGET, varlen_calls

    from serve.generation import greedy_generate
    from serve.modeling_laplace import LaplaceForCausalLM

    cfg, _, folder = tiny_export
    calls = varlen_calls(cfg.vocab_size)
    model = LaplaceForCausalLM.from_exported(folder)
    want = {tuple(p): greedy_generate(model, [p], N_NEW)[0] for p in calls[0]}
    run = compiled_varlen_run
    assert run["enforce_eager"] is False
    assert run["max_num_batched_tokens"] == VARLEN_BUDGET and run["enable_chunked_prefill"]
    for prompts, got in zip(calls, run["calls"], strict=True):
        assert got == [want[tuple(p)] for p in prompts]
