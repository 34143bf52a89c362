"""The PyTorch kernels of Laplace: LayerNorm, causal conv and GLA (DESIGN.md sections 2 and 3).

Plain functions on tensors, shared by the PyTorch model (`serve/modeling_laplace.py`) and the
vLLM model (`serve/vllm_model.py`). GLA comes in three forms that must agree (DESIGN.md s3):

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
    x32 = x.to(f32)
    mean = x32.mean(-1, keepdim=True)
    var = (x32 - mean).square().mean(-1, keepdim=True)
    return ((x32 - mean) * torch.rsqrt(var + eps) * weight.to(f32)).to(x.dtype)


def causal_conv(h, window, weight, bias):
    """u_t = SiLU(b + sum_j w[:, j] h_{t-W+1+j}).

    h: [B, T, D] new inputs; window: [B, W, D] the last W inputs before them (fp32);
    weight: [D, W]; bias: [D]. Returns (u [B, T, D], new window [B, W, D] fp32).
    """
    T, W = h.shape[1], weight.shape[1]
    seq = torch.cat([window.to(h.dtype), h], dim=1)  # [B, W + T, D]
    acc = weight[:, 0] * seq[:, 1 : 1 + T]
    for j in range(1, W):  # output t sees seq[t + 1 .. t + W]
        acc = acc + weight[:, j] * seq[:, 1 + j : 1 + j + T]
    return F.silu(bias + acc), seq[:, -W:].to(f32)


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
    """One token. q, k: [B, H, K]; v: [B, H, V]; state [B, H, K, V] fp32 -> (o [B, H, V], S)."""
    lam = torch.exp(log_decay.to(f32))[None, :, None, None]
    state = lam * state + torch.einsum("bhk,bhv->bhkv", k.to(f32), v.to(f32))
    o = torch.einsum("bhk,bhkv->bhv", scale * q.to(f32), state)
    return o, state


def gla_chunked(q, k, v, log_decay, state, scale, chunk_size):
    """Chunked GLA (DESIGN.md s3) for any T; the final state counts only the valid tokens.

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
