"""Laplace in plain PyTorch, Hugging Face style (no JAX): the serving side of the model.

The math is that of `laplace_jax/model.py` (DESIGN.md sections 2 and 3), step for step:

    x = embed(tokens)                                              # [B, T, D]
    per layer:  h = LN_1(x); u = SiLU(causal_conv(h)); [q k v g] = u W_qkvg^T
                o = GLA(q, k, v) (chunked prefill or O(1) step) + sigmoid(q a k) v
                x += (HeadRMSNorm(o) * SiLU(g)) W_out^T
                x += W_3 (SiLU(W_1 LN_2(x)) * W_2 LN_2(x))
    logits = LN_f(x) W_lm^T

The recurrent state is an explicit `LaplaceState` (per layer the GLA matrices [B, H, dk, dv] and
the last W conv inputs [B, W, D], fp32), the layout of docs/parameters.md. Parameter names are the
exported tensor names of `export/names.py`, checked at construction and on load.

    model = LaplaceForCausalLM.from_exported("exported/")       # or AutoModelForCausalLM
    out = model(input_ids)                                       # logits [B, T, V], out.state
    out = model(next_ids[:, None], state=out.state)             # one decode step, O(1)
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers.utils import ModelOutput

from export import names

f32 = torch.float32


# ---- configuration --------------------------------------------------------------------------


class LaplaceConfig(PreTrainedConfig):
    """The fields of `laplace_jax.config.LaplaceConfig` (defaults: laplace-3b), HF style."""

    model_type = "laplace"
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "intermediate_size": "ffn_dim",
    }

    def __init__(
        self,
        vocab_size: int = 50_304,
        d_model: int = 3_072,
        n_layers: int = 24,
        n_heads: int = 16,
        d_k: int = 96,
        d_v: int = 192,
        conv_width: int = 4,
        ffn_dim: int = 8_192,
        t_min: float = 1.0,
        t_max: float = 2_048.0,
        n_tiers: int = 4,
        seq_len: int = 2_048,
        chunk_size: int = 128,
        norm_eps: float = 1e-5,
        init_std: float = 0.02,
        compute_dtype: str = "float32",
        max_position_embeddings: int = 65_536,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.d_k = d_k
        self.d_v = d_v
        self.conv_width = conv_width
        self.ffn_dim = ffn_dim
        self.t_min = float(t_min)
        self.t_max = float(t_max)
        self.n_tiers = n_tiers
        self.seq_len = seq_len
        self.chunk_size = chunk_size
        self.norm_eps = norm_eps
        self.init_std = init_std
        self.compute_dtype = compute_dtype
        self.max_position_embeddings = max_position_embeddings
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def state_bytes_per_seq(self) -> int:
        """fp32 bytes of one sequence's state: L (H dk dv + W D) 4 (29,491,200 for 3B)."""
        per_layer = self.n_heads * self.d_k * self.d_v + self.conv_width * self.d_model
        return 4 * self.n_layers * per_layer


# ---- the math, as functions shared with the vLLM adapter -------------------------------------


def log_decay_schedule(n_heads: int, t_min: float, t_max: float) -> torch.Tensor:
    """gamma_h = -ln 2 / T_h, T_h = T_min (T_max / T_min) ** (h / (H - 1)); fp64 -> fp32. [H]"""
    h = torch.arange(n_heads, dtype=torch.float64)
    half_life = t_min * (t_max / t_min) ** (h / max(n_heads - 1, 1))
    return (-math.log(2.0) / half_life).to(f32)


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


# ---- the recurrent state -----------------------------------------------------------------------


