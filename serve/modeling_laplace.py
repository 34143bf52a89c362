"""Laplace in plain PyTorch, Hugging Face style (no JAX): the serving side of the model.

The math is that of `laplace_jax/model.py` (docs/design.md sections 2 and 3), step for step:

    x = embed(tokens)                                              # [B, T, D]
    per layer:  h = LN_1(x); u = SiLU(causal_conv(h)); [q k v g] = u W_qkvg^T
                o = GLA(q, k, v) (chunked prefill or O(1) step) + sigmoid(q a k) v
                x += (HeadRMSNorm(o) * SiLU(g)) W_out^T
                x += W_3 (SiLU(W_1 LN_2(x)) * W_2 LN_2(x))
    logits = LN_f(x) W_lm^T

This file holds the state container, the modules, `LaplaceForCausalLM` and the loading of an
exported folder. The kernels are `serve/kernels.py`, the HF config `serve/configuration_laplace.py`
(sizes derived from the fields come from `laplace_spec.config`), greedy generation and the
decode runner `serve/generation.py`.

The recurrent state is an explicit `LaplaceState` (per layer the GLA matrices [B, H, dk, dv] and
the last W conv inputs [B, W, D], fp32), the layout of docs/parameters.md. Parameter names are the
exported tensor names of `laplace_spec/names.py`, checked at construction and on load.

A hybrid (`attention_every=k`, docs/design.md s13) runs its attention layers as the JAX model
does: step 4 is causal softmax attention over the same q, k, v, without positional encoding
(`torch.nn.functional.scaled_dot_product_attention`, fp32), and such a layer keeps the keys and
values of every token it has seen in the state instead of GLA matrices (`LaplaceState.kv`).

    model = LaplaceForCausalLM.from_exported("exported/")       # or AutoModelForCausalLM
    out = model(input_ids)                                       # logits [B, T, V], out.state
    out = model(next_ids[:, None], state=out.state)             # one decode step, O(1)
    model.generate(input_ids, max_new_tokens=32)                 # transformers' generation

Generation (`GenerationMixin`) carries the `LaplaceState` as the cache under the name
`cache_params`, as transformers' Mamba does: the prefill returns it, every later step feeds one
token and the state (`prepare_inputs_for_generation`), and no `DynamicCache` is made. A padded
batch must be left-padded (the tokenizer's `padding_side="left"`): each row is then prefilled
alone on its real tokens, so padding never enters the state, and the rows decode together.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from laplace_spec.config import LaplaceConfig
from laplace_spec.names import WeightError, check_tensors
from serve.configuration_laplace import LaplaceHFConfig
from serve.kernels import (
    causal_conv,
    causal_conv_step,
    gla_chunked,
    gla_step,
    layer_norm,
    silu_and_mul,
)

f32 = torch.float32
QUERY_BLOCK = 256  # a hybrid's attention scores this many queries at a time (`attend`)


# ---- the recurrent state -----------------------------------------------------------------------


@dataclasses.dataclass
class LaplaceState:
    """Per layer: `gla` [B, H, dk, dv] and `conv` [B, W, D] (last W LN_1 outputs), fp32.

    A hybrid's attention layers keep no GLA matrices (their `gla` is [B, 0]) but the keys
    [B, t, H, dk] and values [B, t, H, dv] of the t tokens seen (`kv[i]`; None for GLA layers,
    and `kv` empty for pure Laplace); `valid` [B, t] marks the keys of real tokens: the rows of
    a batch prefilled one by one on prompts of different lengths are left-padded to the
    longest, the padding masked."""

    gla: list[torch.Tensor]
    conv: list[torch.Tensor]
    kv: list[tuple[torch.Tensor, torch.Tensor] | None] = dataclasses.field(default_factory=list)
    valid: torch.Tensor | None = None

    @classmethod
    def zeros(cls, config: LaplaceConfig, batch_size: int, device=None) -> LaplaceState:
        B, H, dk, dv = batch_size, config.n_heads, config.d_k, config.d_v
        gla, conv, kv = [], [], []
        for mixer in config.layer_mixers:
            attention = mixer == "attention"
            matrices = (0,) if attention else config.gla_state_shape  # none in attention layers
            gla.append(torch.zeros(B, *matrices, device=device))
            conv.append(torch.zeros(B, *config.conv_state_shape, device=device))
            empty = lambda d: torch.zeros(B, 0, H, d, device=device)  # noqa: E731
            kv.append((empty(dk), empty(dv)) if attention else None)
        if not config.attention_every:
            return cls(gla, conv)
        return cls(gla, conv, kv, torch.zeros(B, 0, dtype=torch.bool, device=device))

    @property
    def batch_size(self) -> int:
        return self.gla[0].shape[0]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the state holds."""
        kv = [t for pair in self.kv if pair is not None for t in pair]
        return [*self.gla, *self.conv, *kv]

    def nbytes_per_seq(self) -> int:
        return sum(t[0].nbytes for t in self.tensors())

    @classmethod
    def cat(cls, states: list[LaplaceState]) -> LaplaceState:
        """The rows of `states` as one batch; keys and values left-padded to the longest."""
        first = states[0]
        gla = [torch.cat([s.gla[i] for s in states]) for i in range(len(first.gla))]
        conv = [torch.cat([s.conv[i] for s in states]) for i in range(len(first.conv))]
        if first.valid is None:
            return cls(gla, conv)
        t = max(s.valid.shape[1] for s in states)

        def left(x):  # [b, t', ...] -> [b, t, ...], zeros first
            return torch.cat([x.new_zeros(x.shape[0], t - x.shape[1], *x.shape[2:]), x], 1)

        def rows(i, j):  # keys (j = 0) or values (1) of layer i, every state's rows
            return torch.cat([left(s.kv[i][j]) for s in states])

        kv = [None if pair is None else (rows(i, 0), rows(i, 1)) for i, pair in enumerate(first.kv)]
        return cls(gla, conv, kv, torch.cat([left(s.valid) for s in states]))

    def select(self, index) -> LaplaceState:
        kv = [None if p is None else (p[0][index], p[1][index]) for p in self.kv]
        valid = None if self.valid is None else self.valid[index]
        return LaplaceState([t[index] for t in self.gla], [t[index] for t in self.conv], kv, valid)

    def padded(self, width: int) -> LaplaceState:
        """Zero rows appended up to `width` sequences (decode batch-width padding)."""
        extra = width - self.batch_size
        if extra <= 0:
            return self
        rows = lambda t: torch.cat([t, t.new_zeros(extra, *t.shape[1:])])  # noqa: E731
        kv = [None if p is None else (rows(p[0]), rows(p[1])) for p in self.kv]
        valid = None if self.valid is None else rows(self.valid)
        return LaplaceState([rows(t) for t in self.gla], [rows(t) for t in self.conv], kv, valid)


