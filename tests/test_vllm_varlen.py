"""Batched (variable-length) prefill: the packed kernels and the vLLM path built on them.

Kernel level: `gla_chunked_varlen` and `causal_conv_varlen` over sequences packed end to end
(`cu_seqlens`) equal `gla_chunked` / `gla_recurrent` and `causal_conv` run one sequence at a
time, outputs and final states, from random nonzero initial states (fp32, abs 1e-5 relative to
the magnitude). Engine level: vLLM with its chunked prefill forced to 64 tokens a step (prompts
continued across steps from their state pages) gives the greedy tokens of the PyTorch model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from shared_fixtures import set_vllm_env

from laplace_spec.config import PRESETS
from serve.kernels import (
    causal_conv,
    causal_conv_varlen,
    gla_chunked,
    gla_chunked_varlen,
    gla_recurrent,
)

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
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()])
    return q, k, v, s0, cu


@pytest.mark.parametrize("lengths", [LENGTHS, [C + 1], [7, 7, 7]])
def test_gla_chunked_varlen_equals_per_sequence(lengths):
    q, k, v, s0, cu = _packed(lengths, seed=len(lengths))
    log_decay = torch.tensor(TINY.log_decay(), dtype=torch.float32)  # head 0: lambda = 0.5
    scale = TINY.d_k**-0.5
    o, s = gla_chunked_varlen(q, k, v, log_decay, s0, cu, scale, C)
    assert o.shape == (sum(lengths), TINY.n_heads, TINY.d_v) and s.shape == s0.shape
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        args = (q[None, a:b], k[None, a:b], v[None, a:b], log_decay, s0[i : i + 1], scale)
        o_ref, s_ref = gla_chunked(*args, C)
        _close(o[a:b], o_ref[0])
        _close(s[i], s_ref[0])
        if b - a <= 2 * C + 1:  # the definition too (a token loop: short ones only)
            o_def, s_def = gla_recurrent(*args)
            _close(o[a:b], o_def[0])
            _close(s[i], s_def[0])


def test_causal_conv_varlen_equals_per_sequence():
    """Bit for bit, fp32 and bf16: the prefill conv of the vLLM model and the PyTorch model's
    conv sum the same products in the same order (a bf16 difference turns greedy ties)."""
    torch.manual_seed(3)
    D, W, T = TINY.d_model, TINY.conv_width, sum(LENGTHS)
    cu = torch.tensor([0, *np.cumsum(LENGTHS).tolist()])
    for dtype in (torch.float32, torch.bfloat16):
        h, w, b = (torch.randn(*s).to(dtype) for s in ((T, D), (D, W), (D,)))
        windows = torch.randn(len(LENGTHS), W, D)
        u, new = causal_conv_varlen(h, windows, cu, w, b)
        for i, (a, bb) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
            u_ref, new_ref = causal_conv(h[None, a:bb], windows[i : i + 1], w, b)
            assert torch.equal(u[a:bb], u_ref[0]), dtype
            assert torch.equal(new[i], new_ref[0])  # a copy of inputs: exact


# ---- engine level: vLLM's chunked prefill, continued across steps from the state pages --------

N_NEW = 24
BUDGET = 64  # max_num_batched_tokens: a 300-token prompt takes 5 steps


@pytest.fixture(scope="module")
def exported(tiny_export):
    return tiny_export


def test_vllm_small_chunked_prefill_matches_pytorch(exported):
    """Prompts of 300, 1 (after a long one: a used page), 17, 150 and 90 tokens in one call with
    64 tokens a step: steps mix decodes, prompt ends, prompt starts and continued chunks; then
    a 1-token and a long prompt alone. Every sequence: the greedy tokens of
    `serve.generation.greedy_generate` (the normal engine's are checked in tests/test_vllm.py)."""
    from serve.generation import greedy_generate
    from serve.modeling_laplace import LaplaceForCausalLM
    from serve.vllm_adapter import generate, make_llm

    cfg, _, folder = exported
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (300, 1, 17, 150, 90)]
    model = LaplaceForCausalLM.from_exported(folder)
    want = [greedy_generate(model, [p], N_NEW)[0] for p in prompts]
    set_vllm_env()
    # its own engine: the step budget (64 tokens) is the engine's setting under test
    llm = make_llm(
        str(folder), max_num_seqs=8, max_num_batched_tokens=BUDGET, enable_chunked_prefill=True
    )
    try:
        sched = llm.llm_engine.vllm_config.scheduler_config
        assert sched.max_num_batched_tokens == BUDGET and sched.enable_chunked_prefill
        assert [r["token_ids"] for r in generate(llm, prompts, N_NEW)] == want
        for i in (1, 0):  # alone, after the batch: pages reused
            assert generate(llm, [prompts[i]], N_NEW)[0]["token_ids"] == want[i]
    finally:
        del llm