@dataclasses.dataclass
class LaplaceState:
    """Per layer: `gla` [B, H, dk, dv] and `conv` [B, W, D] (last W LN_1 outputs), fp32."""

    gla: list[torch.Tensor]
    conv: list[torch.Tensor]

    @classmethod
    def zeros(cls, config: LaplaceConfig, batch_size: int, device=None) -> LaplaceState:
        c = config
        return cls(
            [
                torch.zeros(batch_size, c.n_heads, c.d_k, c.d_v, device=device)
                for _ in range(c.n_layers)
            ],
            [
                torch.zeros(batch_size, c.conv_width, c.d_model, device=device)
                for _ in range(c.n_layers)
            ],
        )

    @property
    def batch_size(self) -> int:
        return self.gla[0].shape[0]

    def nbytes_per_seq(self) -> int:
        return sum(t[0].nbytes for t in self.gla + self.conv)

    @classmethod
    def cat(cls, states: list[LaplaceState]) -> LaplaceState:
        return cls(
            [torch.cat([s.gla[i] for s in states]) for i in range(len(states[0].gla))],
            [torch.cat([s.conv[i] for s in states]) for i in range(len(states[0].conv))],
        )

    def select(self, index) -> LaplaceState:
        return LaplaceState([t[index] for t in self.gla], [t[index] for t in self.conv])

    def padded(self, width: int) -> LaplaceState:
        """Zero rows appended up to `width` sequences (decode batch-width padding)."""
        extra = width - self.batch_size
        if extra <= 0:
            return self
        return LaplaceState(
            [torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) for t in self.gla],
            [torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) for t in self.conv],
        )


# ---- modules (parameter names == export/names.py's exported names) --------------------------


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

    def __init__(self, config: LaplaceConfig):
        super().__init__()
        c = config
        self.n_heads, self.d_k, self.d_v, self.n_tiers = c.n_heads, c.d_k, c.d_v, c.n_tiers
        self.chunk_size, self.eps, self.scale = c.chunk_size, c.norm_eps, c.d_k**-0.5
        qkvg = c.n_heads * (2 * c.d_k + 2 * c.d_v)
        # conv as plain parameters (not vLLM linear classes: its CPU backend repacks those)
        self.conv_weight = nn.Parameter(torch.zeros(c.d_model, c.conv_width))  # [D, W]
        self.conv_bias = nn.Parameter(torch.zeros(c.d_model))
        self.qkvg_proj = LaplaceLinear(c.d_model, qkvg)
        self.aug_balance = nn.Parameter(torch.zeros(c.n_heads, c.d_k))
        self.head_norm_weight = nn.Parameter(torch.ones(c.n_tiers, c.d_v))
        self.out_proj = LaplaceLinear(c.n_heads * c.d_v, c.d_model)
        self.t_min, self.t_max = c.t_min, c.t_max  # the decays are fixed, not parameters

    def forward(self, h, window, gla_state):
        """h: [B, T, D] (LN_1 output); window [B, W, D]; gla_state [B, H, dk, dv].

        T == 1 takes the O(1) recurrent step, longer inputs the chunked form.
        Returns (y [B, T, D], new window, new gla state).
        """
        u, window = causal_conv(h, window, self.conv_weight, self.conv_bias)
        q, k, v, g = self.project(u)
        o, gla_state = self.mix(q, k, v, gla_state)
        return self.output(o, q, k, v, g), window, gla_state

    # The steps, separately: the vLLM adapter runs the conv and the GLA per sequence but the
    # projections once over all the tokens of a step.
    def project(self, u):
        """u [..., D] -> q, k [..., H, dk]; v [..., H, dv]; g [..., H * dv]."""
        H, dk, dv = self.n_heads, self.d_k, self.d_v
        q, k, v, g = self.qkvg_proj(u).split([H * dk, H * dk, H * dv, H * dv], dim=-1)
        lead = u.shape[:-1]
        return q.view(*lead, H, dk), k.view(*lead, H, dk), v.view(*lead, H, dv), g

    def mix(self, q, k, v, gla_state):
        """GLA over [B, T, H, *] from `gla_state`: the O(1) step if T == 1, else chunked."""
        # computed, not a buffer: nothing to load, and nothing left uninitialised by meta-device
        # loading (H numbers per call)
        log_decay = log_decay_schedule(self.n_heads, self.t_min, self.t_max).to(q.device)
        if q.shape[1] == 1:
            o, gla_state = gla_step(q[:, 0], k[:, 0], v[:, 0], log_decay, gla_state, self.scale)
            return o[:, None], gla_state  # [B, 1, H, dv]
        return gla_chunked(q, k, v, log_decay, gla_state, self.scale, self.chunk_size)

    def output(self, o, q, k, v, g):
        """Self-augmentation, head RMSNorm, SiLU gate, output projection. o: [..., H, dv]."""
        H, dv = self.n_heads, self.d_v
        # self-augmentation: o += sigmoid(sum_i q_i a_i k_i) v   (fp32)
        aug = torch.sigmoid((q.to(f32) * self.aug_balance.to(f32) * k.to(f32)).sum(-1, True))
        o = o + aug * v.to(f32)
        # head RMSNorm, one scale per tier of contiguous heads
        o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + self.eps)
        o = o * self.head_norm_weight.to(f32).repeat_interleave(H // self.n_tiers, dim=0)
        y = o.reshape(*o.shape[:-2], H * dv).to(g.dtype) * F.silu(g)
        return self.out_proj(y)


class LaplaceMLP(nn.Module):
    def __init__(self, config: LaplaceConfig):
        super().__init__()
        self.w12 = LaplaceLinear(config.d_model, 2 * config.ffn_dim)  # [W_1; W_2]
        self.w3 = LaplaceLinear(config.ffn_dim, config.d_model)

    def forward(self, x):
        gate, up = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(gate) * up)


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
        self.ln_2 = LaplaceLayerNorm(config.d_model, config.norm_eps)
        self.mlp = LaplaceMLP(config)

    def forward(self, x, window, gla_state):
        y, window, gla_state = self.mixer(self.ln_1(x), window, gla_state)
        x = x + y
        x = x + self.mlp(self.ln_2(x))
        return x, window, gla_state