# ---- modules (parameter names == laplace_spec/names.py's exported names) --------------------


class LaplaceLinear(nn.Linear):
    """nn.Linear (no bias) with a row-exact path for decoding.

    A BLAS GEMM's rounding depends on the number of rows it is given (the kernel blocks rows),
    so a sequence's logits would change with the decode batch width. With `row_exact` set,
    one-token inputs [B, 1, in] go through a batched matrix-vector product: every row is
    computed by the same kernel whatever B, so padding a batch never changes the real rows.
    """

    row_exact = False

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        if self.row_exact and x.dim() == 3 and x.shape[1] == 1:
            return torch.bmm(x, self.weight.t().expand(x.shape[0], -1, -1))
        return F.linear(x, self.weight)


class LaplaceMixer(nn.Module):
    """Conv, fused projection, GLA, self-augmentation, head RMSNorm, gate, output projection."""

    kind = "gla"  # step 4 (`config.layer_mixers`); decides the branch multiplier

    def __init__(self, config: LaplaceConfig, linear=None):
        """`linear(name, in_features, out_features)` builds the two projections (default
        `LaplaceLinear`; the vLLM model passes vLLM's layers, so no torch Linear is built)."""
        super().__init__()
        c = config
        linear = linear or (lambda name, n_in, n_out: LaplaceLinear(n_in, n_out))
        self.n_heads, self.d_k, self.d_v = c.n_heads, c.d_k, c.d_v
        self.chunk_size, self.eps, self.scale = c.chunk_size, c.norm_eps, c.qk_scale
        self.qkvg_split, self.heads_per_tier = c.qkvg_split, c.heads_per_tier
        # conv as plain parameters (not vLLM linear classes: its CPU backend repacks those)
        self.conv_weight = nn.Parameter(torch.zeros(c.d_model, c.conv_width))  # [D, W]
        self.conv_bias = nn.Parameter(torch.zeros(c.d_model))
        self.qkvg_proj = linear("qkvg_proj", c.d_model, c.qkvg_dim)
        self.aug_balance = nn.Parameter(torch.zeros(c.n_heads, c.d_k))
        self.head_norm_weight = nn.Parameter(torch.ones(c.n_tiers, c.d_v))
        self.out_proj = linear("out_proj", c.n_heads * c.d_v, c.d_model)
        # what the branch writes (docs/design.md s13.5): s y, s (1 + w) y or s (1 + w) RMSNorm(y)
        self.branch_form = c.mixer_branch_form(self.kind)
        self.branch_multiplier = c.mixer_branch_multiplier(self.kind)  # s: 0.1 in a hybrid's GLA
        if self.branch_form != "multiplier":
            self.branch_gain = nn.Parameter(torch.zeros(c.d_model))  # w
        self.log_decay = c.log_decay()  # H fp64 numbers: the decays are fixed, not parameters
        self._log_decay_f32: torch.Tensor | None = None

    def forward(self, h, window, gla_state):
        """h: [B, T, D] (LN_1 output); window [B, W, D]; gla_state [B, H, dk, dv].

        T == 1 takes the O(1) recurrent step, longer inputs the chunked form.
        Returns (y [B, T, D], new window, new gla state).
        """
        u, window = self.convolve(h, window)
        q, k, v, g = self.project(u)
        o, gla_state = self.mix(q, k, v, gla_state)
        return self.output(o, q, k, v, g), window, gla_state

    def convolve(self, h, window):
        """SiLU(causal depth-wise conv(h)) [B, T, D] from the window of the inputs before, and
        the new window: the one-token step (the vLLM model's) for T == 1."""
        if h.shape[1] == 1:
            u, window = causal_conv_step(h[:, 0], window, self.conv_weight, self.conv_bias)
            return u[:, None], window
        return causal_conv(h, window, self.conv_weight, self.conv_bias)

    # The steps, separately: the vLLM model runs the conv and the GLA in its own batched forms
    # (decodes, variable-length prefills) and these projections once over all tokens of a step.
    def project(self, u):
        """u [..., D] -> q, k [..., H, dk]; v [..., H, dv]; g [..., H * dv]."""
        return self.split(self.qkvg_proj(u))

    def split(self, qkvg):
        """The fused projection's output [..., qkvg_dim] -> q, k [..., H, dk]; v [..., H, dv];
        g [..., H * dv] (views)."""
        H, dk, dv = self.n_heads, self.d_k, self.d_v
        q, k, v, g = qkvg.split(self.qkvg_split, dim=-1)
        lead = qkvg.shape[:-1]
        return q.view(*lead, H, dk), k.view(*lead, H, dk), v.view(*lead, H, dv), g

    def log_decay_f32(self, device: torch.device) -> torch.Tensor:
        """The H log-decays, fp32, on `device`. Made from the floats on first use, not a buffer:
        nothing to load, and nothing left uninitialised by meta-device loading."""
        t = self._log_decay_f32
        if t is None or t.device != device:
            t = self._log_decay_f32 = torch.tensor(self.log_decay, dtype=f32, device=device)
        return t

    def mix(self, q, k, v, gla_state):
        """GLA over [B, T, H, *] from `gla_state`: the O(1) step if T == 1, else chunked."""
        log_decay = self.log_decay_f32(q.device)
        if q.shape[1] == 1:
            o, gla_state = gla_step(q[:, 0], k[:, 0], v[:, 0], log_decay, gla_state, self.scale)
            return o[:, None], gla_state  # [B, 1, H, dv]
        return gla_chunked(q, k, v, log_decay, gla_state, self.scale, self.chunk_size)

    def output(self, o, q, k, v, g):
        """Self-augmentation, head RMSNorm, SiLU gate, output projection. o: [..., H, dv]."""
        H, dv = self.n_heads, self.d_v
        lead, tiers = o.shape[:-2], self.head_norm_weight.shape[0]
        # self-augmentation: o += sigmoid(sum_i q_i a_i k_i) v   (fp32)
        aug = torch.sigmoid((q.to(f32) * self.aug_balance.to(f32) * k.to(f32)).sum(-1, True))
        o = torch.addcmul(o, aug, v.to(f32))  # [..., H, dv]
        # head RMSNorm, one scale per tier of contiguous heads: o rsqrt(mean(o^2) + eps) w_tier
        o = F.rms_norm(o, (dv,), eps=self.eps).view(*lead, tiers, self.heads_per_tier, dv)
        o = o * self.head_norm_weight.to(f32)[:, None, :]  # [..., tiers, H / tiers, dv]
        # the gate in fp32, rounded to the activations' dtype once (the bf16 contract, s12.4)
        y = (o.view(*lead, H * dv) * F.silu(g.to(f32))).to(g.dtype)
        return self.branch(self.out_proj(y))

    def branch(self, y):
        """What the mixer writes into the stream, y [..., D] -> s y, s (1 + w) y or
        s (1 + w) RMSNorm(y) (`branch_form`): in fp32, rounded once, as JAX does."""
        s = self.branch_multiplier
        if self.branch_form == "multiplier":
            return y if s == 1.0 else (y.float() * s).to(y.dtype)
        y32 = y.float()
        if self.branch_form == "post_norm":  # y rsqrt(mean(y^2) + eps)
            y32 = F.rms_norm(y32, (y32.shape[-1],), eps=self.eps)
        return (y32 * (s * (1.0 + self.branch_gain.float()))).to(y.dtype)


