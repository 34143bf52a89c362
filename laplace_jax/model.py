"""The Laplace decoder (docs/design.md section 2) as a functional Flax model.

Parameters live in a plain dict (paths in docs/parameters.md); every parameter carries logical
axis names, so sharding is a rules table (`laplace_jax/sharding.py`), not model code.

    model = LaplaceLM(config)
    params = init_params(config, rng)
    logits, state = model.apply({"params": params}, tokens)              # [B, T] -> [B, T, V]
    logits, state = model.apply({"params": params}, tokens, state)       # prefill from a state
    logits, state = model.apply({"params": params}, token, state,
                                method=LaplaceLM.decode_step)           # [B] -> [B, V]

The recurrent state is a dict {"layer_{i}": {"gla": [B, H, dk, dv], "conv": [B, W, D]}} in fp32:
the GLA matrices and the last W inputs of the causal convolution (see `init_state`).

The retrieval baseline, `token_mixer="attention"` (laplace_jax/attention.py), is this model with
step 4 done by causal softmax attention: same parameters, whole sequences only (no `state`).
The hybrid, `attention_every=k`, makes the last layer of each block of k such an attention layer
(`config.layer_mixers`); it too runs whole sequences only in JAX.

Packed documents: `model.apply(..., tokens, reset=reset)` with `reset` [B, T] bool, True where a
new document starts (`reset_after_eot(tokens, eot_id)`: the token after each end-of-text). Before
such a token every layer zeroes its GLA state and its conv window, so each document of a packed
sequence gets exactly what a separate run of it from an empty state gives it (fp32 rounding).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from laplace_jax.attention import causal_attention
from laplace_jax.attention_context import attention_context_parallel
from laplace_jax.attention_ring import attention_ring_parallel
from laplace_jax.context_parallel import gla_context_parallel, window_from_previous_slice
from laplace_jax.gla import gla_chunked, gla_step
from laplace_spec.config import LaplaceConfig

f32 = jnp.float32


def _param(module, name, init, shape, axes):
    """A float32 parameter tagged with its logical axes."""
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, f32)


def _normal(std):
    return nn.initializers.normal(stddev=std)


class LayerNorm(nn.Module):
    """LayerNorm with a learned scale and no bias."""

    eps: float

    @nn.compact
    def __call__(self, x):  # x: [..., D]
        scale = _param(self, "scale", nn.initializers.ones, (x.shape[-1],), ("norm",))
        x32 = x.astype(f32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        return ((x32 - mean) * jax.lax.rsqrt(var + self.eps) * scale).astype(x.dtype)


class Dense(nn.Module):
    """y = x @ kernel, kernel stored (in, out) with logical axes; no bias."""

    features: int
    axes: tuple[str, str]
    std: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        kernel = _param(self, "kernel", _normal(self.std), (x.shape[-1], self.features), self.axes)
        return jnp.dot(x.astype(self.dtype), kernel.astype(self.dtype))


class CausalConv(nn.Module):
    """Depth-wise causal convolution + SiLU: u_t = SiLU(b + sum_j w[:, j] h_{t-W+1+j})."""

    width: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, h, window, reset=None):
        # h: [B, T, D] new inputs; window: [B, W, D] the last W inputs before them (fp32);
        # reset: [B, T] bool or None, True where a document starts: the window forgets what
        # came before that token (as if those inputs were the zeros before a sequence's start).
        D, W = h.shape[-1], self.width
        w = _param(self, "kernel", _normal(W**-0.5), (D, W), ("embed", "conv"))  # [D, W]
        b = _param(self, "bias", nn.initializers.zeros, (D,), ("norm",))  # [D]
        seq = jnp.concatenate([window.astype(h.dtype), h], axis=1)  # [B, W + T, D]
        B, T = h.shape[:2]
        if reset is None:
            taps = [seq[:, 1 + j : 1 + j + T] for j in range(W)]
            new_window = trailing_window(seq, None, W)
        else:  # segment ids of seq (the old window is segment 0); taps of other segments are 0
            seg = jnp.cumsum(reset, axis=1, dtype=jnp.int32)  # [B, T]
            seg = jnp.concatenate([jnp.zeros((B, W), jnp.int32), seg], axis=1)  # [B, W + T]
            own = seg[:, W:]  # [B, T], the segment of output t
            taps = [
                jnp.where(
                    (seg[:, 1 + j : 1 + j + T] == own)[..., None], seq[:, 1 + j : 1 + j + T], 0
                )
                for j in range(W)
            ]
            new_window = trailing_window(seq, seg, W)
        # output t (0-based among the new tokens) sees seq[t + 1 .. t + W]
        u = b.astype(self.dtype) + sum(
            w[:, j].astype(self.dtype) * taps[j] for j in range(W)
        )  # [B, T, D]
        return nn.silu(u), new_window


def trailing_window(seq, seg, width: int):
    """The conv window after `seq` [B, N, D] (N >= width): its last `width` inputs in fp32, those
    before the last document start zeroed; `seg` [B, N] their segment ids (None: one document)."""
    window = seq[:, -width:].astype(f32)
    if seg is None:
        return window
    last = (seg[:, -width:] == seg[:, -1:])[..., None]  # [B, W, 1], the last document's
    return jnp.where(last, window, 0.0)


def rms_normalized(x, eps: float):
    """x / sqrt(mean(x^2) + eps) over the last axis (no scale): RMS 1 per vector."""
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + eps)


class HeadRMSNorm(nn.Module):
    """RMS-normalise each head's output; scale by its tier's learned vector gamma_tier."""

    n_tiers: int
    heads_per_tier: int
    eps: float

    @nn.compact
    def __call__(self, o):  # o: [B, T, H, dv]
        dv = o.shape[-1]
        gamma = _param(self, "scale", nn.initializers.ones, (self.n_tiers, dv), ("tiers", "head_v"))
        o = rms_normalized(o, self.eps)
        return o * jnp.repeat(gamma, self.heads_per_tier, axis=0)  # tiers of contiguous heads


class MixerBranch(nn.Module):
    """What a layer's mixer writes into the stream (docs/design.md s13.5), y [B, T, D] -> s y,
    s (1 + w) y (LayerScale) or s (1 + w) RMSNorm(y) (post-norm), w [D] learned from 0, s the
    config's `mixer_branch_multiplier`: the fixed multiplier 1 for attention layers, by
    `gla_branch` for GLA layers. In fp32, rounded once to the stream's dtype by the caller."""

    config: LaplaceConfig
    mixer: str

    @nn.compact
    def __call__(self, y):
        cfg = self.config
        form, s = cfg.mixer_branch_form(self.mixer), cfg.mixer_branch_multiplier(self.mixer)
        if form == "multiplier":
            return y if s == 1.0 else y.astype(f32) * s  # 0.1 in a hybrid's GLA layer
        y = y.astype(f32)
        if form == "post_norm":  # RMS 1 per token, whatever W_out's size
            y = rms_normalized(y, cfg.norm_eps)
        w = _param(self, "gain", nn.initializers.zeros, (y.shape[-1],), ("norm",))  # [D]
        return y * (s * (1.0 + w))


