"""The jitted training step: gradient accumulation, clipping, the NaN/Inf guard, FSDP shardings.

Everything inside the step respects the Neuron constraints of docs/design.md section 1: no
`lax.cond`, no host callbacks, a scan only with a static trip count (the accumulation steps).
A step whose loss or gradient norm is not finite is not applied: `jnp.where` selects the old
parameters and optimizer state, and `bad_streak` counts such steps in a row. The old state
includes optax's step counts, so after a skipped step the schedule lags the host's step counter:
the `lr` metric is the rate optax applied, read from the state's count, not from the host step.

The train state is a plain dict {"params", "opt_state", "bad_streak"}; the host loop owns the
step counter (it is also the data position and the checkpoint number).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from laplace_jax.fsdp import make_loss, make_loss_and_grad
from laplace_jax.model import LaplaceLM
from laplace_jax.sharding import logical_sharding, replicated

# Logical axes of the token batches (the rules table in laplace_jax/sharding.py places them):
# whole windows of T + 1 tokens, which the step cuts into inputs and targets (and, on a context
# axis, into slices); a task's answer mask covers the T targets.
TRAIN_BATCH_AXES = ("accum", "batch", "window")  # [A, M, T + 1]
EVAL_BATCH_AXES = ("batch", "window")  # [M, T + 1]
TRAIN_MASK_AXES = ("accum", "batch", "length")  # [A, M, T]


def make_train_step(
    model: LaplaceLM,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    param_shardings,
    opt_shardings,
    grad_clip: float = 1.0,
    lr_schedule=None,
    remat: str = "none",
    masked: bool = False,
    eot_id: int | None = None,
):
    """jit(step)(state, batch [A, B, T + 1]) -> (state, metrics), with explicit shardings.

    `masked`: the step is jit(step)(state, batch, mask [A, B, T] bool) and each micro-batch's
    loss counts only the masked targets (the answer positions of the tasks in train/tasks.py).
    `eot_id`: packed documents; the model resets its state after each such token (fsdp.py).

    Each micro-batch's loss and gradient come from `laplace_jax.fsdp` (weights gathered layer by
    layer, gradients reduce-scattered in fp32; `remat` is its policy for the backward).

    With `lr_schedule` (step -> Muon's rate), the metrics hold `lr`: that schedule at optax's own
    count (`schedule_count`), i.e. the learning rate this step applied.
    """
    state_shardings = {
        "params": param_shardings,
        "opt_state": opt_shardings,
        "bad_streak": replicated(mesh),
    }
    repl = replicated(mesh)
    specs = jax.tree.map(lambda s: s.spec, param_shardings)
    grad_fn = make_loss_and_grad(model, mesh, specs, remat, eot_id)

    def step(state, batch, mask=None):
        params = state["params"]
        accum = batch.shape[0]  # static

        if accum == 1:
            loss, grads = grad_fn(params, batch[0], None if mask is None else mask[0])
        elif mask is not None:  # the mean over every scored target of the step: each
            # micro-batch's mean weighted by its share of the scored targets (counts may differ)
            counts = mask.reshape(accum, -1).sum(1).astype(jnp.float32)  # [A]
            weights = counts / jnp.maximum(counts.sum(), 1.0)  # [A], sums to 1 (0: none scored)

            def weighted_micro(carry, xs):
                loss_sum, grad_sum = carry
                tokens, micro_mask, w = xs
                loss, grads = grad_fn(params, tokens, micro_mask)
                grad_sum = jax.tree.map(lambda acc, g: acc + w * g, grad_sum, grads)
                grad_sum = jax.lax.with_sharding_constraint(grad_sum, param_shardings)
                return (loss_sum + w * loss, grad_sum), None

            zeros = jax.tree.map(jnp.zeros_like, params)
            init = (jnp.zeros((), jnp.float32), zeros)
            (loss, grads), _ = jax.lax.scan(weighted_micro, init, (batch, mask, weights))
        else:

            def micro(carry, xs):
                loss_sum, grad_sum = carry
                loss, grads = grad_fn(params, xs)
                grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
                grad_sum = jax.lax.with_sharding_constraint(grad_sum, param_shardings)
                return (loss_sum + loss, grad_sum), None

            zeros = jax.tree.map(jnp.zeros_like, params)
            (loss, grads), _ = jax.lax.scan(micro, (jnp.zeros((), jnp.float32), zeros), batch)
            loss = loss / accum
            grads = jax.tree.map(lambda g: g / accum, grads)

        grad_norm = optax.global_norm(grads)
        if grad_clip > 0:  # static choice; the scale itself is branch-free
            # divided, not multiplied: XLA's CPU backend fuses a product into the add that
            # consumes it (one rounding), so `g * scale` would make Muon's momentum
            # `mu m + g * scale` two products, of which the program's fusion picks one; a
            # quotient is never fused so, and every Muon mode rounds alike (design s4.2)
            divisor = jnp.maximum(1.0, (grad_norm + 1e-6) / grad_clip)
            grads = jax.tree.map(lambda g: g / divisor, grads)
        updates, new_opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)

        # NaN/Inf guard: keep the old state, selected element-wise (no lax.cond on Neuron)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
        new_state = {
            "params": jax.tree.map(keep, new_params, params),
            "opt_state": jax.tree.map(keep, new_opt_state, state["opt_state"]),
            "bad_streak": jnp.where(ok, 0, state["bad_streak"] + 1).astype(jnp.int32),
        }
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "applied": ok,
            "bad_streak": new_state["bad_streak"],
        }
        if lr_schedule is not None:
            count = schedule_count(state["opt_state"])
            metrics["lr"] = jnp.asarray(lr_schedule(count), jnp.float32)
        return new_state, metrics

    names = ("loss", "grad_norm", "applied", "bad_streak") + (("lr",) if lr_schedule else ())
    metric_shardings = {k: repl for k in names}
    batch_sharding = logical_sharding(mesh, TRAIN_BATCH_AXES)
    mask_sharding = logical_sharding(mesh, TRAIN_MASK_AXES)
    return jax.jit(
        step,
        in_shardings=(state_shardings, batch_sharding) + ((mask_sharding,) if masked else ()),
        out_shardings=(state_shardings, metric_shardings),
        donate_argnums=0,
    ), state_shardings


def schedule_count(opt_state):
    """optax's step count in `opt_state` (that of its first `scale_by_schedule`): the step at
    which the learning-rate schedule is evaluated next. It does not advance on a skipped step."""
    is_count = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    for leaf in jax.tree.leaves(opt_state, is_leaf=is_count):
        if is_count(leaf):
            return leaf.count
    raise ValueError("the optimizer state has no learning-rate schedule (no ScaleByScheduleState)")


def make_eval_step(model: LaplaceLM, mesh: Mesh, param_shardings, eot_id: int | None = None):
    """jit(loss)(params, tokens [B, T + 1]) -> mean next-token loss: the training step's sharded
    forward (laplace_jax/fsdp.py: weights gathered layer by layer, sequences split over a
    context axis; `eot_id`: packed documents, as in training)."""
    specs = jax.tree.map(lambda s: s.spec, param_shardings)
    return jax.jit(
        make_loss(model, mesh, specs, eot_id),
        in_shardings=(param_shardings, logical_sharding(mesh, EVAL_BATCH_AXES)),
        out_shardings=replicated(mesh),
    )


@functools.lru_cache(maxsize=4)
def _matmul_probe(mesh: Mesh, size: int):
    n = mesh.size
    sharding = logical_sharding(mesh, ("devices", "window", "window"))  # one pair per device
    a = jax.device_put(
        np.random.default_rng(0).standard_normal((n, size, size), np.float32), sharding
    )
    f = jax.jit(lambda x: jnp.einsum("nij,njk->nik", x, x), out_shardings=sharding)
    f(a).block_until_ready()
    return f, a


def measure_matmul_flops(mesh: Mesh, size: int = 1024, reps: int = 5) -> float:
    """fp32 matmul FLOP/s of all mesh devices together, measured now (the MFU denominator).

    Every device multiplies its own [size, size] pair at the same time, so simulated devices
    sharing CPU cores are not counted twice.
    """
    n = mesh.size
    f, a = _matmul_probe(mesh, size)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n * size**3 / best