class LaplaceAttentionMixer(LaplaceMixer):
    """A hybrid's attention layer: LaplaceMixer with step 4 causal softmax attention over the
    same q, k, v (no positional encoding; laplace_jax/attention.py), its state the keys and
    values of the tokens seen."""

    kind = "attention"

    def forward(self, h, window, kv, valid):
        """h [B, T, D]; window [B, W, D]; kv: keys [B, t, H, dk] and values [B, t, H, dv] of
        the t tokens before; valid [B, t + T] (the keys of real tokens, these T included).
        Returns (y [B, T, D], new window, the keys and values of the t + T tokens)."""
        u, window = self.convolve(h, window)
        q, k, v, g = self.project(u)
        keys, values = torch.cat([kv[0], k], 1), torch.cat([kv[1], v], 1)
        o = self.attend(q, keys, values, valid)
        return self.output(o, q, k, v, g), window, (keys, values)

    def attend(self, q, keys, values, valid):
        """o [B, T, H, dv] (fp32, holding values of q's dtype): query i, the (t - T + i)-th
        token, attends to the keys of the tokens up to itself that are valid; scale qk_scale,
        as the JAX layer. Computed as a flash-attention kernel rounds (the bf16 contract,
        docs/design.md s12.4): scores in fp32, their exponentials rounded to the activations'
        dtype for the product with the values (accumulated in fp32), divided by the fp32 sum of
        the unrounded ones, the output rounded once. In fp32 this is plain softmax attention.
        Queries go QUERY_BLOCK at a time, so the scores held are [B, H, QUERY_BLOCK, t]."""
        T, t = q.shape[1], keys.shape[1]
        heads = lambda x: x.transpose(1, 2).to(f32)  # noqa: E731  [B, ., H, d] -> [B, H, ., d]
        k_t, v = heads(keys).transpose(-1, -2), heads(values)  # [B, H, dk, t], [B, H, t, dv]
        key_position = torch.arange(t, device=q.device)
        blocks = []
        for i in range(0, T, QUERY_BLOCK):
            q_b = heads(q[:, i : i + QUERY_BLOCK])  # [B, H, b, dk]
            position = t - T + i + torch.arange(q_b.shape[2], device=q.device)  # [b]
            causal = key_position[None, :] <= position[:, None]  # [b, t]
            mask = causal[None, None] & valid[:, None, None, :]  # [B, 1, b, t]
            scores = (q_b @ k_t * self.scale).masked_fill(~mask, float("-inf"))  # [B, H, b, t]
            top = scores.amax(-1, keepdim=True).nan_to_num(neginf=0.0)  # a row with no key: 0
            e = torch.exp(scores - top)  # [B, H, b, t], max 1 per row
            total = e.sum(-1, keepdim=True).clamp_min(torch.finfo(f32).tiny)  # no key: o = 0
            blocks.append((e.to(q.dtype).to(f32) @ v) / total)  # [B, H, b, dv]
        return torch.cat(blocks, 2).transpose(1, 2).to(q.dtype).to(f32)  # [B, T, H, dv]


