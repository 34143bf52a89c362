"""The Laplace optimizer: Muon for the 2-D weight matrices, AdamW for the rest, one schedule.

Which parameter goes where, and which decays, is the table of laplace_spec/param_groups.py (Muon:
the `qkvg`, `out`, `w12` and `w3` kernels of every layer, 96 for 3B), never `ndim`: the embedding
and the LM head are 2-D but go to AdamW. Both share `learning_rate_schedule` (linear warmup, then
cosine to `min_lr_ratio`); AdamW runs at `adamw_lr_ratio` times Muon's rate.

    tx = make_optimizer(OPTIMIZER_PRESETS["tiny"], params, mesh)
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)

With the default `shape_factor="adamw_rms"` Muon's update has AdamW's RMS (about 0.2), so one
learning rate and one weight decay mean the same for both halves (`adamw_lr_ratio = 1`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from laplace_jax import muon as muon_lib
from laplace_jax.newton_schulz import NS_DTYPES
from laplace_jax.sharding import FSDP, param_axes, replicated
from laplace_spec.config import setting
from laplace_spec.param_groups import is_muon_path, param_group


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    lr: float = setting(6e-4, "peak learning rate of Muon (update RMS ~0.2 with adamw_rms)")
    adamw_lr_ratio: float = setting(1.0, "AdamW's rate = ratio * Muon's, at every step")
    warmup_steps: int = setting(3_815, "linear warmup steps (the write-up's 3,815)")
    total_steps: int = setting(
        190_735,
        "steps the schedule spans (100B tokens at 524,288 a step); fitted to the run unless set",
    )
    min_lr_ratio: float = setting(0.1, "cosine ends at min_lr_ratio * lr")
    weight_decay: float = setting(
        0.1,
        "decoupled (times the rate): Muon matrices and AdamW kernels",
    )
    adam_b1: float = setting(0.9, "AdamW's first-moment decay")
    adam_b2: float = setting(0.95, "AdamW's second-moment decay")
    adam_eps: float = setting(1e-8, "AdamW's epsilon")
    muon_momentum: float = setting(0.95, "Muon's momentum mu (docs/design.md s4)")
    nesterov: bool = setting(True, "Nesterov momentum: G' = G + mu M")
    ns_steps: int = setting(5, "quintic Newton-Schulz iterations")
    ns_dtype: str = setting("bfloat16", "Newton-Schulz operands, and what the collectives carry")
    shape_factor: str = setting(
        "adamw_rms",
        "Muon's update scale: adamw_rms (AdamW's RMS) or max_ratio (max(1, rows/cols) ** 0.5)",
    )
    muon_mode: str = setting(
        "a2a",
        "how Muon orthogonalises sharded matrices: single, gather or a2a (docs/design.md s4)",
    )

    def __post_init__(self):
        for name in ("lr", "adam_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not 0 < self.adamw_lr_ratio:
            raise ValueError(f"adamw_lr_ratio must be positive, got {self.adamw_lr_ratio!r}")
        if not 0 <= self.warmup_steps <= self.total_steps or self.total_steps < 1:
            raise ValueError("need 0 <= warmup_steps <= total_steps and total_steps >= 1")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        for name in ("adam_b1", "adam_b2", "muon_momentum"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.ns_steps < 1:
            raise ValueError(f"ns_steps must be >= 1, got {self.ns_steps!r}")
        if self.ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {tuple(NS_DTYPES)}")
        if self.shape_factor not in muon_lib.SHAPE_FACTORS:
            raise ValueError(f"shape_factor must be one of {muon_lib.SHAPE_FACTORS}")
        if self.muon_mode not in muon_lib.MODES:
            raise ValueError(f"muon_mode must be one of {muon_lib.MODES}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> OptimizerConfig:
        return dataclasses.replace(self, **changes)

    def with_overrides(self, overrides: list[str]) -> OptimizerConfig:
        """`key=value` strings, typed by the field; unknown keys are an error."""
        from laplace_spec.config import parse_overrides

        return self.replace(**parse_overrides(overrides, type(self)))


OPTIMIZER_PRESETS: dict[str, OptimizerConfig] = {
    "laplace-3b": OptimizerConfig(),
    "small": OptimizerConfig(lr=3e-3, warmup_steps=200, total_steps=5_000),
    "tiny": OptimizerConfig(lr=1e-2, warmup_steps=10, total_steps=200, ns_dtype="float32"),
}


def learning_rate_schedule(opt_cfg: OptimizerConfig):
    """step -> Muon's learning rate: lr (step+1)/warmup, then cosine down to min_lr_ratio lr.

    Branch-free (`jnp.where`), so it traces into the jitted step (no `lax.cond`).
    """
    peak, warm, total = opt_cfg.lr, opt_cfg.warmup_steps, opt_cfg.total_steps
    floor = opt_cfg.min_lr_ratio * peak

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warmup = peak * jnp.minimum(1.0, (step + 1.0) / max(warm, 1))
        frac = jnp.clip((step - warm) / max(total - warm, 1), 0.0, 1.0)
        cosine = floor + 0.5 * (peak - floor) * (1.0 + jnp.cos(math.pi * frac))
        return jnp.where(step < warm, warmup, cosine)

    return schedule


# ---- parameter bookkeeping ----------------------------------------------------------------------


def _path(key_path) -> str:
    """A pytree key path as the `/`-joined parameter path (`layer_0/qkvg/kernel`)."""
    return jax.tree_util.keystr(key_path, simple=True, separator="/")


def param_labels(params_like):
    """A tree like params of "muon" / "adamw" (the table's `optimizer` column)."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, _: param_group(_path(kp)).optimizer, params_like
    )


