"""The PyTorch kernels of Laplace: LayerNorm, causal conv and GLA (docs/design.md sections 2 and 3).

Plain functions on tensors: the PyTorch model's (`serve/modeling_laplace.py`), and the reference
that the vLLM model's Mamba2 kernels are tested against (`serve/vllm_model.py`, docs/design.md
s12.3). GLA comes in three forms that must agree (docs/design.md s3):

    gla_recurrent  the definition: a plain token loop, the reference the others are tested against
    gla_chunked    prefill: intra-chunk products batched, the state carried chunk to chunk
    gla_step       decode: one token, O(1) in the context length

The log-decay per head comes from `laplace_spec.config.LaplaceConfig.log_decay()` (fp64),
rounded to fp32 once; the state is accumulated in fp32 whatever the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

f32 = torch.float32


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm with a scale and no bias, in fp32."""
    # (x - mean) / sqrt(var + eps) * weight, biased variance: torch's fused kernel
    return F.layer_norm(x.to(f32), x.shape[-1:], weight.to(f32), None, eps).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(x[..., :F]) * x[..., F:] for x [..., 2F]: in fp32, rounded to x's dtype once (the
    bf16 contract, docs/design.md s12.4; vLLM's CUDA kernel and its compiled form compute the
    same, its x86 CPU form in eager mode rounds twice)."""
    gate, up = x.to(f32).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def conv_taps(weight: torch.Tensor) -> torch.Tensor:
    """weight [D, W] (the exported layout) -> taps [W, D], each tap's D weights contiguous: a
    product with a strided column of `weight` takes torch's slow elementwise path."""
    return weight.t().contiguous()


def causal_conv(h, window, weight, bias):
    """u_t = SiLU(b + sum_j w[:, j] h_{t-W+1+j}).

    h: [B, T, D] new inputs; window: [B, W, D] the last W inputs before them (fp32);
    weight: [D, W]; bias: [D]. Returns (u [B, T, D] in h's dtype, new window [B, W, D] fp32).
    The bf16 contract (docs/design.md s12.4), as vLLM's conv kernels: the products, their sum
    over the taps, the bias and the SiLU all in fp32, u rounded to h's dtype once; the same
    arithmetic, in the same order, as `causal_conv_step`.
    """
    T, W = h.shape[1], weight.shape[1]
    taps = conv_taps(weight.to(f32))  # [W, D]
    seq = torch.cat([window.to(f32), h.to(f32)], dim=1)  # [B, W + T, D] fp32
    # output t sees seq[t + 1 .. t + W]: products [B, T, W, D], summed over the taps
    acc = torch.stack([taps[j] * seq[:, 1 + j : 1 + j + T] for j in range(W)], dim=2).sum(2)
    return F.silu(bias.to(f32) + acc).to(h.dtype), seq[:, -W:]


def causal_conv_step(h, window, weight, bias):
    """`causal_conv` for one new input per sequence (a decode step), without its [B, T, ...]
    buffers, in few ops (a decode step's cost is their count): bit-identical to `causal_conv`
    with T = 1 (the same fp32 products, summed in the same order over the W taps).

    h: [B, D]; window: [B, W, D] fp32. Returns (u [B, D] in h's dtype, new window [B, W, D]
    fp32): the new window is the last W inputs, and u = SiLU(b + sum_j w[:, j] window'[j]).
    """
    new = torch.cat([window[:, 1:], h.to(f32)[:, None]], dim=1)  # [B, W, D]
    acc = (new * weight.t().to(f32)).sum(1)  # [B, D]: the W products, one reduction
    return F.silu(bias.to(f32) + acc).to(h.dtype), new


def gla_recurrent(q, k, v, log_decay, state, scale):
    """The definition, one token at a time: S_t = lambda S_{t-1} + k_t v_t^T, o_t = scale q_t S_t.

    q, k: [B, T, H, K]; v: [B, T, H, V]; log_decay: [H]; state: [B, H, K, V].
    Returns (o [B, T, H, V] fp32, final state fp32). For tests: T sequential steps.
    """
    lam = torch.exp(log_decay.to(f32))  # [H]
    S = state.to(f32)
    out = []
    for t in range(q.shape[1]):
        q_t, k_t, v_t = q[:, t].to(f32), k[:, t].to(f32), v[:, t].to(f32)  # [B, H, K|V]
        S = lam[:, None, None] * S + k_t[..., :, None] * v_t[..., None, :]  # [B, H, K, V]
        out.append((scale * q_t[..., :, None] * S).sum(-2))  # [B, H, V]
    return torch.stack(out, dim=1), S