class LaplaceMLP(nn.Module):
    def __init__(self, config: LaplaceConfig):
        super().__init__()
        self.w12 = LaplaceLinear(config.d_model, 2 * config.ffn_dim)  # [W_1; W_2]
        self.w3 = LaplaceLinear(config.ffn_dim, config.d_model)

    def forward(self, x):
        return self.w3(silu_and_mul(self.w12(x)))  # W_3 (SiLU(W_1 x) * (W_2 x))


class LaplaceLayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return layer_norm(x, self.weight, self.eps)


class LaplaceDecoderLayer(nn.Module):
    def __init__(self, config: LaplaceConfig, mixer: nn.Module | None = None):
        super().__init__()
        self.ln_1 = LaplaceLayerNorm(config.d_model, config.norm_eps)
        self.mixer = mixer if mixer is not None else LaplaceMixer(config)
        if self.mixer.kind == "attention" and config.attention_reads_embedding:
            self.ln_0 = LaplaceLayerNorm(config.d_model, config.norm_eps)  # x_0's (s13.5)
        self.ln_2 = LaplaceLayerNorm(config.d_model, config.norm_eps)
        self.mlp = LaplaceMLP(config)

    def forward(self, x, window, *mixer_state, embedding=None):
        """`mixer_state`: the GLA matrices, or (an attention layer's) the keys and values and
        the valid mask; `embedding`: the scaled token embedding x_0, which an attention layer
        with `ln_0` reads beside the stream. Returns x, the new window and the mixer's state."""
        y, window, new = self.mixer(mixer_input(self, x, embedding), window, *mixer_state)
        x = x + y
        x = x + self.mlp(self.ln_2(x))
        return x, window, new