class LaplaceModel(nn.Module):
    def __init__(self, config: LaplaceConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(LaplaceDecoderLayer(config) for _ in range(config.n_layers))
        self.norm = LaplaceLayerNorm(config.d_model, config.norm_eps)

    def forward(self, input_ids, state: LaplaceState):
        x = self.embed_tokens(input_ids)  # [B, T, D]
        gla, conv = [], []
        for i, layer in enumerate(self.layers):
            x, w, s = layer(x, state.conv[i], state.gla[i])
            conv.append(w)
            gla.append(s)
        return self.norm(x), LaplaceState(gla, conv)


@dataclasses.dataclass
class LaplaceOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # [B, T, V] fp32
    state: LaplaceState | None = None


class LaplacePreTrainedModel(PreTrainedModel):
    config_class = LaplaceConfig
    base_model_prefix = "model"
    _no_split_modules = ["LaplaceDecoderLayer"]

    def _init_weights(self, module):
        # Exported folders carry every tensor; this only matters for from-config models.
        std = self.config.init_std
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=std)


class LaplaceForCausalLM(LaplacePreTrainedModel):
    def __init__(self, config: LaplaceConfig):
        super().__init__(config)
        self.model = LaplaceModel(config)
        self.lm_head = LaplaceLinear(config.d_model, config.vocab_size)
        self.post_init()
        ours = {n: tuple(p.shape) for n, p in self.named_parameters()}
        names.check_tensors(config, ours, side="LaplaceForCausalLM parameters vs export/names.py")

    def init_state(self, batch_size: int) -> LaplaceState:
        return LaplaceState.zeros(self.config, batch_size, self.lm_head.weight.device)

    def forward(self, input_ids, state: LaplaceState | None = None, labels=None, **kwargs):
        """input_ids [B, T] from `state` (None: the empty state) -> logits [B, T, V], state."""
        if state is None:
            state = self.init_state(input_ids.shape[0])
        x, state = self.model(input_ids, state)
        logits = self.lm_head(x).to(f32)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return LaplaceOutput(loss=loss, logits=logits, state=state)

    # ---- loading the exported folder (names and shapes from export/names.py) ----------------

    @classmethod
    def from_exported(cls, path: str | Path, dtype: torch.dtype = f32) -> LaplaceForCausalLM:
        """Load an exported folder; a missing, extra or mis-shaped tensor is an error."""
        path = Path(path)
        config = LaplaceConfig.from_dict(json.loads((path / "config.json").read_text()))
        tensors = load_safetensors_folder(path)
        names.check_tensors(config, {k: tuple(v.shape) for k, v in tensors.items()}, side=str(path))
        with torch.device("meta"):
            model = cls(config)
        model = model.to_empty(device="cpu")
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, t in tensors.items():
                params[name].copy_(t.to(f32))
        return model.to(dtype).eval()

    # ---- greedy generation with an explicit state -------------------------------------------

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, LaplaceState]:
        """Each prompt on its own (any lengths); returns (last logits [B, V], stacked state)."""
        logits, states = [], []
        for p in prompts:
            out = self(torch.tensor([p], dtype=torch.long))
            logits.append(out.logits[:, -1])
            states.append(out.state)
        return torch.cat(logits), LaplaceState.cat(states)

    @torch.no_grad()
    def greedy_generate(
        self, prompts: list[list[int]], max_new_tokens: int, decoder: DecodeRunner | None = None
    ) -> list[list[int]]:
        """Greedy tokens for prompts of any lengths, decoded together as one batch."""
        decoder = decoder or DecodeRunner(self)
        logits, state = self.prefill(prompts)
        tokens = logits.argmax(-1)
        out = [tokens]
        for _ in range(max_new_tokens - 1):
            logits, state = decoder.step(tokens, state)
            tokens = logits.argmax(-1)
            out.append(tokens)
        return torch.stack(out, 1).tolist()