def gla_step(q, k, v, log_decay, state, scale):
    """One token. q, k: [B, H, K]; v: [B, H, V]; state [B, H, K, V] fp32 -> (o [B, H, V], S).

    S = lambda S + k v^T (one batched rank-1 update), o = scale q S (one batched
    [1, K] x [K, V] product per head row); few ops, as a decode step's cost is their count.
    """
    B, H, K, V = state.shape
    lam = log_decay.to(f32).exp().view(1, H, 1, 1)
    state = torch.baddbmm(
        (lam * state).view(B * H, K, V),
        k.to(f32).reshape(B * H, K, 1),
        v.to(f32).reshape(B * H, 1, V),
    )  # [B H, K, V]
    o = torch.bmm((scale * q.to(f32)).reshape(B * H, 1, K), state)  # [B H, 1, V]
    return o.view(B, H, V), state.view(B, H, K, V)


def gla_chunked(q, k, v, log_decay, state, scale, chunk_size):
    """Chunked GLA (docs/design.md s3) for any T; the final state counts only the valid tokens.

    q, k: [B, T, H, K]; v: [B, T, H, V]; log_decay: [H]; state: [B, H, K, V] fp32.
    Returns (o [B, T, H, V] fp32, final state).
    """
    B, T, H, K = q.shape
    V, C = v.shape[-1], chunk_size
    N = -(-T // C)
    pad = N * C - T
    gamma = log_decay.to(f32).view(H, 1, 1)

    def to_chunks(x):  # [B, T, H, X] -> [B, H, N, C, X]
        x = F.pad(x.to(f32), (0, 0, 0, 0, 0, pad))
        return x.view(B, N, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    qc, kc, vc = to_chunks(q), to_chunks(k), to_chunks(v)
    i = torch.arange(C, dtype=f32, device=q.device)[:, None]
    j = torch.arange(C, dtype=f32, device=q.device)[None, :]
    causal = i >= j
    # M_ij = lambda^(i-j) on the lower triangle only (never lambda^(-j): it overflows)
    M = torch.where(causal, torch.exp(gamma * torch.where(causal, i - j, 0.0)), 0.0)  # [H,C,C]
    A = torch.einsum("bhnik,bhnjk->bhnij", qc, kc) * scale * M[None, :, None]
    o = torch.einsum("bhnij,bhnjv->bhniv", A, vc)  # intra-chunk

    valid = torch.full((N,), float(C), dtype=f32, device=q.device)
    valid[-1] = C - pad
    L = valid[:, None]  # [N, 1]
    live = j < L  # [N, C]
    k_decay = torch.where(
        live, torch.exp(gamma[:, :, 0:1] * torch.where(live, L - 1 - j, 0.0)), 0.0
    )  # [H, N, C]: lambda^(L_c - 1 - j)
    kv = torch.einsum("bhnjk,bhnjv->nbhkv", kc * k_decay[None, ..., None], vc)  # [N,B,H,K,V]
    chunk_decay = torch.exp(gamma[:, 0, 0][None, :] * valid[:, None])  # [N, H]
    q_decay = torch.exp(gamma[:, 0] * (i[:, 0] + 1.0)[None, :])  # [H, C]: lambda^(i+1)
    qs = scale * qc * q_decay[None, :, None, :, None]  # [B, H, N, C, K]
    inter = []
    for c in range(N):  # the sequential carry: S_c = lambda^(L_c) S_{c-1} + chunk c's k v^T
        inter.append(torch.einsum("bhik,bhkv->bhiv", qs[:, :, c], state))
        state = chunk_decay[c][None, :, None, None] * state + kv[c]
    o = o + torch.stack(inter, dim=2)  # inter-chunk: scale (Q_c lambda^(i+1)) S_{c-1}
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o, state