def mixer_input(layer: nn.Module, x, embedding):
    """A layer's mixer reads h = LayerNorm_1(x), or LayerNorm_1(x) + LayerNorm_0(x_0) for a
    hybrid's attention layer under attention_input=stream_and_embedding (docs/design.md s13.5)."""
    h = layer.ln_1(x)
    return h + layer.ln_0(embedding) if hasattr(layer, "ln_0") else h


class LaplaceModel(nn.Module):
    def __init__(self, config: LaplaceConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_multiplier = config.embed_multiplier  # sqrt(D) or 1 (`embed_scale`)
        self.layers = nn.ModuleList(
            LaplaceDecoderLayer(config, LaplaceAttentionMixer(config) if m == "attention" else None)
            for m in config.layer_mixers
        )
        self.norm = LaplaceLayerNorm(config.d_model, config.norm_eps)

    def forward(self, input_ids, state: LaplaceState):
        e = self.embed_tokens(input_ids)  # [B, T, D]
        x = (e.float() * self.embed_multiplier).to(e.dtype)  # scaled in fp32, as JAX does
        valid = state.valid  # a hybrid: the real tokens among the keys, these T appended
        if valid is not None:
            valid = torch.cat([valid, valid.new_ones(input_ids.shape)], 1)
        gla, conv, kv, x0 = [], [], [], x
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mixer, LaplaceAttentionMixer):
                x, w, pair = layer(x, state.conv[i], state.kv[i], valid, embedding=x0)
                gla.append(state.gla[i])  # keeps no GLA matrices
                kv.append(pair)
            else:
                x, w, s = layer(x, state.conv[i], state.gla[i])
                gla.append(s)
                kv.append(None)
            conv.append(w)
        if valid is None:
            return self.norm(x), LaplaceState(gla, conv)
        return self.norm(x), LaplaceState(gla, conv, kv, valid)


