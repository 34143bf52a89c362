"""The PyTorch kernels of Laplace: LayerNorm, causal conv and GLA (docs/design.md sections 2 and 3).

Plain functions on tensors, shared by the PyTorch model (`serve/modeling_laplace.py`) and the
vLLM model (`serve/vllm_model.py`). GLA comes in three forms that must agree (docs/design.md s3):

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


def conv_taps(weight: torch.Tensor) -> torch.Tensor:
    """weight [D, W] (the exported layout) -> taps [W, D], each tap's D weights contiguous: a
    product with a strided column of `weight` takes torch's slow elementwise path."""
    return weight.t().contiguous()


def causal_conv(h, window, weight, bias):
    """u_t = SiLU(b + sum_j w[:, j] h_{t-W+1+j}).

    h: [B, T, D] new inputs; window: [B, W, D] the last W inputs before them (fp32);
    weight: [D, W]; bias: [D]. Returns (u [B, T, D], new window [B, W, D] fp32).
    The W products are in h's dtype, their sum one reduction over the taps (accumulated in
    fp32 for bf16), as in `causal_conv_step`.
    """
    T, W = h.shape[1], weight.shape[1]
    taps = conv_taps(weight)  # [W, D]
    seq = torch.cat([window.to(h.dtype), h], dim=1)  # [B, W + T, D]
    # output t sees seq[t + 1 .. t + W]: products [B, T, W, D], summed over the taps
    acc = torch.stack([taps[j] * seq[:, 1 + j : 1 + j + T] for j in range(W)], dim=2).sum(2)
    return F.silu(bias + acc), seq[:, -W:].to(f32)


def causal_conv_step(h, window, weight, bias):
    """`causal_conv` for one new input per sequence (a decode step), without its [B, T, ...]
    buffers, in few ops (a decode step's cost is their count): bit-identical to `causal_conv`
    with T = 1 (the same products, summed in the same order over the W taps).

    h: [B, D]; window: [B, W, D] fp32. Returns (u [B, D], new window [B, W, D] fp32):
    the new window is the last W inputs, and u = SiLU(b + sum_j w[:, j] window'[j]).
    """
    new = torch.cat([window[:, 1:], h.to(f32)[:, None]], dim=1)  # [B, W, D]
    acc = (new.to(h.dtype) * weight.t()).sum(1)  # [B, D]: the W products, one reduction
    return F.silu(bias + acc), new


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


# ---- variable-length forms: many sequences packed end to end (vLLM's prefill steps) -----------
#
# Tokens of P sequences lie end to end in one flat [T, ...] tensor; `cu_seqlens` [P + 1] holds
# the boundaries (sequence s is tokens cu[s] .. cu[s+1] - 1, flash-linear-attention's
# `cu_seqlens`). Each sequence starts from its own state (a conv window, a GLA state), and
# nothing crosses a boundary. Equal to the single-sequence forms run one sequence at a time.


def _segments(cu: torch.Tensor, T: int):
    """cu [P + 1] -> (seg [T]: each token's sequence, pos [T]: its position in the sequence)."""
    P = cu.shape[0] - 1
    lens = cu[1:] - cu[:-1]  # [P]
    seg = torch.repeat_interleave(torch.arange(P, device=cu.device), lens, output_size=T)
    return seg, torch.arange(T, device=cu.device) - cu[seg]


def causal_conv_varlen(h, windows, cu_seqlens, weight, bias):
    """`causal_conv` over packed sequences, each continuing its own window.

    h: [T, D] the new inputs of P sequences end to end; windows: [P, W, D] each sequence's
    last W inputs before them (fp32); cu_seqlens: [P + 1]; weight: [D, W]; bias: [D].
    Returns (u [T, D], new windows [P, W, D] fp32). A sequence shorter than W keeps part of
    its old window, as in `causal_conv`.

    Layout: one buffer holding [window_0 | h_0 | window_1 | h_1 | ...] ([T + P W, D]); token t
    of sequence s sits at row e_t = t + (s + 1) W, and its output reads rows e_t - W + 1 .. e_t.
    """
    T, D = h.shape
    P, W = windows.shape[0], weight.shape[1]
    cu = cu_seqlens.to(device=h.device, dtype=torch.long)
    seg, _ = _segments(cu, T)
    row = torch.arange(T, device=h.device) + (seg + 1) * W  # [T] e_t
    taps = torch.arange(W, device=h.device)  # [W]
    win_rows = ((cu[:-1] + torch.arange(P, device=h.device) * W)[:, None] + taps).flatten()
    buf = h.new_empty(T + P * W, D)
    buf.index_copy_(0, row, h)
    buf.index_copy_(0, win_rows, windows.reshape(P * W, D).to(h.dtype))
    # every row e >= W - 1 of the buffer from rows e - W + 1 .. e (shifted views, as in
    # `causal_conv`), then the token rows; the P W extra rows cost little
    R = T + P * W - (W - 1)
    w = conv_taps(weight)  # [W, D]
    # the W products in h's dtype summed in fp32, as `causal_conv`'s reduction over the taps
    acc = (w[0] * buf[:R]).to(f32)  # [R, D], row r is the output at e = r + W - 1
    tap = torch.empty_like(buf[:R])  # one buffer for every tap's product (no fresh [R, D] each)
    for j in range(1, W):
        acc += torch.mul(w[j], buf[j : j + R], out=tap)
    u = acc.index_select(0, row - (W - 1)).to(h.dtype)  # [T, D]
    ends = cu[1:] + (torch.arange(P, device=h.device) + 1) * W  # [P] one past each segment
    new = buf.index_select(0, ((ends - W)[:, None] + taps).flatten()).view(P, W, D)
    return F.silu(u.add_(bias), inplace=True), new.to(f32)


