"""Laplace for the unmodified vLLM engine (v1): an attention-free model with an inner state.

Written as vLLM's own state models are (`models/mamba2.py`, `layers/mamba/`): vLLM layers
(`VocabParallelEmbedding`, `ReplicatedLinear`, `MergedColumnParallelLinear`,
`RowParallelLinear`, `ParallelLMHead` and `LogitsProcessor`) built directly, state dtypes from
vLLM's cache settings (`MambaStateDtypeCalculator`), weights loaded through each parameter's
`weight_loader`. Served at tensor-parallel size 1 (one engine holds every head; replicas are
vLLM's data parallel, `serve/replicas.py`).

Each layer's token mixer is a state-holding layer of vLLM's mamba / linear-attention family
(`MambaBase`, backend `LINEAR`): vLLM gives every running sequence one fixed-size state page,
which holds this layer's GLA matrices [H, dk, dv] and conv window [W, D]. Their dtypes are
`state_dtypes`: fp32 by default (the state is accumulated in fp32 whatever the weights' dtype),
`--mamba-ssm-cache-dtype` for the GLA matrices and `--mamba-cache-dtype` for the conv window
(and for the GLA matrices when the former is `auto`).

The mixer is split as vLLM's Qwen3-Next layer is: what reads and writes the state pages is one
custom op per layer (`vllm::laplace_mixer_state`: the conv, the fused projection between, the
GLA), which a compiled graph calls as an opaque op; everything after it (self-augmentation, head
norm, gate, output projection) is plain torch that vLLM's compile mode fuses with the norms and
the MLP. The op reads and writes the pages through the forward context's
`LinearAttentionMetadata` (its view of the step, `_Step`, is made once per step):

    tokens of a step:  [decode tokens (one per sequence) | prefill tokens, sequence after sequence]
    pages:    one gather of every sequence's page (zeros when the sequence starts in this
              step; its saved state for a decode, a continued chunked prefill or, with prefix
              caching, a start after a cached prefix: seq_len > query_len), in fp32
    conv:     decodes batched; prefills all at once, each from its window (`causal_conv_varlen`)
    GLA:      decodes: one batched O(1) step; prefills: one variable-length chunked pass
              (`gla_chunked_varlen`, boundaries `query_start_loc`, no loop over sequences)
    pages:    one scatter of every final state (in the pages' dtype)

A sequence's first step can be a "decode" (a 1-token prompt): its page still holds an old
sequence's state, so rows with seq_len == 1 start from zeros.

With prefix caching (vLLM's `align` mode) `state_indices_tensor` names the page of the block that
holds each sequence's last token; vLLM copies states between pages itself (before the step, with
the copy functions of `LaplaceVLLMForCausalLM.get_mamba_state_copy_func`), so the layer is the same.

The math is `serve/modeling_laplace.py`'s (the mixer's and MLP's methods, the kernels of
`serve/kernels.py`); sizes and state shapes come from `laplace_spec.config`
(`hf_config.laplace_config`); parameter names are the exported names of `laplace_spec/names.py`,
checked at construction, and `load_weights` accounts for every tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
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
    get_conv_copy_spec,
    get_temporal_copy_spec,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import (
    HasInnerState,
    IsAttentionFree,
    SupportsMambaPrefixCaching,
)
from vllm.model_executor.models.utils import maybe_prefix
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from laplace_spec import names
from laplace_spec.config import LaplaceConfig
from serve.kernels import (
    causal_conv,
    causal_conv_step,
    causal_conv_varlen,
    gla_chunked,
    gla_chunked_varlen,
    gla_step,
)
from serve.modeling_laplace import LaplaceLayerNorm, LaplaceMixer, LaplaceMLP

f32 = torch.float32


def state_dtypes(vllm_config: VllmConfig) -> tuple[torch.dtype, torch.dtype]:
    """The state pages' dtypes in `get_state_shape()` order: (GLA matrices, conv window).

    vLLM's cache settings through its own `MambaStateDtypeCalculator` (the GLA matrices are the
    temporal/SSM state): `mamba_ssm_cache_dtype` for the GLA matrices, `mamba_cache_dtype` for the
    conv window and, when the former is "auto", for both. "auto" is fp32 here, the dtype the
    state is accumulated in, not the weights' dtype (vLLM's Mamba layers take the model's).
    """
    cache = vllm_config.cache_config
    conv, gla = MambaStateDtypeCalculator.mamba2_state_dtype(
        f32, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype
    )
    return gla, conv


def _linear(cls, in_features: int, out_features, prefix: str):
    """A vLLM linear layer called like nn.Linear (no bias, returns the output alone).

    After loading, vLLM's CPU backend packs its weight for oneDNN, which is much faster than
    plain torch GEMMs at decode batch sizes; the parameter is still named `weight`."""
    return cls(in_features, out_features, bias=False, return_bias=False, prefix=prefix)


class LaplaceVLLMMixer(MambaBase, LaplaceMixer):
    """The token mixer as a vLLM state layer; `self.kv_cache` = (gla pages, conv pages).

    LaplaceMixer's math (`project`, `output`, `log_decay_f32`) and its `__init__`, with vLLM's
    `ReplicatedLinear` for the two projections; the profiling run (no pages) runs the
    single-sequence kernels from zero states."""

    def __init__(self, config: LaplaceConfig, prefix: str):
        def linear(name, n_in, n_out):
            return _linear(ReplicatedLinear, n_in, n_out, f"{prefix}.{name}")

        LaplaceMixer.__init__(self, config, linear)
        self.config = config
        for p in (self.conv_weight, self.conv_bias, self.aug_balance, self.head_norm_weight):
            p.requires_grad_(False)  # loaded, never trained (as vLLM's own parameters)
        self.prefix = prefix
        vllm_config = get_current_vllm_config()
        self.state_dtype = state_dtypes(vllm_config)
        ctx = vllm_config.compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"duplicate layer name: {prefix}")
        ctx[prefix] = self  # vLLM finds state layers here and binds their pages
        self.kv_cache = (torch.tensor([]), torch.tensor([]))

    # -- the state page, declared (MambaBase) --
    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR

    def get_state_shape(self):  # one sequence's page: GLA [H, dk, dv], conv window [W, D]
        return self.config.gla_state_shape, self.config.conv_state_shape

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

    def state_tokens(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's tokens h [N, D] (rows beyond the step's n tokens: padding) -> the fused
        projection of their conv outputs [N, qkvg_dim] and their GLA outputs [N, H, dv] fp32
        (zeros on padding rows), each sequence continuing its pages, which are written back."""
        step = self._step()
        if step is None:  # profiling run: no pages; same work, zero state, one sequence
            return self._profiling_tokens(h)
        N, n, td, nd, ns = h.shape[0], step.n, step.td, step.nd, step.ns
        gla_pages, conv_pages = self.kv_cache
        w, b = self.conv_weight, self.conv_bias
        # conv, from each sequence's window page: decodes batched, prefills all at once
        conv0 = self._read(conv_pages, step)  # [ns, W, D]
        if ns == nd:  # a decode-only step (the common case): no concatenations
            u, conv1 = causal_conv_step(h[:n], conv0, w, b)  # [n, D], [n, W, D]
        else:
            u_d, conv_d = causal_conv_step(h[:td], conv0[:nd], w, b)  # [nd, D], [nd, W, D]
            u_p, conv_p = causal_conv_varlen(h[td:n], conv0[nd:], step.cu[nd:] - td, w, b)
            u, conv1 = torch.cat([u_d, u_p]), torch.cat([conv_d, conv_p])
        conv_pages.index_copy_(0, step.slots, conv1.to(conv_pages.dtype))  # one scatter
        if N > n:  # padding rows: zero inputs to the projection
            u = torch.cat([u, u.new_zeros(N - n, u.shape[1])])
        qkvg = self.qkvg_proj(u)  # [N, qkvg_dim]
        q, k, v, _ = self.split(qkvg[:n])
        # GLA, from each sequence's state page: decodes one O(1) step, prefills one
        # variable-length chunked pass (boundaries `query_start_loc`)
        log_decay = self.log_decay_f32(h.device)
        gla0 = self._read(gla_pages, step)  # [ns, H, dk, dv]
        if ns == nd:
            o, gla1 = gla_step(q, k, v, log_decay, gla0, self.scale)  # [n, H, dv], [n, H, dk, dv]
        else:
            o_d, gla_d = gla_step(q[:td], k[:td], v[:td], log_decay, gla0[:nd], self.scale)
            o_p, gla_p = gla_chunked_varlen(
                q[td:],
                k[td:],
                v[td:],
                log_decay,
                gla0[nd:],
                step.cu[nd:] - td,
                self.scale,
                self.chunk_size,
            )  # [n - td, H, dv], [ns - nd, H, dk, dv]
            o, gla1 = torch.cat([o_d, o_p]), torch.cat([gla_d, gla_p])
        gla_pages.index_copy_(0, step.slots, gla1.to(gla_pages.dtype))  # one scatter
        if N > n:
            o = torch.cat([o, o.new_zeros(N - n, *o.shape[1:])])
        return qkvg, o

    def _profiling_tokens(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`state_tokens` without pages (vLLM's profiling run): one sequence from zero states."""
        zero_conv = h.new_zeros(1, *self.config.conv_state_shape, dtype=f32)
        u = causal_conv(h[None], zero_conv, self.conv_weight, self.conv_bias)[0][0]
        qkvg = self.qkvg_proj(u)
        q, k, v, _ = self.split(qkvg)
        zero_gla = h.new_zeros(1, *self.config.gla_state_shape, dtype=f32)
        log_decay = self.log_decay_f32(h.device)
        o, _ = gla_chunked(
            q[None], k[None], v[None], log_decay, zero_gla, self.scale, self.chunk_size
        )
        return qkvg, o[0]

    def _step(self) -> _Step | None:
        """This layer's view of the step's `LinearAttentionMetadata` (None: the profiling run).
        Every state layer of the model shares one metadata object per step, so the view is
        made once a step (by the first layer) and kept on that object."""
        meta = get_forward_context().attn_metadata
        if isinstance(meta, dict):
            meta = meta.get(self.prefix)
        if meta is None:
            return None
        step = meta.__dict__.get("_laplace_step")
        if step is None:
            step = meta.__dict__["_laplace_step"] = _Step.of(meta)
        return step

    def _read(self, pages: torch.Tensor, step: _Step) -> torch.Tensor:
        """One gather of every page of the step (a copy, fp32; a no-op cast for fp32 pages),
        zeros for the sequences that start in it."""
        x = pages.index_select(0, step.slots).to(f32)  # [ns, ...]
        if step.fresh is not None:
            x[step.fresh] = 0.0
        return x


@dataclasses.dataclass(frozen=True)
class _Step:
    """One step's tokens as a state layer sees them: `nd` decodes then `ns - nd` prefills;
    tokens [0, td) are the decodes', [td, n) the prefills' (boundaries `cu`, [ns + 1]); `slots`
    [ns] each sequence's page; `fresh` [ns] the sequences that start here (None: none does)."""

    nd: int
    ns: int
    td: int
    n: int
    slots: torch.Tensor
    cu: torch.Tensor
    fresh: torch.Tensor | None

    @staticmethod
    def of(meta) -> _Step:
        nd, ns = meta.num_decodes, meta.num_decodes + meta.num_prefills
        cu = meta.query_start_loc[: ns + 1].long()  # [ns + 1] token boundaries
        # a sequence that starts in this step (seq_len == query_len) finds an old sequence's
        # state in its page: it starts from zeros. Otherwise (a decode, a continued chunked
        # prefill, a prefix-cache hit) its page holds its state so far.
        fresh = meta.seq_lens[:ns].to(cu.device) == cu[1:] - cu[:-1]  # [ns]
        return _Step(
            nd=nd,
            ns=ns,
            td=meta.num_decode_tokens,  # one per decode row
            n=meta.num_decode_tokens + meta.num_prefill_tokens,  # beyond n: padding, left at 0
            slots=meta.state_indices_tensor[:ns].long(),  # [ns] each sequence's page
            cu=cu,
            fresh=fresh if bool(fresh.any()) else None,  # a host check (CPU tensors)
        )


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat without a copy for one part (a decode-only or prefill-only step)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


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


class LaplaceVLLMMLP(LaplaceMLP):
    """LaplaceMLP's forward on vLLM's MLP layers (as vLLM's LlamaMLP): the fused [W_1; W_2] as
    one `MergedColumnParallelLinear` (the exported tensor is fused), W_3 a `RowParallelLinear`."""

    def __init__(self, config: LaplaceConfig, prefix: str):
        nn.Module.__init__(self)
        D, F = config.d_model, config.ffn_dim
        self.w12 = _linear(MergedColumnParallelLinear, D, [F, F], f"{prefix}.w12")
        self.w3 = _linear(RowParallelLinear, F, D, f"{prefix}.w3")


class LaplaceVLLMDecoderLayer(nn.Module):
    def __init__(self, config: LaplaceConfig, prefix: str):
        super().__init__()
        self.ln_1 = LaplaceLayerNorm(config.d_model, config.norm_eps)
        self.mixer = LaplaceVLLMMixer(config, prefix=f"{prefix}.mixer")
        self.ln_2 = LaplaceLayerNorm(config.d_model, config.norm_eps)
        self.mlp = LaplaceVLLMMLP(config, prefix=f"{prefix}.mlp")

    def forward(self, x):  # x: [N, D]
        x = x + self.mixer(self.ln_1(x))
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
        self.layers = nn.ModuleList(
            LaplaceVLLMDecoderLayer(config, prefix=maybe_prefix(prefix, f"layers.{i}"))
            for i in range(config.n_layers)
        )
        self.norm = LaplaceLayerNorm(config.d_model, config.norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LaplaceVLLMForCausalLM(nn.Module, HasInnerState, IsAttentionFree, SupportsMambaPrefixCaching):
    """Registered as architecture `LaplaceForCausalLM` (serve/vllm_plugin.py).

    Prefix caching (vLLM's `align` mode, `--enable-prefix-caching`): vLLM keeps a sequence's
    running state in the page of the block holding its last token and copies it to the next
    block's page when a step crosses a block boundary; the page left behind at a prompt's last
    block boundary stays cached under that prefix's hash. On a hit vLLM copies the cached page
    into the new sequence's running page, and the mixer continues from it (seq_len > query_len).
    """

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        config = vllm_config.model_config.hf_config.laplace_config
        return config.gla_state_shape, config.conv_state_shape

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return state_dtypes(vllm_config)

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple[MambaStateCopyFunc, MambaStateCopyFunc]:
        """How vLLM copies one page's states, in `get_state_shape()` order: the GLA matrices as a
        temporal state, the conv window [W, D] as a conv state (both whole, no speculation)."""
        return get_temporal_copy_spec, get_conv_copy_spec

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        tp = vllm_config.parallel_config.tensor_parallel_size
        if tp != 1:
            raise ValueError(
                f"Laplace is served at tensor-parallel size 1, not {tp}: its state layers keep "
                "every head (serve replicas with --data-parallel-size instead)"
            )
        config = vllm_config.model_config.hf_config.laplace_config
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