@dataclasses.dataclass
class LaplaceOutput(ModelOutput):
    """`cache_params` is the recurrent state after the input (the name transformers' generation
    carries from step to step, as for Mamba); `state` is the same object."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # [B, T, V] fp32 (T: the kept positions)
    cache_params: LaplaceState | None = None

    @property
    def state(self) -> LaplaceState | None:
        return self.cache_params


class LaplacePreTrainedModel(PreTrainedModel):
    config_class = LaplaceHFConfig
    base_model_prefix = "model"
    _no_split_modules = ["LaplaceDecoderLayer"]

    def _init_weights(self, module):
        # Exported folders carry every tensor; this only matters for from-config models.
        std = self.config.init_std
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=std)


class LaplaceForCausalLM(LaplacePreTrainedModel, GenerationMixin):
    _is_stateful = True  # no assisted generation: a state cannot be rolled back

    def __init__(self, config: LaplaceHFConfig):
        super().__init__(config)
        spec = config.laplace_config
        self.model = LaplaceModel(spec)
        self.lm_head = LaplaceLinear(spec.d_model, spec.vocab_size)
        self.post_init()
        ours = {n: tuple(p.shape) for n, p in self.named_parameters()}
        check_tensors(spec, ours, side="LaplaceForCausalLM parameters vs laplace_spec/names.py")

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def init_state(self, batch_size: int) -> LaplaceState:
        return LaplaceState.zeros(
            self.config.laplace_config, batch_size, self.lm_head.weight.device
        )

    def forward(
        self,
        input_ids,
        state: LaplaceState | None = None,
        labels=None,
        *,
        cache_params: LaplaceState | None = None,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        **kwargs,
    ):
        """input_ids [B, T] from `state` (None: the empty state) -> logits [B, T, V], state.

        `cache_params` is another name for `state` (transformers' generation). A 2-D
        `attention_mask` with zeros must be left padding: each row then runs alone on its
        real tokens (the padded positions' logits are 0). `logits_to_keep` > 0 keeps only the
        last positions' logits; `use_cache=False` returns no state.
        """
        if state is None:
            state = cache_params
        if attention_mask is not None and not bool(attention_mask.all()):
            x, state = self._left_padded(input_ids, attention_mask, state)
        else:
            if state is None:
                state = self.init_state(input_ids.shape[0])
            x, state = self.model(input_ids, state)
        if logits_to_keep and labels is None:
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(x).to(f32)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        out = LaplaceOutput(
            loss=loss, logits=logits, cache_params=None if use_cache is False else state
        )
        return out.to_tuple() if return_dict is False else out

    def _left_padded(self, input_ids, attention_mask, state):
        """Each row on its own real (right-aligned) tokens: hidden [B, T, D] and the states."""
        B, T = input_ids.shape
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask {tuple(attention_mask.shape)} with zeros must match input_ids "
                f"{tuple(input_ids.shape)} (with a cache, pass only the new tokens, unpadded)"
            )
        n = attention_mask.long().sum(-1)
        left = torch.arange(T, device=n.device)[None, :] >= (T - n)[:, None]
        if not torch.equal(attention_mask.bool(), left) or bool((n == 0).any()):
            raise ValueError(
                "Laplace takes left padding only (tokenizer padding_side='left'), and every "
                "row needs at least one token: a recurrent state cannot skip inner or right pads"
            )
        x = None
        states = []
        for b in range(B):
            start = T - int(n[b])
            s = self.init_state(1) if state is None else state.select(slice(b, b + 1))
            h, s = self.model(input_ids[b : b + 1, start:], s)
            if x is None:
                x = h.new_zeros(B, T, h.shape[-1])
            x[b, start:] = h[0]
            states.append(s)
        return x, LaplaceState.cat(states)

    # ---- transformers' generation: the state is the cache, as Mamba's `cache_params` ------

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache is the LaplaceState the forward returns, not a DynamicCache

    def prepare_inputs_for_generation(
        self,
        input_ids,
        cache_params: LaplaceState | None = None,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
        is_first_iteration: bool | None = False,
        **kwargs,
    ):
        inputs = super().prepare_inputs_for_generation(
            input_ids,
            cache_params=cache_params,
            attention_mask=attention_mask,
            use_cache=use_cache,
            is_first_iteration=is_first_iteration,
            **kwargs,
        )
        if use_cache is not False and cache_params is not None and not is_first_iteration:
            # one new token per row on top of the state: the padding is already left out
            inputs["input_ids"] = input_ids[:, -1:].contiguous()
            inputs["attention_mask"] = None
        return inputs

    # ---- loading the exported folder (names and shapes from laplace_spec/names.py) ---------

    @classmethod
    def from_exported(cls, path: str | Path, dtype: torch.dtype = f32) -> LaplaceForCausalLM:
        """Load an exported folder; a missing, extra or mis-shaped tensor is an error."""
        path = Path(path)
        config = LaplaceHFConfig.from_dict(json.loads((path / "config.json").read_text()))
        tensors = load_safetensors_folder(path)
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        check_tensors(config.laplace_config, shapes, side=str(path))
        with torch.device("meta"):
            model = cls(config)
        model = model.to_empty(device="cpu")
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, t in tensors.items():
                params[name].copy_(t.to(f32))
        return model.to(dtype).eval()


def load_safetensors_folder(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards listed in its index file."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise WeightError(f"{path}: no model.safetensors nor model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(path / f)))
    return tensors


AutoModelForCausalLM.register(LaplaceHFConfig, LaplaceForCausalLM, exist_ok=True)
