"""The one table between JAX parameter paths and exported tensor names.

Export (`export/main.py`) and serving (`serve/modeling_laplace.py`, `serve/vllm_model.py`) both
read this table, so a rename cannot drift between them. Like `laplace_spec.config`, it imports
neither JAX nor PyTorch: a model folder loads with no JAX installed.

Each entry gives the JAX path (`/`-joined keys of the Flax `params` collection, see
docs/parameters.md), the exported tensor name (Hugging Face style, equal to the PyTorch module's
parameter name), the stored JAX shape, and the name of the layout transform between the two.
The transforms are separate named functions below; the table only names them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from laplace_spec.config import LaplaceConfig

# ---- layout transforms (numpy-compatible: they only use .T / .shape) ----------------------


def identity(x):
    """Same layout on both sides (embeddings, norm scales, conv kernel [D, W], aug_balance)."""
    return x


def kernel_to_linear(x):
    """Flax Dense kernel (in, out), `y = x @ kernel`, -> PyTorch nn.Linear.weight (out, in)."""
    return x.T


def linear_to_kernel(x):
    """Inverse of `kernel_to_linear`: nn.Linear.weight (out, in) -> Flax kernel (in, out)."""
    return x.T


# transform name -> (JAX -> exported, exported -> JAX, shape map JAX -> exported)
TRANSFORMS: dict[str, tuple[Callable, Callable, Callable[[tuple], tuple]]] = {
    "identity": (identity, identity, lambda s: tuple(s)),
    "kernel_to_linear": (kernel_to_linear, linear_to_kernel, lambda s: tuple(reversed(s))),
}


@dataclasses.dataclass(frozen=True)
class Entry:
    jax_path: str  # e.g. "layer_0/qkvg/kernel"
    name: str  # exported tensor name, e.g. "model.layers.0.mixer.qkvg_proj.weight"
    jax_shape: tuple[int, ...]  # shape as stored in the Flax params tree
    transform: str  # key of TRANSFORMS

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the exported tensor."""
        return TRANSFORMS[self.transform][2](self.jax_shape)

    def to_exported(self, x):
        return TRANSFORMS[self.transform][0](x)

    def to_jax(self, x):
        return TRANSFORMS[self.transform][1](x)


def table(cfg: LaplaceConfig) -> list[Entry]:
    """Every parameter of a Laplace model of this config, in a fixed order."""
    V, D = cfg.vocab_size, cfg.d_model
    H, dk, dv = cfg.n_heads, cfg.d_k, cfg.d_v
    W, F, n_tiers, qkvg = cfg.conv_width, cfg.ffn_dim, cfg.n_tiers, cfg.qkvg_dim
    out = [Entry("embed/embedding", "model.embed_tokens.weight", (V, D), "identity")]
    for i, mixer in enumerate(cfg.layer_mixers):
        j, t = f"layer_{i}", f"model.layers.{i}"
        if mixer == "attention" and cfg.attention_reads_embedding:  # LayerNorm_0 of x_0 (s13.5)
            out.append(Entry(f"{j}/ln_0/scale", f"{t}.ln_0.weight", (D,), "identity"))
        out += [
            Entry(f"{j}/ln_1/scale", f"{t}.ln_1.weight", (D,), "identity"),
            Entry(f"{j}/conv/kernel", f"{t}.mixer.conv_weight", (D, W), "identity"),
            Entry(f"{j}/conv/bias", f"{t}.mixer.conv_bias", (D,), "identity"),
            Entry(f"{j}/qkvg/kernel", f"{t}.mixer.qkvg_proj.weight", (D, qkvg), "kernel_to_linear"),
            Entry(f"{j}/aug_balance", f"{t}.mixer.aug_balance", (H, dk), "identity"),
            Entry(f"{j}/head_norm/scale", f"{t}.mixer.head_norm_weight", (n_tiers, dv), "identity"),
            Entry(f"{j}/out/kernel", f"{t}.mixer.out_proj.weight", (H * dv, D), "kernel_to_linear"),
        ]
        if cfg.mixer_branch_form(mixer) != "multiplier":  # w of s (1 + w) (s13.5)
            out.append(Entry(f"{j}/branch/gain", f"{t}.mixer.branch_gain", (D,), "identity"))
        out += [
            Entry(f"{j}/ln_2/scale", f"{t}.ln_2.weight", (D,), "identity"),
            Entry(f"{j}/w12/kernel", f"{t}.mlp.w12.weight", (D, 2 * F), "kernel_to_linear"),
            Entry(f"{j}/w3/kernel", f"{t}.mlp.w3.weight", (F, D), "kernel_to_linear"),
        ]
    out += [
        Entry("ln_f/scale", "model.norm.weight", (D,), "identity"),
        Entry("lm_head/kernel", "lm_head.weight", (D, V), "kernel_to_linear"),
    ]
    return out


def exported_shapes(cfg: LaplaceConfig) -> dict[str, tuple[int, ...]]:
    """Exported tensor name -> exported shape."""
    return {e.name: e.shape for e in table(cfg)}


class WeightError(ValueError):
    """A tensor is missing, unexpected or mis-shaped; the message names it."""


def mismatches(
    expected: Mapping[str, tuple[int, ...]], actual: Mapping[str, tuple[int, ...]], kind: str
) -> list[str]:
    """One message per missing, mis-shaped or unexpected `kind` ("tensor", "parameter")."""
    problems = []
    for name, shape in expected.items():
        if name not in actual:
            problems.append(f"missing {kind} {name} (expected shape {list(shape)})")
        elif tuple(actual[name]) != tuple(shape):
            problems.append(f"{kind} {name} has shape {list(actual[name])}, expected {list(shape)}")
    for name in actual:
        if name not in expected:
            problems.append(f"unexpected {kind} {name} (shape {list(actual[name])})")
    return problems


def check_tensors(cfg: LaplaceConfig, shapes: Mapping[str, tuple[int, ...]], *, side: str) -> None:
    """Every expected tensor present with its shape, and nothing else (`side` is for messages).

    `shapes` maps exported names to shapes. Raises WeightError naming every offender.
    """
    problems = mismatches(exported_shapes(cfg), shapes, "tensor")
    if problems:
        raise WeightError(f"{side}: " + "; ".join(problems))