# How an attention layer reaches the earlier slices' keys on a context axis (docs/design.md
# s13.3), and the default: the ring, which bench.plan measures smaller than the gather form at
# every length it compiles (bench/results/plan.json's `attention_context_default`)
ATTENTION_CONTEXT_FORMS = {"ring": attention_ring_parallel, "gather": attention_context_parallel}
ATTENTION_CONTEXT = "ring"


class DecoderLayer(nn.Module):
    """One Laplace layer; the numbered steps are those of docs/design.md section 2."""

    config: LaplaceConfig
    unroll: bool = False  # static unroll of the chunk scan (Neuron)
    # Inside `shard_map`: the mesh axis whose devices hold consecutive slices of each sequence
    # (laplace_jax/context_parallel.py); the layer then starts from empty states, and the GLA
    # and the conv take what came before the slice from the devices before it. None: whole
    # sequences.
    context_axis: str | None = None
    # Step 4 of this layer, "gla" or "attention" (config.layer_mixers[i] for layer i); None: the
    # config's token_mixer (every layer alike).
    mixer: str | None = None
    # An attention layer on a context axis: "ring" (laplace_jax/attention_ring.py) or "gather"
    # (laplace_jax/attention_context.py), docs/design.md s13.3
    attention_context: str = ATTENTION_CONTEXT

    @nn.compact
    def __call__(self, x, state, decode: bool = False, reset=None, decays=None, embedding=None):
        # x: [B, T, D]; state: {"gla": [B, H, dk, dv], "conv": [B, W, D]}; decode: T == 1 step;
        # reset: [B, T] bool or None, document starts (GLA state and conv window zeroed before);
        # decays: on a context axis, the step's `slice_decays` (made here when None);
        # embedding: [B, T, D] the scaled token embedding x_0, which a hybrid's attention layer
        # reads beside the stream with attention_input=stream_and_embedding (else unused)
        cfg = self.config
        mixer = self.mixer or cfg.token_mixer
        B, T, D = x.shape
        H, dk, dv, F = cfg.n_heads, cfg.d_k, cfg.d_v, cfg.ffn_dim
        dtype = jnp.dtype(cfg.compute_dtype)
        out_scale = cfg.residual_init_scale  # residual projections start small
        sliced = self.context_axis is not None and not decode

        # 1-2. h = LayerNorm_1(x); u = SiLU(causal depth-wise conv(h)); a hybrid's attention
        # layer may read h = LayerNorm_1(x) + LayerNorm_0(x_0) (`attention_input`, s13.5)
        h = LayerNorm(cfg.norm_eps, name="ln_1")(x)
        if mixer == "attention" and cfg.attention_reads_embedding:
            h = h + LayerNorm(cfg.norm_eps, name="ln_0")(embedding.astype(x.dtype))
        window = state["conv"]  # [B, W, D]
        if sliced:  # the previous slice's last W inputs (zeros before the first slice)
            seg = None if reset is None else jnp.cumsum(reset, axis=1, dtype=jnp.int32)
            window = window_from_previous_slice(
                trailing_window(h, seg, cfg.conv_width), self.context_axis
            )
        u, conv_window = CausalConv(cfg.conv_width, dtype, name="conv")(h, window, reset)

        # 3. [q, k, v, g] = u W_qkvg^T
        qkvg = Dense(cfg.qkvg_dim, ("embed", "qkvg"), D**-0.5, dtype, name="qkvg")(u)
        q, k, v, g = jnp.split(qkvg, np.cumsum(cfg.qkvg_split[:-1]), axis=-1)
        q = q.reshape(B, T, H, dk)
        k = k.reshape(B, T, H, dk)
        v = v.reshape(B, T, H, dv)  # g stays [B, T, H * dv]

        # 4. GLA with the fixed decay schedule (not a parameter); or, for the retrieval baseline
        # (token_mixer="attention") and a hybrid's attention layers, causal softmax attention over
        # the same q, k, v (under context parallelism over this and the earlier slices' keys)
        log_decay = jnp.asarray(cfg.log_decay(), f32)  # [H]
        if mixer == "attention":
            if decode:
                raise ValueError(
                    "an attention layer (token_mixer='attention' or a hybrid's) has no recurrent "
                    "state to decode from: the JAX model runs it on full sequences only"
                )
            if sliced:
                across = ATTENTION_CONTEXT_FORMS[self.attention_context]
                o = across(q, k, v, reset, self.context_axis, cfg.qk_scale)  # [B, T, H, dv]
            else:
                o = causal_attention(q, k, v, reset, cfg.qk_scale)  # [B, T, H, dv]
            gla_state = state["gla"]  # keeps no state
        elif decode:  # the O(1) recurrent step
            r = None if reset is None else reset[:, 0]
            o, gla_state = gla_step(
                q[:, 0], k[:, 0], v[:, 0], log_decay, state["gla"], scale=cfg.qk_scale, reset=r
            )
            o = o[:, None]  # [B, 1, H, dv]
        elif sliced:  # this slice, corrected by the state the slices before it leave
            o, gla_state = gla_context_parallel(
                q,
                k,
                v,
                log_decay,
                axis=self.context_axis,
                chunk_size=cfg.chunk_size,
                scale=cfg.qk_scale,
                unroll=self.unroll,
                reset=reset,
                decays=decays,
            )  # [B, T, H, dv]
        else:
            o, gla_state = gla_chunked(
                q,
                k,
                v,
                log_decay,
                chunk_size=cfg.chunk_size,
                scale=cfg.qk_scale,
                initial_state=state["gla"],
                unroll=self.unroll,
                reset=reset,
            )  # [B, T, H, dv]

        # 5. self-augmentation: o_t += sigmoid(sum_i q_i a_i k_i) v_t (a = 0: half-strength skip)
        a = _param(self, "aug_balance", nn.initializers.zeros, (H, dk), ("heads", "head_k"))
        aug = jax.nn.sigmoid(jnp.sum(q.astype(f32) * a * k.astype(f32), -1, keepdims=True))
        o = o.astype(f32) + aug * v.astype(f32)  # [B, T, H, dv]

        # 6. head RMSNorm per tier; 7. gate with SiLU(g), project back, residual
        o = HeadRMSNorm(cfg.n_tiers, cfg.heads_per_tier, cfg.norm_eps, name="head_norm")(o)
        y = o.reshape(B, T, H * dv).astype(dtype) * nn.silu(g)
        out_init = (H * dv) ** -0.5 * cfg.mixer_out_init_scale(mixer)  # s13.5: 1 under a post-norm
        y = Dense(D, ("attn", "embed"), out_init, dtype, name="out")(y)
        x = x + MixerBranch(cfg, mixer, name="branch")(y).astype(x.dtype)

        # 8. channel mixer: x += W_3 (SiLU(W_1 h2) * (W_2 h2)), W_1 and W_2 fused as W_12
        h2 = LayerNorm(cfg.norm_eps, name="ln_2")(x)
        gate, up = jnp.split(Dense(2 * F, ("embed", "mlp"), D**-0.5, dtype, name="w12")(h2), 2, -1)
        y = Dense(D, ("mlp", "embed"), F**-0.5 * out_scale, dtype, name="w3")(nn.silu(gate) * up)
        x = x + y.astype(x.dtype)
        return x, {"gla": gla_state, "conv": conv_window}


