"""Laplace for the unmodified vLLM engine (v1): an attention-free model with an inner state, and
the hybrid (`attention_every=k`), whose attention layers also keep vLLM's paged KV cache.

Written as vLLM's own state models are (`models/mamba2.py`, `layers/mamba/`): vLLM layers
(`VocabParallelEmbedding`, `ReplicatedLinear`, `MergedColumnParallelLinear`,
`RowParallelLinear`, `ParallelLMHead` and `LogitsProcessor`) built directly, state dtypes from
vLLM's cache settings (`MambaStateDtypeCalculator`), weights loaded through each parameter's
`weight_loader`. Served at tensor-parallel size 1 (one engine holds every head; replicas are
vLLM's data parallel, `serve/replicas.py`).

Each layer's token mixer is a state-holding layer of vLLM's Mamba2 family (`MambaBase`, backend
`MAMBA2`): vLLM gives every running sequence one fixed-size state page per layer, laid out as
its Mamba2's (`page_shapes`): the conv window of the last W - 1 inputs [W - 1, D] and the GLA
matrices [H, dv, dk]. Their dtypes are `state_dtypes`: fp32 by default (the state is accumulated
in fp32 whatever the weights' dtype), `--mamba-ssm-cache-dtype` for the GLA matrices and
`--mamba-cache-dtype` for the conv window (and for the GLA matrices when the former is `auto`).

Laplace's GLA is Mamba2's SSD with dt = 1, A = log lambda per head, B = k, x = v, C = scale q,
one group per head, no D and no z (docs/design.md s12.3), so the layer runs vLLM's own Mamba2
kernels on those pages, in place, on CPU and CUDA alike (vLLM's platform picks the C++ or
Triton form, as for its Mamba2):

    tokens of a step:  [decode tokens (one per sequence) | prefill tokens, sequence after sequence]
    conv:     decodes `causal_conv1d_update`; prefills `causal_conv1d_fn` (varlen)
    GLA:      decodes `selective_state_update`; prefills `mamba_chunk_scan_combined_varlen`
              (varlen; a sequence with a past, a continued chunked prefill or a prefix-cache
              hit, starts from its page: `has_initial_states_p`)

The step's metadata is vLLM's `Mamba2AttentionMetadata`, built once a step for every layer; a
sequence's first chunk is always a prefill there (its page may hold an old sequence's state).
The mixer is split as vLLM's Qwen3-Next layer is: what reads and writes the state pages is one
custom op per layer (`vllm::laplace_mixer_state`: the conv, the fused projection between, the
GLA), which a compiled graph calls as an opaque op; everything after it (self-augmentation, head
norm, gate, output projection) is plain torch that vLLM's compile mode fuses with the norms and
the MLP.

With prefix caching (vLLM's `align` mode) the state indices name the page of the block that
holds each sequence's last token; vLLM copies states between pages itself (before the step, with
the copy functions of `LaplaceVLLMForCausalLM.get_mamba_state_copy_func`), so the layer is the same.

A hybrid's attention layer (`LaplaceVLLMAttentionMixer`) keeps its conv window on the same state
pages and runs step 4 with vLLM's `Attention` on the KV cache (keys and values zero-padded to one
head size, `kv_page_head_size`); the model class declares `IsHybrid`
(`LaplaceHybridVLLMForCausalLM`, architecture `LaplaceHybridForCausalLM`), and vLLM's hybrid
KV-cache manager pads every state page to one KV block (docs/design.md s13.4).

The reference is `serve/modeling_laplace.py` (the mixer's and MLP's methods, the PyTorch kernels
of `serve/kernels.py`); sizes and state shapes come from `laplace_spec.config`
(`hf_config.laplace_config`); parameter names are the exported names of `laplace_spec/names.py`,
checked at construction, and `load_weights` accounts for every tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFunc,
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
    get_conv_copy_spec,
    get_temporal_copy_spec,
    is_conv_state_dim_first,
)
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    causal_conv1d_fn,
    causal_conv1d_update,
)
from vllm.model_executor.layers.mamba.ops.mamba_ssm import selective_state_update
from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import (
    HasInnerState,
    IsAttentionFree,
    IsHybrid,
    SupportsMambaPrefixCaching,
)
from vllm.model_executor.models.utils import maybe_prefix
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadata
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from laplace_spec import names
from laplace_spec.config import LaplaceConfig
from serve.kernels import causal_conv, gla_chunked, silu_and_mul
from serve.modeling_laplace import LaplaceLayerNorm, LaplaceMixer, mixer_input

f32 = torch.float32


def page_shapes(config: LaplaceConfig) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """One sequence's state pages of one layer, as vLLM's Mamba2 lays out its own: the conv
    window of the last W - 1 inputs, [W - 1, D] (vLLM's default "SD" layout; [D, W - 1] under
    VLLM_SSM_CONV_STATE_LAYOUT=DS), and the GLA matrices transposed, [H, dv, dk] (Mamba2's
    [heads, head_dim, d_state])."""
    conv = MambaStateShapeCalculator._orient_conv_shape(config.d_model, config.page_conv_window)
    return conv, (config.n_heads, config.d_v, config.d_k)


def state_dtypes(vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
    """The state pages' dtypes in `get_state_shape()` order: (conv window, GLA matrices).

    vLLM's cache settings through its own `MambaStateDtypeCalculator` (the GLA matrices are the
    temporal/SSM state): `mamba_ssm_cache_dtype` for the GLA matrices, `mamba_cache_dtype` for the
    conv window and, when the former is "auto", for both. "auto" is fp32 here, the dtype the
    state is accumulated in, not the weights' dtype (vLLM's Mamba layers take the model's).
    """
    cache = vllm_config.cache_config
    return MambaStateDtypeCalculator.mamba2_state_dtype(
        f32, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype
    )


def _linear(cls, in_features: int, out_features, prefix: str):
    """A vLLM linear layer called like nn.Linear (no bias, returns the output alone).

    After loading, vLLM's CPU backend packs its weight for oneDNN, which is much faster than
    plain torch GEMMs at decode batch sizes; the parameter is still named `weight`."""
    return cls(in_features, out_features, bias=False, return_bias=False, prefix=prefix)


class LaplaceVLLMMixer(MambaBase, LaplaceMixer):
    """The token mixer as a vLLM Mamba2 state layer; `self.kv_cache` = (conv pages, GLA pages).

    LaplaceMixer's math (`split`, `output`) and its `__init__`, with vLLM's `ReplicatedLinear`
    for the two projections; the conv and the GLA are vLLM's Mamba2 kernels on the pages
    (docs/design.md s12.3). The profiling run (no pages) runs the PyTorch kernels from zero states
    on one sequence."""

    def __init__(self, config: LaplaceConfig, prefix: str):
        def linear(name, n_in, n_out):
            return _linear(ReplicatedLinear, n_in, n_out, f"{prefix}.{name}")

        LaplaceMixer.__init__(self, config, linear)
        self.config = config
        for p in (self.conv_weight, self.conv_bias, self.aug_balance, self.head_norm_weight):
            p.requires_grad_(False)  # loaded, never trained (as vLLM's own parameters)
        if self.branch_form != "multiplier":
            self.branch_gain.requires_grad_(False)
        self.prefix = prefix
        vllm_config = get_current_vllm_config()
        self.state_dtype = state_dtypes(vllm_config)
        ctx = vllm_config.compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"duplicate layer name: {prefix}")
        ctx[prefix] = self  # vLLM finds state layers here and binds their pages
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        self._decay: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- the state pages, declared (MambaBase) as vLLM's Mamba2 declares its own --
    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.MAMBA2

    def get_state_shape(self):
        return page_shapes(self.config)

    def get_state_dtype(self):
        return self.state_dtype

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, D]
        """One custom op reads and writes this layer's state pages (conv, the fused projection
        between, GLA: `state_tokens`); the self-augmentation, head norm, gate and output
        projection after it are plain torch, which vLLM's compile mode fuses with the norms
        and the MLP around them (vLLM's Qwen3-Next layer is split the same way)."""
        qkvg, o = torch.ops.vllm.laplace_mixer_state(h, self.prefix)  # [N, qkvg], [N, H, dv]
        q, k, v, g = self.split(qkvg)  # [N, H, dk], [N, H, dk], [N, H, dv], [N, H dv]
        return self.output(o, q, k, v, g)

    def decay(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Mamba2's A for the chunk scan [H] and for the one-token update [H, dv, dk] (a
        stride-0 view): log lambda per head, fp32, made once."""
        if self._decay is None or self._decay[0].device != device:
            A = self.log_decay_f32(device)  # [H]
            self._decay = A, A[:, None, None].expand(-1, self.d_v, self.d_k)
        return self._decay

    def state_tokens(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's tokens h [N, D] (rows beyond the step's n tokens: padding) -> the fused
        projection of their conv outputs [N, qkvg_dim] and their GLA outputs [N, H, dv] fp32
        (zeros on padding rows), each sequence continuing its pages, which the kernels update
        in place (the chunk scan's final states are written back by one scatter).

        Mamba2's kernels with dt = 1, A = log lambda, B = k, x = v, C = scale q (docs/design.md
        s12.3): decodes through `causal_conv1d_update` and `selective_state_update`, prefills
        (fresh, continued chunked prefills, prefix-cache hits) through `causal_conv1d_fn` and
        `mamba_chunk_scan_combined_varlen`, each sequence from its pages when
        `has_initial_states_p` says it has a past."""
        meta = self._metadata()
        if meta is None:  # profiling run: no pages; same work, zero state, one sequence
            return self._profiling_tokens(h)
        N, H, dv = h.shape[0], self.n_heads, self.d_v
        td, n = meta.num_decode_tokens, meta.num_decode_tokens + meta.num_prefill_tokens
        gla_pages = self.kv_cache[1]
        u = self.convolve_pages(h, meta)  # [N, D]
        qkvg = self.qkvg_proj(u)  # [N, qkvg_dim]
        q, k, v, _ = self.split(qkvg[:n])
        if qkvg.dtype != f32:  # the GLA in fp32 whatever the activations' dtype
            q, k, v = q.to(f32), k.to(f32), v.to(f32)
        c = q * self.scale  # [n, H, dk] Mamba2's C
        A, A_step = self.decay(h.device)
        # [N, H, dv], written in place by the kernels (the padding rows stay zero)
        o = h.new_empty(N, H, dv, dtype=f32) if N == n else h.new_zeros(N, H, dv, dtype=f32)
        if meta.num_decodes:
            dt = _ones(meta, "decode", (td, H, dv), o)
            selective_state_update(
                gla_pages,
                v[:td],
                dt,
                A_step,
                k[:td],
                c[:td],
                state_batch_indices=meta.state_indices_tensor_d,
                dst_state_batch_indices=meta.state_indices_tensor_d,
                out=o[:td],
            )
        if meta.num_prefills:
            idx = meta.state_indices_tensor_p
            initial = None
            if meta.prep_initial_states:  # some sequence continues its page
                has = meta.has_initial_states_p[:, None, None, None]
                initial = torch.where(has, gla_pages[idx], 0.0)  # [P, H, dv, dk]
            gla_pages[idx] = mamba_chunk_scan_combined_varlen(
                v[td:],
                _ones(meta, "prefill", (n - td, H), o),
                A,
                k[td:],
                c[td:],
                chunk_size=meta.chunk_size,
                cu_seqlens=meta.query_start_loc_p,
                cu_chunk_seqlens=meta.cu_chunk_seqlen_p,
                last_chunk_indices=meta.last_chunk_indices_p,
                seq_idx=meta.seq_idx_p,
                out=o[td:n],
                initial_states=initial,
                state_dtype=gla_pages.dtype,
            )  # [P, H, dv, dk] final states
        return qkvg, o

    def convolve_pages(self, h: torch.Tensor, meta: Mamba2AttentionMetadata) -> torch.Tensor:
        """SiLU(causal depth-wise conv) of the step's tokens h [N, D] -> u [N, D] (zeros on
        padding rows), each sequence continuing its conv window page, which the kernels update
        in place: decodes through `causal_conv1d_update`, prefills through `causal_conv1d_fn`
        (varlen; from the page when `has_initial_states_p` says the sequence has a past)."""
        N = h.shape[0]
        td, n = meta.num_decode_tokens, meta.num_decode_tokens + meta.num_prefill_tokens
        conv_pages = self.kv_cache[0]
        conv_state = conv_pages if is_conv_state_dim_first() else conv_pages.transpose(-1, -2)
        # [D, W] (the exported layout is Mamba2's) and [D], in fp32: with fp32 weights the
        # prefill kernel sums in fp32 and rounds u once, as the decode kernel does (s12.4)
        w, b = self.conv_weight.to(f32), self.conv_bias.to(f32)
        if meta.num_prefills == 0 and N == n:  # the common step: decodes only, no padding
            return causal_conv1d_update(
                h, conv_state, w, b, "silu", conv_state_indices=meta.state_indices_tensor_d
            )
        u = torch.empty_like(h)
        u[n:] = 0.0  # padding rows: zero inputs to the projection
        if meta.num_decodes:
            u[:td] = causal_conv1d_update(
                h[:td], conv_state, w, b, "silu", conv_state_indices=meta.state_indices_tensor_d
            )
        if meta.num_prefills:
            u[td:n] = causal_conv1d_fn(
                h[td:n].transpose(0, 1),  # [D, T_p]: the layout the conv kernels take
                w,
                b,
                conv_states=conv_state,
                query_start_loc=meta.query_start_loc_p,
                cache_indices=meta.state_indices_tensor_p,
                has_initial_state=meta.has_initial_states_p,
                activation="silu",
                metadata=meta,
            ).transpose(0, 1)
        return u

    def _profiling_tokens(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`state_tokens` without pages (vLLM's profiling run): one sequence from zero states,
        through the PyTorch kernels."""
        qkvg = self.qkvg_proj(self._profiling_conv(h))
        q, k, v, _ = self.split(qkvg)
        zero_gla = h.new_zeros(1, *self.config.gla_state_shape, dtype=f32)
        log_decay = self.log_decay_f32(h.device)
        o, _ = gla_chunked(
            q[None], k[None], v[None], log_decay, zero_gla, self.scale, self.chunk_size
        )
        return qkvg, o[0]

    def _profiling_conv(self, h: torch.Tensor) -> torch.Tensor:
        """The conv outputs u [N, D] of one sequence from a zero window (the profiling run)."""
        zero_conv = h.new_zeros(1, *self.config.conv_state_shape, dtype=f32)
        return causal_conv(h[None], zero_conv, self.conv_weight, self.conv_bias)[0][0]

    def _metadata(self) -> Mamba2AttentionMetadata | None:
        """This layer's `Mamba2AttentionMetadata` of the step (None: the profiling run), built
        by vLLM once a step for every state layer."""
        meta = get_forward_context().attn_metadata
        if isinstance(meta, dict):
            meta = meta.get(self.prefix)
        return meta


def _ones(meta, part: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Mamba2's dt = 1 for the step's decode or prefill tokens, made once a step (by the first
    layer) and kept on the step's metadata, which every state layer shares."""
    key = f"_laplace_dt_{part}"
    ones = meta.__dict__.get(key)
    if ones is None:
        ones = meta.__dict__[key] = like.new_ones(shape)
    return ones


class LaplaceVLLMAttentionMixer(LaplaceVLLMMixer):
    """A hybrid's attention layer (docs/design.md s13.4): LaplaceMixer with step 4 vLLM's
    `Attention` on its paged KV cache (causal, no positional encoding, scale qk_scale, one head
    size `kv_page_head_size` for keys and values, zero-padded to it). The conv window is still
    a state: the layer keeps the GLA layers' state pages (so every state layer shares one page
    spec and one KV-cache group) and uses their conv window only; its GLA page is never read.
    """

    kind = "attention"

    def __init__(self, config: LaplaceConfig, prefix: str):
        super().__init__(config, prefix)
        self.head_size = config.kv_page_head_size
        self.attn = Attention(
            config.n_heads,
            self.head_size,
            self.scale,
            num_kv_heads=config.n_heads,
            cache_config=get_current_vllm_config().cache_config,
            prefix=f"{prefix}.attn",
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, D]
        qkvg = torch.ops.vllm.laplace_mixer_conv(h, self.prefix)  # [N, qkvg_dim]
        q, k, v, g = self.split(qkvg)  # [N, H, dk], [N, H, dk], [N, H, dv], [N, H dv]
        pad = lambda x: F.pad(x, (0, self.head_size - x.shape[-1])).flatten(1)  # noqa: E731
        o = self.attn(pad(q), pad(k), pad(v))  # [N, H hs]
        o = o.view(-1, self.n_heads, self.head_size)[..., : self.d_v].to(f32)  # [N, H, dv]
        return self.output(o, q, k, v, g)

    def conv_tokens(self, h: torch.Tensor) -> torch.Tensor:
        """The step's tokens h [N, D] -> the fused projection of their conv outputs
        [N, qkvg_dim], each sequence continuing its conv window page."""
        meta = self._metadata()
        u = self._profiling_conv(h) if meta is None else self.convolve_pages(h, meta)
        return self.qkvg_proj(u)


# The state step as a custom op (vLLM's own state layers are registered the same way): a
# compiled graph calls it as an opaque op, and it finds its layer by name.
def laplace_mixer_state(h: torch.Tensor, layer_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return get_forward_context().no_compile_layers[layer_name].state_tokens(h)


def _laplace_mixer_state_fake(h: torch.Tensor, layer_name: str):
    layer = get_forward_context().no_compile_layers[layer_name]
    c = layer.config
    o = h.new_empty(h.shape[0], c.n_heads, c.d_v, dtype=f32)
    return h.new_empty(h.shape[0], c.qkvg_dim), o


direct_register_custom_op(
    op_name="laplace_mixer_state",
    op_func=laplace_mixer_state,
    fake_impl=_laplace_mixer_state_fake,
)


def laplace_mixer_conv(h: torch.Tensor, layer_name: str) -> torch.Tensor:
    return get_forward_context().no_compile_layers[layer_name].conv_tokens(h)


def _laplace_mixer_conv_fake(h: torch.Tensor, layer_name: str):
    layer = get_forward_context().no_compile_layers[layer_name]
    return h.new_empty(h.shape[0], layer.config.qkvg_dim)


direct_register_custom_op(
    op_name="laplace_mixer_conv",
    op_func=laplace_mixer_conv,
    fake_impl=_laplace_mixer_conv_fake,
)


class LaplaceVLLMMLP(nn.Module):
    """LaplaceMLP's math on vLLM's MLP layers (as vLLM's LlamaMLP): the fused [W_1; W_2] as one
    `MergedColumnParallelLinear` (the exported tensor is fused), W_3 a `RowParallelLinear`.
    Between them `silu_and_mul` (serve/kernels.py), not vLLM's `SiluAndMul`: on x86 CPUs that
    layer's eager form rounds SiLU(gate) to bf16 before the product and its compiled form does
    not, so the served tokens would depend on the compile mode; ours is fp32, rounded once, in
    every mode (the bf16 contract, docs/design.md s12.4)."""

    def __init__(self, config: LaplaceConfig, prefix: str):
        super().__init__()
        D, F = config.d_model, config.ffn_dim
        self.w12 = _linear(MergedColumnParallelLinear, D, [F, F], f"{prefix}.w12")
        self.w3 = _linear(RowParallelLinear, F, D, f"{prefix}.w3")

    def forward(self, x):  # [N, D] -> [N, D]
        return self.w3(silu_and_mul(self.w12(x)))


class LaplaceVLLMDecoderLayer(nn.Module):
    def __init__(self, config: LaplaceConfig, mixer: str, prefix: str):
        super().__init__()
        self.ln_1 = LaplaceLayerNorm(config.d_model, config.norm_eps)
        if mixer == "attention" and config.attention_reads_embedding:
            self.ln_0 = LaplaceLayerNorm(config.d_model, config.norm_eps)  # x_0's (s13.5)
        Mixer = LaplaceVLLMAttentionMixer if mixer == "attention" else LaplaceVLLMMixer
        self.mixer = Mixer(config, prefix=f"{prefix}.mixer")
        self.ln_2 = LaplaceLayerNorm(config.d_model, config.norm_eps)
        self.mlp = LaplaceVLLMMLP(config, prefix=f"{prefix}.mlp")

    def forward(self, x, embedding):  # x, embedding (x_0): [N, D]
        x = x + self.mixer(mixer_input(self, x, embedding))
        return x + self.mlp(self.ln_2(x))


# vLLM compile mode only (eager otherwise): traced once with a symbolic token count
@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0})
class LaplaceVLLMModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config.laplace_config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.d_model, prefix=maybe_prefix(prefix, "embed_tokens")
        )
        self.embed_multiplier = config.embed_multiplier  # sqrt(D) or 1 (`embed_scale`)
        self.layers = nn.ModuleList(
            LaplaceVLLMDecoderLayer(config, mixer, prefix=maybe_prefix(prefix, f"layers.{i}"))
            for i, mixer in enumerate(config.layer_mixers)
        )
        self.norm = LaplaceLayerNorm(config.d_model, config.norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        e = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        x = (e.float() * self.embed_multiplier).to(e.dtype)  # scaled in fp32, as JAX does
        x0 = x
        for layer in self.layers:
            x = layer(x, x0)
        return self.norm(x)


class _LaplaceVLLMCausalLM(nn.Module, HasInnerState, SupportsMambaPrefixCaching):
    """Laplace on vLLM: the pure model (`LaplaceVLLMForCausalLM`, attention-free) and the
    hybrid (`LaplaceHybridVLLMForCausalLM`) differ only in what they declare to vLLM.

    Prefix caching (vLLM's `align` mode, `--enable-prefix-caching`): vLLM keeps a sequence's
    running state in the page of the block holding its last token and copies it to the next
    block's page when a step crosses a block boundary; the page left behind at a prompt's last
    block boundary stays cached under that prefix's hash. On a hit vLLM copies the cached page
    into the new sequence's running page, and the mixer continues from it (seq_len > query_len).
    A hybrid's attention layers keep their keys and values in vLLM's KV blocks of the same
    prefix, as vLLM's own hybrids do.
    """

    hybrid = False  # the architecture's kind of config: attention_every = 0 or > 0

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return page_shapes(vllm_config.model_config.hf_config.laplace_config)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return state_dtypes(vllm_config)

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple[MambaStateCopyFunc, MambaStateCopyFunc]:
        """How vLLM copies one page's states, in `get_state_shape()` order (Mamba2's): the conv
        window as a conv state, the GLA matrices as a temporal state (whole, no speculation)."""
        return get_conv_copy_spec, get_temporal_copy_spec

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        tp = vllm_config.parallel_config.tensor_parallel_size
        if tp != 1:
            raise ValueError(
                f"Laplace is served at tensor-parallel size 1, not {tp}: its state layers keep "
                "every head (serve replicas with --data-parallel-size instead)"
            )
        config = vllm_config.model_config.hf_config.laplace_config
        if bool(config.attention_every) != self.hybrid:
            raise ValueError(
                f"{vllm_config.model_config.model}: attention_every={config.attention_every} is "
                f"served as architecture {config.architecture}, not "
                f"{vllm_config.model_config.architecture} (config.json's architectures)"
            )
        self.config = config
        self.model = LaplaceVLLMModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.d_model, bias=False, prefix=maybe_prefix(prefix, "lm_head")
        )
        self.logits_processor = LogitsProcessor(config.vocab_size)
        ours = {n: tuple(p.shape) for n, p in self.named_parameters()}
        names.check_tensors(config, ours, side="vLLM Laplace parameters vs laplace_spec/names.py")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs
    ):
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Every exported tensor through its parameter's `weight_loader` (vLLM's
        `default_weight_loader` where it has none); then every name and shape is checked
        against laplace_spec/names.py: a missing, unexpected or mis-shaped tensor is an error
        naming it (and is not loaded)."""
        params = dict(self.named_parameters())
        expected = names.exported_shapes(self.config)
        got = {}
        for name, w in weights:
            got[name] = tuple(w.shape)
            if expected.get(name) == got[name]:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, w)
        names.check_tensors(self.config, got, side="vLLM load_weights")
        return set(got)


class LaplaceVLLMForCausalLM(_LaplaceVLLMCausalLM, IsAttentionFree):
    """Registered as architecture `LaplaceForCausalLM` (serve/vllm_plugin.py): every layer a
    GLA layer, one state page per sequence and layer, no KV cache."""


class LaplaceHybridVLLMForCausalLM(_LaplaceVLLMCausalLM, IsHybrid):
    """Registered as architecture `LaplaceHybridForCausalLM`: GLA layers on state pages and
    attention layers on vLLM's paged KV cache; vLLM's hybrid KV-cache manager sizes the
    attention block so that one block of keys and values takes at least one state page's bytes
    and pads the state pages to it (docs/design.md s13.4)."""

    hybrid = True