def _adamw_decay_mask(params):
    """The table's `weight_decay` column: kernels and the embedding, not norm scales, biases or
    aug_balance. (Muon decays every matrix it updates: they all have it.)"""
    return jax.tree_util.tree_map_with_path(
        lambda kp, _: param_group(_path(kp)).weight_decay, params
    )


def _spec(path: str, leaf) -> PartitionSpec:
    """A Muon matrix's PartitionSpec, read from its NamedSharding (the rules table placed it)."""
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        raise ValueError(
            f"with a mesh, Muon reads how each matrix is split from its NamedSharding; {path} has "
            f"{sharding!r} (pass params or `abstract_with_shardings(abstract_params(cfg), "
            "param_shardings(cfg, mesh))`)"
        )
    return sharding.spec


def muon_plan(opt_cfg: OptimizerConfig, params_like, mesh: Mesh | None = None):
    """The static Muon plan for these parameters (mode `single` when there is no mesh)."""
    flat = traverse_util.flatten_dict(params_like, sep="/")
    mats = {p: x for p, x in flat.items() if is_muon_path(p)}
    for p, x in mats.items():
        if len(x.shape) != 2:
            raise ValueError(f"Muon parameter {p} is not a matrix: shape {x.shape}")
    mode = opt_cfg.muon_mode if mesh is not None else "single"
    specs = {} if mesh is None else {p: _spec(p, x) for p, x in mats.items()}
    return muon_lib.MuonPlan(
        shapes={p: tuple(x.shape) for p, x in mats.items()},
        mode=mode,
        ns_steps=opt_cfg.ns_steps,
        ns_dtype=opt_cfg.ns_dtype,
        shape_factor=opt_cfg.shape_factor,
        mesh=mesh,
        axis=FSDP if mesh is None else param_axes(mesh),
        specs=specs,
    )


def make_optimizer(
    opt_cfg: OptimizerConfig, params_like, mesh: Mesh | None = None
) -> optax.GradientTransformation:
    """Muon (by path) + AdamW, one schedule. `params_like`: params or their abstract shapes.

    With a mesh, `gather`/`a2a` run inside `shard_map` over the mesh axes the parameters are
    split over (`fsdp`, or `fsdp x context`: `laplace_jax.sharding.param_axes`), and each Muon
    matrix is split as its leaf's NamedSharding says (`laplace_jax.sharding.param_shardings`,
    the rules table; abstract shapes carry it through `abstract_with_shardings`). Without a
    mesh all modes are `single`.
    """
    schedule = learning_rate_schedule(opt_cfg)
    plan = muon_plan(opt_cfg, params_like, mesh)
    muon_tx = muon_lib.muon(
        schedule,
        plan,
        momentum=opt_cfg.muon_momentum,
        nesterov=opt_cfg.nesterov,
        weight_decay=opt_cfg.weight_decay,
    )
    adamw_tx = optax.adamw(
        lambda step: opt_cfg.adamw_lr_ratio * schedule(step),
        b1=opt_cfg.adam_b1,
        b2=opt_cfg.adam_b2,
        eps=opt_cfg.adam_eps,
        weight_decay=opt_cfg.weight_decay,
        mask=_adamw_decay_mask,
    )
    return optax.partition({"muon": muon_tx, "adamw": adamw_tx}, param_labels(params_like))


def opt_state_shardings(tx: optax.GradientTransformation, params_like, param_shardings):
    """NamedSharding for every leaf of `tx.init(params)`: a leaf that shadows a parameter
    (momentum, Adam moments) takes that parameter's sharding, scalars (counts) are replicated.
    """
    by_path = traverse_util.flatten_dict(param_shardings)  # {("layer_0", "w12", "kernel"): s}
    shapes = {p: x.shape for p, x in traverse_util.flatten_dict(params_like).items()}
    mesh = next(iter(by_path.values())).mesh
    abstract = jax.eval_shape(tx.init, params_like)

    def pick(kp, leaf):
        keys = tuple(str(k.key) for k in kp if isinstance(k, jax.tree_util.DictKey))
        for i in range(len(keys)):
            tail = keys[i:]
            if tail in by_path and shapes[tail] == leaf.shape:
                return by_path[tail]
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(pick, abstract)