class LaplaceLM(nn.Module):
    """Embedding -> n_layers decoder layers -> LayerNorm_f -> untied LM head."""

    config: LaplaceConfig
    unroll: bool = False
    # how the attention layers reach across a context axis (laplace_jax/fsdp.py's scan builds
    # those layers; this model's own run whole sequences)
    attention_context: str = ATTENTION_CONTEXT

    def setup(self):
        cfg = self.config
        self.embed = nn.Embed(
            cfg.vocab_size,
            cfg.d_model,
            param_dtype=f32,
            embedding_init=nn.with_logical_partitioning(_normal(cfg.init_std), ("vocab", "embed")),
        )
        self.layers = [
            DecoderLayer(cfg, self.unroll, mixer=mixer, name=f"layer_{i}")
            for i, mixer in enumerate(cfg.layer_mixers)
        ]
        self.ln_f = LayerNorm(cfg.norm_eps)
        self.lm_head = Dense(
            cfg.vocab_size, ("embed", "vocab"), cfg.init_std, jnp.dtype(cfg.compute_dtype)
        )

    def _run(self, tokens, state, decode, reset=None, layers=None):
        x, new_state = self._decoder(tokens, state, decode, reset, layers)
        return self.logits(x), new_state

    def _decoder(self, tokens, state, decode, reset=None, layers=None):
        """tokens [B, T] -> (x [B, T, D] after the decoder layers, the new state or None)."""
        cfg = self.config
        if "attention" in cfg.layer_mixers and state is not None:
            raise ValueError(
                "attention layers (token_mixer='attention' or attention_every) keep no recurrent "
                "state: call the model on whole sequences, without `state`"
            )
        x = self.embed(tokens) * cfg.embed_multiplier  # [B, T, D], m E[token]: m = sqrt(D) in a
        # hybrid, 1 otherwise (docs/design.md s2.2, s13.5)
        x = x.astype(jnp.dtype(cfg.compute_dtype))
        if layers is not None:  # the decoder layers run by the caller (FSDP: gathered weights;
            x, new_state = layers(x, reset), None  # x_0 is the x it is given)
        else:
            state = init_state(cfg, tokens.shape[0]) if state is None else state
            new_state = {}
            kw = {} if reset is None else {"reset": reset}
            if cfg.attention_reads_embedding:
                kw["embedding"] = x  # x_0, beside the stream (s13.5)
            for i, layer in enumerate(self.layers):
                x, new_state[f"layer_{i}"] = layer(x, state[f"layer_{i}"], decode, **kw)
        return x, new_state

    def logits(self, x):
        """The final norm and head: x [..., D] -> logits [..., V] fp32."""
        return self.lm_head(self.ln_f(x)).astype(f32)

    def hidden(self, tokens, reset=None, layers=None):
        """What `__call__` feeds the head: tokens [B, T] -> x [B, T, D] (`logits(x)` are its
        logits). The loss applies the head a block of tokens at a time (laplace_jax/loss.py)."""
        return self._decoder(tokens, None, False, reset, layers)[0]

    def __call__(self, tokens, state=None, reset=None, layers=None):
        """Full sequence or prefill from `state`. tokens: [B, T] -> ([B, T, V], state).

        reset: [B, T] bool or None, True where a packed document starts (`reset_after_eot`);
        a reset at position 0 discards `state`.

        layers: None, or f(x [B, T, D], reset) -> x, which then runs the decoder layers in place
        of this module's own (from empty states; the returned state is None). laplace_jax/fsdp.py
        passes a `lax.scan` of `DecoderLayer` over weights it gathers layer by layer, so the
        embedding, final norm and head here are the only top-level forward there is; its params
        then hold just `embed`, `ln_f` and `lm_head`."""
        return self._run(tokens, state, decode=False, reset=reset, layers=layers)

    def decode_step(self, tokens, state):
        """One token per sequence. tokens: [B] -> (logits [B, V], state)."""
        logits, state = self._run(tokens[:, None], state, decode=True)
        return logits[:, 0], state


