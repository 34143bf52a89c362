"""The model configuration and everything derived from it: the one source of truth.

The fields are those of docs/design.md section 2. `LaplaceConfig` describes the model only;
optimizer and training settings live with the optimizer and the trainer, so that an exported
`config.json` carries exactly what is needed to rebuild the network.

Derived quantities (projection widths, the decay schedule, the tier layout, state shapes and
bytes) are written here once and read by the Flax model, the accounting, the exporter, the
Hugging Face config, the PyTorch module and the vLLM model. This module imports neither JAX nor
PyTorch (nor numpy): any side can use it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16")
TOKEN_MIXERS = ("gla", "attention")
# What the token embedding's output is multiplied by (docs/design.md s2.2, s13.5): sqrt(D)
# ("sqrt_d_model", as Gemma does) or 1 ("one"); "auto" is sqrt(D) for a hybrid, 1 otherwise.
EMBED_SCALES = ("auto", "sqrt_d_model", "one")
# How a GLA layer's mixer branch y = W_out(...) enters the residual stream (docs/design.md s13.5),
# with s its `gla_branch_scale`: "multiplier" x += s y (fixed); "layer_scale" x += s (1 + w) y
# (w [D] learned, from 0); "post_norm" x += s (1 + w) RMSNorm(y), s relative to the embedding's
# RMS at initialisation. "auto" is "multiplier" (today's hybrids and pure Laplace).
GLA_BRANCHES = ("auto", "multiplier", "layer_scale", "post_norm")
# `gla_branch_scale="auto"` per form: the multiplier 0.1 in a hybrid (s13.5's first study) and 1
# otherwise; LayerScale started at 0.1 (CaiT's); the post-norm at the embedding's own size
HYBRID_GLA_BRANCH_SCALE = 0.1
AUTO_BRANCH_SCALES = {"layer_scale": 0.1, "post_norm": 1.0}
# What a hybrid's attention layer reads (s13.5): "stream", LayerNorm_1(x), as every layer; or
# "stream_and_embedding", LayerNorm_1(x) + LayerNorm_0(x_0) with x_0 the scaled token embedding
# (Zamba2's concatenated embedding, written as the sum of the two normalised halves)
ATTENTION_INPUTS = ("stream", "stream_and_embedding")
FP32_BYTES = 4
BF16_BYTES = 2
# The serving limit an export declares by default (config.json's max_position_embeddings): the
# state is fixed-size, so any length is servable; this is only the number vLLM schedules against.
DEFAULT_SERVE_LENGTH = 65_536
# A layer's step 4 ("gla" or "attention") -> its kind as hybrid models' configs name it.
LAYER_TYPES = {"gla": "linear_attention", "attention": "full_attention"}


class ConfigError(ValueError):
    """A configuration is malformed; the message names the offending field."""


def setting(default: Any, meaning: str) -> Any:
    """A config field with its default and its meaning, which `python -m train.main --help`
    lists (`settings_help`)."""
    return dataclasses.field(default=default, metadata={"meaning": meaning})


@dataclasses.dataclass(frozen=True)
class LaplaceConfig:
    vocab_size: int = setting(
        50_304, "token ids, a multiple of 64 (the default: GPT-2's 50,257 padded, matmul-friendly)"
    )
    d_model: int = setting(3_072, "D, the residual stream width; must equal n_heads * d_v")
    n_layers: int = setting(24, "L decoder layers")
    n_heads: int = setting(16, "H GLA heads")
    d_k: int = setting(96, "query/key width per head (half of d_v in Laplace)")
    d_v: int = setting(192, "value and gate width per head")
    conv_width: int = setting(4, "depth-wise causal convolution width")
    ffn_dim: int = setting(8_192, "F, inner width of the GLU channel mixer")
    t_min: float = setting(1.0, "shortest decay half-life in tokens (head 0: lambda = 0.5)")
    t_max: float = setting(2_048.0, "longest decay half-life in tokens (last head)")
    n_tiers: int = setting(4, "contiguous groups of heads sharing one head-RMSNorm scale")
    seq_len: int = setting(2_048, "training context length")
    chunk_size: int = setting(128, "GLA chunk length: 16 chunks at seq_len 2,048")
    norm_eps: float = setting(1e-5, "epsilon of the LayerNorms and of the head RMSNorm")
    init_std: float = setting(0.02, "std of the embedding and LM head at initialisation")
    compute_dtype: str = setting("float32", "activations/matmuls; parameters are always fp32")
    # Step 4's token mixer: "gla" (Laplace) or "attention", causal softmax attention over the same
    # q, k, v with the rest of the layer unchanged (the retrieval baseline, docs/design.md s9;
    # trains and evaluates full sequences, has no recurrent state and is not exported or served).
    token_mixer: str = setting(
        "gla",
        "step 4's token mixer: gla (Laplace) or attention (the softmax baseline)",
    )
    # The hybrid (docs/design.md s13): with attention_every = k >= 2 the last layer of every block
    # of k layers does step 4 with causal softmax attention (the `token_mixer="attention"` layer:
    # the same parameters, no positional encoding) and the other k - 1 are Laplace's. 0: every
    # layer is Laplace's (the default and the 3B recipe).
    attention_every: int = setting(
        0,
        "a hybrid: every k-th layer is softmax attention (k >= 2); 0 = pure Laplace",
    )
    # The embedding's output multiplier: "sqrt_d_model" scales it by sqrt(D), so the token's own
    # identity reaches the layers at the size of the residual branches (docs/design.md s13.5:
    # without it a hybrid's attention layer never learns a lookup); "one" leaves it; "auto" is
    # sqrt(D) for a hybrid (attention_every > 0) and 1 for pure Laplace and the attention
    # baseline, where the study found no gain from it (so the 3B recipe stays as published).
    embed_scale: str = setting(
        "auto",
        "the embedding's output multiplier: sqrt_d_model, one, or auto (sqrt(D) in a hybrid)",
    )
    # The size s of every GLA layer's mixer branch, read by its form (`gla_branch`): with the
    # fixed multiplier x += s y (not an initial scale: it holds through training), "auto" is 0.1
    # in a hybrid, so the GLA layers' outputs stay small beside the token identity the attention
    # layers match on (docs/design.md s13.5: without it the 3:1 hybrid's attention layer never
    # learns a lookup), and 1 for pure Laplace (the 3B recipe as published); a positive number,
    # e.g. "1" for a hybrid as before it. With LayerScale s is the learned scale's start (auto
    # 0.1), with the post-norm the branch's size at the start over the embedding's (auto 1).
    # The attention layers' branches are never scaled.
    gla_branch_scale: str = setting(
        "auto",
        "size s of each GLA layer's mixer branch (its meaning per gla_branch): a number, or auto",
    )
    # The form of that branch (GLA_BRANCHES above): the fixed multiplier s (`gla_branch_scale`),
    # a learned per-channel scale s (1 + w), or a post-norm RMSNorm(y) s (1 + w) whose output's
    # size is bounded by its gain, not by W_out (docs/design.md s13.5's second study)
    gla_branch: str = setting(
        "auto",
        "form of each GLA layer's mixer branch: multiplier, layer_scale, post_norm, or auto",
    )
    # A hybrid's attention layers read the token embedding beside the stream (ATTENTION_INPUTS)
    attention_input: str = setting(
        "stream",
        "what a hybrid's attention layers read: stream, or stream_and_embedding",
    )

    def __post_init__(self):
        validate(self)

    # ---- derived sizes (docs/design.md section 2) ------------------------------------------------
    @property
    def qkvg_split(self) -> tuple[int, int, int, int]:
        """Widths of q, k, v, g in the fused projection: H d_k, H d_k, H d_v, H d_v."""
        H = self.n_heads
        return H * self.d_k, H * self.d_k, H * self.d_v, H * self.d_v

    @property
    def qkvg_dim(self) -> int:
        """Output width of the fused W_qkvg: H (2 d_k + 2 d_v) (9,216 for 3B)."""
        return sum(self.qkvg_split)

    @property
    def embed_multiplier(self) -> float:
        """The token embedding's output is multiplied by this (`embed_scale`): sqrt(D), or 1."""
        scale = self.embed_scale
        if scale == "auto":
            scale = "sqrt_d_model" if self.attention_every else "one"
        return math.sqrt(self.d_model) if scale == "sqrt_d_model" else 1.0

    def mixer_branch_form(self, mixer: str) -> str:
        """How a layer's mixer branch enters the stream: `gla_branch` for a GLA layer ("auto":
        "multiplier"), "multiplier" (by 1) for an attention layer."""
        if mixer == "attention" or self.gla_branch == "auto":
            return "multiplier"
        return self.gla_branch

    def mixer_branch_multiplier(self, mixer: str) -> float:
        """The constant s a layer's mixer branch is multiplied by (x += s y, s (1 + w) y, or
        s (1 + w) RMSNorm(y), by `mixer_branch_form`): 1 for an attention layer; for a GLA layer
        `gla_branch_scale` ("auto": 0.1 in a hybrid and 1 otherwise for the multiplier, 0.1 for
        LayerScale), and for the post-norm that number times the embedding's RMS at
        initialisation, init_std times its multiplier (1: the branch starts at the token's size)."""
        if mixer == "attention":
            return 1.0
        form = self.mixer_branch_form(mixer)
        if self.gla_branch_scale != "auto":
            s = float(self.gla_branch_scale)
        elif form == "multiplier":
            s = HYBRID_GLA_BRANCH_SCALE if self.attention_every else 1.0
        else:
            s = AUTO_BRANCH_SCALES[form]
        return s * self.init_std * self.embed_multiplier if form == "post_norm" else s

    @property
    def attention_reads_embedding(self) -> bool:
        """A hybrid's attention layers read LayerNorm_1(x) + LayerNorm_0(x_0) (attention_input)."""
        return self.attention_input == "stream_and_embedding"

    @property
    def residual_init_scale(self) -> float:
        """W_out's and W_3's initial std is their fan-in's ** -0.5 times this, 1 / sqrt(2 L): the
        residual branches start small (docs/design.md s2.2)."""
        return 1.0 / math.sqrt(2 * self.n_layers)

    def mixer_out_init_scale(self, mixer: str) -> float:
        """A layer's W_out starts at its fan-in's ** -0.5 times this: `residual_init_scale`, but 1
        under a post-norm (docs/design.md s13.5), where the norm sets the branch's size and a
        small W_out would only make its direction turn faster under Muon's fixed-size steps."""
        if self.mixer_branch_form(mixer) == "post_norm":
            return 1.0
        return self.residual_init_scale

    @property
    def qk_scale(self) -> float:
        """The query scale of the token mixer, d_k ** -0.5 (GLA and attention, every framework)."""
        return self.d_k**-0.5

    @property
    def heads_per_tier(self) -> int:
        """Tiers are contiguous groups of heads: head h uses scale gamma_{h // heads_per_tier}."""
        return self.n_heads // self.n_tiers

    @property
    def layer_mixers(self) -> tuple[str, ...]:
        """Each layer's step 4, "gla" or "attention": layer i is an attention layer when
        attention_every = k and (i + 1) % k == 0 (the last of each block of k)."""
        k = self.attention_every
        if k:
            return tuple("attention" if (i + 1) % k == 0 else "gla" for i in range(self.n_layers))
        return (self.token_mixer,) * self.n_layers

    @property
    def layer_types(self) -> list[str]:
        """Each layer's kind in the names hybrid models' Hugging Face configs use (config.json's
        `layer_types`): "linear_attention" for a GLA layer, "full_attention" for attention."""
        return [LAYER_TYPES[m] for m in self.layer_mixers]

    @property
    def block_size(self) -> int:
        """Layers per repeating block: attention_every for a hybrid, else 1 (every layer alike).
        The FSDP layer scan runs over n_layers / block_size blocks of this many layers."""
        return self.attention_every or 1

    @property
    def n_gla_layers(self) -> int:
        """The layers that keep a GLA state (the others keep a KV cache)."""
        return self.layer_mixers.count("gla")

    @property
    def n_attention_layers(self) -> int:
        return self.layer_mixers.count("attention")

    @property
    def n_kv_layers(self) -> int:
        """The layers that keep a KV cache instead of a GLA state: a hybrid's attention layers
        (0 for the attention baseline, which is not served and is counted as if it kept one)."""
        return self.n_attention_layers if self.attention_every else 0

    @property
    def n_chunks(self) -> int:
        return self.seq_len // self.chunk_size

    def log_decay(self) -> tuple[float, ...]:
        """gamma_h = ln(lambda_h) = -ln 2 / T_h, T_h = T_min (T_max / T_min) ** (h / (H - 1)).

        In float64 (Python floats); each framework rounds it to fp32 once. Head 0 has
        lambda = 2 ** (-1 / T_min), the last head 2 ** (-1 / T_max).
        """
        H = self.n_heads
        ratio = self.t_max / self.t_min
        return tuple(-math.log(2.0) / (self.t_min * ratio ** (h / max(H - 1, 1))) for h in range(H))

    # ---- the recurrent state of one sequence (fp32) ----------------------------------------
    @property
    def gla_state_shape(self) -> tuple[int, int, int]:
        """One layer's GLA matrices S: [H, d_k, d_v]."""
        return self.n_heads, self.d_k, self.d_v

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """One layer's conv window: the last W LayerNorm_1 outputs, [W, D]."""
        return self.conv_width, self.d_model

    def state_bytes_per_sequence(self, conv_window: int | None = None) -> dict[str, int]:
        """fp32 state bytes of one sequence: {"gla", "conv", "total"}, all layers: the GLA
        matrices of every layer that keeps one (all but a hybrid's attention layers; every layer
        of the attention baseline counted as if it did) and every layer's conv window (attention
        layers convolve too).

        With the model's `conv_width`-wide window, 29,491,200 for 3B (the write-up's 29.5 MB);
        a decoder keeping only the `conv_width - 1` past inputs would need 29,196,288.
        """
        W = self.conv_width if conv_window is None else conv_window
        gla = (self.n_layers - self.n_kv_layers) * math.prod(self.gla_state_shape) * FP32_BYTES
        conv = self.n_layers * W * self.d_model * FP32_BYTES
        return {"gla": gla, "conv": conv, "total": gla + conv}

    @property
    def page_conv_window(self) -> int:
        """The past conv inputs a served sequence keeps per layer: W - 1 (vLLM's state pages,
        laid out as its Mamba2's: the output at t reads inputs t - W + 1 .. t, and t is new)."""
        return self.conv_width - 1

    def page_bytes_per_sequence(self) -> int:
        """One served sequence's state pages, all layers (vLLM): the fp32 state with the W - 1
        window, 29,196,288 for 3B."""
        return self.state_bytes_per_sequence(conv_window=self.page_conv_window)["total"]

    def kv_cache_bytes(self, n_tokens: int) -> int:
        """bf16 K and V of a softmax transformer of the same width and depth at n_tokens."""
        return 2 * self.n_layers * self.d_model * BF16_BYTES * n_tokens

    def hybrid_kv_bytes(self, n_tokens: int, dtype_bytes: int = BF16_BYTES) -> int:
        """The KV cache of this model's own attention layers at n_tokens (0 without any): per
        token and attention layer its keys H d_k and values H d_v."""
        per_token = self.n_heads * (self.d_k + self.d_v) * dtype_bytes
        return self.n_kv_layers * per_token * n_tokens

    @property
    def kv_page_head_size(self) -> int:
        """An attention layer's head size on vLLM's paged KV cache: max(d_k, d_v) rounded up to
        a multiple of 32, one size for keys and values (vLLM's CPU attention backend takes one
        head size, from 32 up, and takes every multiple of 32 to 256). Keys and
        values are zero-padded to it, which changes no dot product and no output column:
        192 for 3B (keys 96 -> 192), 32 for tiny (keys 8, values 16)."""
        return -(-max(self.d_k, self.d_v) // 32) * 32

    @property
    def architecture(self) -> str:
        """config.json's architecture, the model class vLLM serves it with: a hybrid is its own
        architecture there (vLLM reads "attention-free" and "hybrid" from the class)."""
        return "LaplaceHybridForCausalLM" if self.attention_every else "LaplaceForCausalLM"

    # ---- serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LaplaceConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
        return cls(**{k: _coerce(k, v) for k, v in d.items()})

    @classmethod
    def from_saved(cls, d: dict[str, Any]) -> LaplaceConfig:
        """A config a checkpoint or an export recorded: the fields it lacks were added after it
        was written, and take the value that rebuilds the model it was (`saved_before`). Partial
        configs a user writes go through `from_dict` (today's defaults)."""
        return cls.from_dict({**saved_before(d), **d}) if isinstance(d, dict) else cls.from_dict(d)

    @classmethod
    def from_json(cls, text: str) -> LaplaceConfig:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise ConfigError("config JSON must be an object of field: value")
        return cls.from_dict(d)

    def replace(self, **changes) -> LaplaceConfig:
        return self.from_dict({**self.to_dict(), **changes})

    def with_overrides(self, overrides: list[str]) -> LaplaceConfig:
        """Apply `key=value` strings; unknown keys and values of the wrong type are errors."""
        return self.replace(**parse_overrides(overrides, type(self)))


# ---- validation and parsing ------------------------------------------------------------------


def validate(cfg: LaplaceConfig) -> None:
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        expected = _FIELD_TYPES[f.name]
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            continue
        if not isinstance(value, expected) or isinstance(value, bool):
            raise ConfigError(f"{f.name} must be {expected.__name__}, got {value!r}")
        if f.name == "attention_every":  # 0 switches the hybrid off
            if value < 0:
                raise ConfigError(f"attention_every must be 0 (no hybrid) or >= 2, got {value}")
            continue
        if expected in (int, float) and not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{f.name} must be positive, got {value!r}")
    if cfg.d_model != cfg.n_heads * cfg.d_v:
        raise ConfigError(
            f"d_model ({cfg.d_model}) must equal n_heads * d_v ({cfg.n_heads} * {cfg.d_v})"
        )
    if cfg.n_heads % cfg.n_tiers:
        raise ConfigError(f"n_heads ({cfg.n_heads}) must be divisible by n_tiers ({cfg.n_tiers})")
    if cfg.vocab_size % 64:
        raise ConfigError(f"vocab_size ({cfg.vocab_size}) must be a multiple of 64")
    if cfg.seq_len % cfg.chunk_size:
        raise ConfigError(f"chunk_size ({cfg.chunk_size}) must divide seq_len ({cfg.seq_len})")
    if cfg.t_min > cfg.t_max:
        raise ConfigError(f"t_min ({cfg.t_min}) must not exceed t_max ({cfg.t_max})")
    if cfg.compute_dtype not in DTYPES:
        raise ConfigError(f"compute_dtype must be one of {DTYPES}, got {cfg.compute_dtype!r}")
    if cfg.embed_scale not in EMBED_SCALES:
        raise ConfigError(f"embed_scale must be one of {EMBED_SCALES}, got {cfg.embed_scale!r}")
    if cfg.gla_branch_scale != "auto" and not _positive_number(cfg.gla_branch_scale):
        raise ConfigError(
            f"gla_branch_scale must be 'auto' or a positive number, got {cfg.gla_branch_scale!r}"
        )
    if cfg.gla_branch not in GLA_BRANCHES:
        raise ConfigError(f"gla_branch must be one of {GLA_BRANCHES}, got {cfg.gla_branch!r}")
    if cfg.attention_input not in ATTENTION_INPUTS:
        raise ConfigError(
            f"attention_input must be one of {ATTENTION_INPUTS}, got {cfg.attention_input!r}"
        )
    if cfg.attention_reads_embedding and not cfg.attention_every:
        raise ConfigError(
            "attention_input=stream_and_embedding is for a hybrid's attention layers: it needs "
            "attention_every >= 2"
        )
    if cfg.token_mixer not in TOKEN_MIXERS:
        raise ConfigError(f"token_mixer must be one of {TOKEN_MIXERS}, got {cfg.token_mixer!r}")
    k = cfg.attention_every
    if k:
        if k == 1:
            raise ConfigError(
                "attention_every=1 would make every layer attention: that is token_mixer=attention"
            )
        if cfg.token_mixer != "gla":
            raise ConfigError(
                f"attention_every={k} mixes attention layers among GLA ones: it needs "
                f"token_mixer=gla, got token_mixer={cfg.token_mixer!r}"
            )
        if cfg.n_layers % k:
            raise ConfigError(
                f"attention_every={k} must divide n_layers ({cfg.n_layers}): the layers repeat "
                f"in blocks of {k}"
            )


def _positive_number(text: str) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    return math.isfinite(value) and value > 0


def saved_before(saved: dict[str, Any]) -> dict[str, Any]:
    """The fields added since configs were first saved, each with the value that rebuilds the
    model a saved config lacking it was trained as: today's default where that is the same
    model, so such a checkpoint resumes under today's defaults whenever it can
    (`LaplaceConfig.from_saved`, train/checkpoint.py's resume check). `embed_scale`: a hybrid
    saved before it had an unscaled embedding ("one"); `gla_branch_scale`: a hybrid saved before
    it had its GLA branches unscaled ("1"); for any other model "auto" is 1 for both.
    `gla_branch` and `attention_input` were added as options with today's forms their defaults."""
    hybrid = bool(saved.get("attention_every"))
    return {
        "embed_scale": "one" if hybrid else "auto",
        "gla_branch_scale": "1" if hybrid else "auto",
        "gla_branch": "auto",
        "attention_input": "stream",
    }


_FIELD_TYPES = {
    f.name: {"int": int, "float": float, "str": str}[f.type]
    for f in dataclasses.fields(LaplaceConfig)
}


def _coerce(name: str, value: Any) -> Any:
    """JSON gives 2048.0 or 2048 for floats alike; accept ints for float fields only, and a
    number for `gla_branch_scale` (a string field: "auto" or a number)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if _FIELD_TYPES[name] is float and isinstance(value, int) and number:
        return float(value)
    if name == "gla_branch_scale" and number:
        return str(value)
    return value


def parse_overrides(overrides: list[str], cls: type = LaplaceConfig) -> dict[str, Any]:
    """`["d_model=512", "compute_dtype=bfloat16"]` -> typed dict; rejects unknown keys."""
    types = {
        f.name: {"int": int, "float": float, "str": str, "bool": bool}.get(f.type, str)
        for f in dataclasses.fields(cls)
    }
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("-")
        if not sep:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        if key not in types:
            raise ConfigError(f"unknown config key {key!r} (known: {', '.join(sorted(types))})")
        out[key] = parse_value(key, raw.strip(), types[key])
    return out


def parse_value(key: str, raw: str, typ: type) -> Any:
    try:
        if typ is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return raw.lower() in ("true", "1")
        if typ is int:
            return int(raw.replace("_", ""))
        if typ is float:
            return float(raw.replace("_", ""))
        return raw
    except ValueError:
        raise ConfigError(f"{key} expects {typ.__name__}, got {raw!r}") from None


# ---- presets --------------------------------------------------------------------------------

PRESETS: dict[str, LaplaceConfig] = {
    # Laplace 3B exactly as in docs/design.md section 2, computing in bf16 (fp32 master weights; the
    # dataclass default, fp32, stays available as compute_dtype=float32).
    "laplace-3b": LaplaceConfig(compute_dtype="bfloat16"),
    # ~13M parameters, same structure: trains visibly on a 2-core CPU in minutes.
    "small": LaplaceConfig(
        vocab_size=8_192,
        d_model=384,
        n_layers=4,
        n_heads=6,
        d_k=32,
        d_v=64,
        ffn_dim=1_024,
        t_max=512.0,
        n_tiers=3,
        seq_len=512,
        chunk_size=64,
    ),
    # For unit tests: compiles in seconds. 320 tokens: a byte-level BPE (256 bytes, end-of-text
    # and merges) fits, so `--config tiny` also trains on the default corpus.
    "tiny": LaplaceConfig(
        vocab_size=320,
        d_model=64,
        n_layers=2,
        n_heads=4,
        d_k=8,
        d_v=16,
        ffn_dim=128,
        t_max=64.0,
        n_tiers=2,
        seq_len=64,
        chunk_size=16,
    ),
}


def get_config(name_or_path: str, overrides: list[str] | None = None) -> LaplaceConfig:
    """A preset name or a JSON file, then `key=value` overrides."""
    if name_or_path in PRESETS:
        cfg = PRESETS[name_or_path]
    elif name_or_path.endswith(".json") or Path(name_or_path).is_file():
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            cfg = LaplaceConfig.from_json(path.read_text())
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e
    else:
        raise ConfigError(
            f"unknown config {name_or_path!r}: not a preset ({', '.join(PRESETS)}) nor a JSON file"
        )
    return cfg.with_overrides(overrides or [])