def gla_chunked_varlen(q, k, v, log_decay, initial_states, cu_seqlens, scale, chunk_size):
    """`gla_chunked` over packed sequences (docs/design.md s3), each from its own initial state.

    q, k: [T, H, K]; v: [T, H, V]; log_decay: [H]; initial_states: [P, H, K, V] fp32;
    cu_seqlens: [P + 1]. Returns (o [T, H, V] fp32, final states [P, H, K, V] fp32).

    Each sequence is cut into its own chunks of C tokens from its first token (its last chunk
    holds L <= C valid tokens, the rest are zero rows with no decay), and all N chunks of the
    step are laid out chunk-major with the sequences sorted by chunk count, longest first:

        [chunk 0 of every sequence | chunk 1 of those with >= 2 chunks | ...]

    so the intra-chunk products are one batch over the N chunks, and the sequential carry is a
    loop over chunk numbers c = 0 .. Nmax-1 whose live sequences are a prefix of the state batch.
    """
    T, H, K = q.shape
    V, C, P = v.shape[-1], chunk_size, initial_states.shape[0]
    dev = q.device
    state = initial_states.to(f32)
    if T == 0 or P == 0:
        return q.new_zeros(T, H, V, dtype=f32), state.clone()
    cu = cu_seqlens.to(device=dev, dtype=torch.long)
    lens = cu[1:] - cu[:-1]  # [P]
    n_chunks = (lens + C - 1) // C  # [P]
    order = torch.argsort(n_chunks, descending=True, stable=True)  # [P] longest first
    n_max = int(n_chunks[order[0]])
    live = torch.arange(n_max, device=dev)[:, None] < n_chunks[order][None, :]  # [Nmax, P]
    per_step = live.sum(1).tolist()  # sequences with a chunk c, for c = 0 .. Nmax-1
    c_of, r_of = live.nonzero(as_tuple=True)  # [N] chunk-major: chunk number, rank in `order`
    s_of = order[r_of]  # [N] each chunk's sequence
    L = torch.clamp(lens[s_of] - c_of * C, max=C)  # [N] valid tokens per chunk
    jr = torch.arange(C, device=dev)
    valid = jr[None, :] < L[:, None]  # [N, C]
    gamma = log_decay.to(f32)  # [H]
    # token t of sequence s at position p: chunk offset[p // C] + rank[s], row p % C
    rank = torch.empty_like(order)
    rank[order] = torch.arange(P, device=dev)
    offset = torch.tensor([0] + per_step[:-1], device=dev).cumsum(0)  # [Nmax]
    seg, pos = _segments(cu, T)
    t_chunk, t_row = offset[pos // C] + rank[seg], pos % C  # [T], [T]

    def to_chunks(x):  # [T, H, X] -> [N, H, C, X], zeros past each sequence's end
        out = x.new_zeros(len(s_of), H, C, x.shape[-1], dtype=f32)
        out[t_chunk, :, t_row] = x.to(f32)
        return out

    qc, kc, vc = to_chunks(q), to_chunks(k), to_chunks(v)
    i, j = jr.to(f32)[:, None], jr.to(f32)[None, :]
    causal = i >= j
    # M_ij = lambda^(i-j) on the lower triangle only (never lambda^(-j): it overflows)
    M = torch.where(causal, torch.exp(gamma.view(H, 1, 1) * torch.where(causal, i - j, 0.0)), 0.0)
    # in place where a [N, H, C, *] tensor would be made anew: fresh large buffers cost page
    # faults on a CPU, often more than the arithmetic
    A = torch.einsum("nhik,nhjk->nhij", qc, kc).mul_(scale * M)  # [N, H, C, C]
    o = torch.einsum("nhij,nhjv->nhiv", A, vc)  # [N, H, C, V] intra-chunk

    Lf = L.to(f32)[:, None]  # [N, 1]
    k_exp = torch.where(valid, Lf - 1 - j, 0.0)  # [N, C]
    k_decay = torch.where(valid[:, None], torch.exp(gamma[None, :, None] * k_exp[:, None]), 0.0)
    kv = torch.einsum("nhjk,nhjv->nhkv", kc * k_decay[..., None], vc)  # [N, H, K, V]
    chunk_decay = torch.exp(gamma[None, :] * Lf)[..., None, None]  # [N, H, 1, 1]: lambda^L
    q_decay = torch.exp(gamma[:, None] * (i[:, 0] + 1.0)[None, :])  # [H, C]: lambda^(i+1)
    qs = qc.mul_((scale * q_decay)[None, ..., None])  # [N, H, C, K] (qc is not used again)

    state = state.index_select(0, order)  # [P, H, K, V] in `order`
    inter = torch.empty_like(o)
    off = 0
    for n_live in per_step:  # the sequential carry, all live sequences at once
        c = slice(off, off + n_live)
        S = state[:n_live]  # S_{c-1} of the live sequences
        torch.matmul(qs[c], S, out=inter[c])  # [n_live, H, C, V]
        state[:n_live] = chunk_decay[c] * S + kv[c]
        off += n_live
    o = o.add_(inter)[t_chunk, :, t_row]  # [T, H, V]
    return o, torch.empty_like(state).index_copy_(0, order, state)