def reset_after_eot(tokens, eot_id: int):
    """Document starts of packed token sequences: tokens [B, T] -> reset [B, T] bool, True at
    every token that follows the end-of-text token `eot_id` (that token starts a new document;
    the EOT itself ends the previous one). Position 0 is False: what precedes it is unknown."""
    after = tokens[:, :-1] == eot_id  # [B, T - 1]
    return jnp.concatenate([jnp.zeros_like(after[:, :1]), after], axis=1)


# ---- parameters and state ----------------------------------------------------------------


def init_state(config: LaplaceConfig, batch_size: int) -> dict:
    """The empty recurrent state of `batch_size` sequences (zeros, fp32)."""
    return {
        f"layer_{i}": {
            "gla": jnp.zeros((batch_size, *config.gla_state_shape), f32),  # [B, H, dk, dv]
            "conv": jnp.zeros((batch_size, *config.conv_state_shape), f32),  # [B, W, D]
        }
        for i in range(config.n_layers)
    }


def _boxed_init(config: LaplaceConfig, rng):
    tokens = jnp.zeros((1, config.chunk_size), jnp.int32)
    return LaplaceLM(config).init(rng, tokens)["params"]


def init_params(config: LaplaceConfig, rng) -> dict:
    """Freshly initialised parameters, a plain dict of fp32 arrays (paths: docs/parameters.md)."""
    return nn.unbox(_boxed_init(config, rng))


def abstract_params(config: LaplaceConfig) -> dict:
    """Parameter shapes and dtypes (`jax.ShapeDtypeStruct`) without allocating anything."""
    return nn.unbox(jax.eval_shape(functools.partial(_boxed_init, config), jax.random.key(0)))


def param_logical_axes(config: LaplaceConfig) -> dict:
    """The logical axis names of every parameter: a dict of tuples shaped like the params."""
    boxed = jax.eval_shape(functools.partial(_boxed_init, config), jax.random.key(0))
    return jax.tree.map(
        lambda b: tuple(b.names), boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
    )