class DecodeRunner:
    """One decode step for a batch, optionally compiled, with batch-width padding.

    Compiled code specialises on the batch width; padding each batch up to the next of a few
    fixed widths (zero state rows, token 0) bounds the number of compiled shapes. Padding turns
    on the row-exact matmuls (`LaplaceLinear`), so rows never interact, not even through BLAS
    blocking: the real rows of a padded batch are bit-identical to the unpadded batch's.
    `compile=False, widths=None` is plain eager decoding.
    """

    def __init__(
        self,
        model: LaplaceForCausalLM,
        *,
        compile: bool = False,
        widths: tuple[int, ...] | None = None,
        row_exact: bool | None = None,
        backend: str = "inductor",
    ):
        self.model = model
        self.widths = tuple(sorted(widths)) if widths else None
        self.row_exact = bool(widths) if row_exact is None else row_exact
        self.shapes_seen: set[int] = set()
        fn = self._step
        self.fn = torch.compile(fn, dynamic=False, backend=backend) if compile else fn

    def _step(self, tokens, gla, conv):
        out = self.model(tokens[:, None], LaplaceState(list(gla), list(conv)))
        return out.logits[:, 0], out.state.gla, out.state.conv

    def width_for(self, n: int) -> int:
        if not self.widths:
            return n
        for w in self.widths:
            if w >= n:
                return w
        return n  # wider than the largest bucket: run as is

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, state: LaplaceState):
        """tokens [B] -> (logits [B, V], new state of B rows)."""
        n = tokens.shape[0]
        w = self.width_for(n)
        self.shapes_seen.add(w)
        if w > n:
            tokens = torch.cat([tokens, tokens.new_zeros(w - n)])
            state = state.padded(w)
        for m in self.model.modules():
            if isinstance(m, LaplaceLinear):
                m.row_exact = self.row_exact
        logits, gla, conv = self.fn(tokens, tuple(state.gla), tuple(state.conv))
        state = LaplaceState(list(gla), list(conv))
        return logits[:n], (state.select(slice(0, n)) if w > n else state)


def load_safetensors_folder(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards listed in its index file."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise names.WeightError(f"{path}: no model.safetensors nor model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(path / f)))
    return tensors


AutoConfig.register("laplace", LaplaceConfig, exist_ok=True)
AutoModelForCausalLM.register(LaplaceConfig, LaplaceForCausalLM, exist_ok=True)
