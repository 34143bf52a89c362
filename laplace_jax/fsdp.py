"""FSDP with explicit collectives: the loss and gradient of one micro-batch (docs/design.md s8).

Inside `jax.shard_map` every device holds its shards of the parameters and its own sequences,
and the program states every collective it makes, the same on every backend:

    gather_weight(shard)  forward:  all_gather(shard.astype(dtype)) over fsdp   [D/n, F] -> [D, F]
                          backward: psum_scatter(ct.astype(f32)) over fsdp, then psum over data

so weights travel in the compute dtype (bf16 for 3B: half the bytes moved and held) and
gradients are reduced in fp32, straight into their shards. Parameters the rules table leaves
replicated (norm scales, biases) are not gathered; their gradient is summed over every device.

The decoder layers run as a `lax.scan` over the layer-stacked shards (MaxText's `scan_layers`; a
loop with a static trip count, which Neuron accepts), so only one layer's gathered weights and
full gradient are live at a time. With a `remat` policy the scan body is a `jax.checkpoint`: the
backward keeps each layer's input only, gathers the layer's weights again and recomputes it, the
FSDP ideal's second gather (docs/design.md s8). The parameter tree is unchanged
(`layer_{i}/...`): the stacking is of each device's local shards, inside the step, and moves no
data between devices.

The math is the model's own: `LaplaceLM` runs the embedding, final norm and head on gathered
weights, with its decoder layers replaced by the scan of `DecoderLayer` (its `layers` argument),
and the loss is laplace_jax/loss.py's; only where the weights come from differs. Which weights
travel in the compute dtype is the `gather_in_compute_dtype` column of
laplace_spec/param_groups.py. `tests/test_fsdp.py` checks loss and gradients against
`jax.value_and_grad` of the plain model.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax.sharding import Mesh, PartitionSpec

from laplace_jax.loss import next_token_losses
from laplace_jax.model import DecoderLayer, LaplaceLM
from laplace_jax.sharding import FSDP
from laplace_spec.param_groups import param_group

f32 = jnp.float32

# What the backward of a decoder layer keeps from its forward (`remat`): "none" keeps every
# activation (and the gathered weights); "layer" keeps each layer's input only and recomputes the
# layer, weights gathered again; "dots" keeps the matmul outputs too (less recompute, more memory).
REMAT_POLICIES = {
    "none": None,
    "layer": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

# The parameters outside the decoder layers, which `LaplaceLM` applies itself around the scan.
TOP_LEVEL = ("embed/embedding", "ln_f/scale", "lm_head/kernel")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather_weight(shard, axis: int | None, dtype, mesh_axes: tuple[str, ...]):
    """This device's shard -> the whole weight in `dtype` (all_gather over fsdp along `axis`;
    `axis` None: a replicated parameter, only cast). Its gradient is the fp32 sum over all
    devices, scattered back to the shard."""
    w = shard.astype(dtype)
    return w if axis is None else jax.lax.all_gather(w, FSDP, axis=axis, tiled=True)


def _gather_fwd(shard, axis, dtype, mesh_axes):
    return gather_weight(shard, axis, dtype, mesh_axes), None


def _gather_bwd(axis, dtype, mesh_axes, _, ct):
    ct = ct.astype(f32)  # reduce in fp32 whatever the compute dtype
    others = tuple(a for a in mesh_axes if a != FSDP or axis is None)
    if axis is not None:  # [D, F] -> this device's [D/n, F] of the sum over the fsdp group
        ct = jax.lax.psum_scatter(ct, FSDP, scatter_dimension=axis, tiled=True)
    if others:  # replicas of this shard (data axis; all axes for a replicated parameter)
        ct = jax.lax.psum(ct, others)
    return (ct,)


gather_weight.defvjp(_gather_fwd, _gather_bwd)


def fsdp_axis(spec: PartitionSpec) -> int | None:
    """The dimension a parameter's PartitionSpec splits over `fsdp` (None: replicated)."""
    for i, entry in enumerate(spec):
        if entry == FSDP or (isinstance(entry, tuple) and FSDP in entry):
            return i
    return None


def make_loss_and_grad(
    model: LaplaceLM,
    mesh: Mesh,
    param_specs,
    batch_spec: PartitionSpec,
    remat: str = "none",
    eot_id: int | None = None,
):
    """f(params, tokens [M, T + 1], mask=None) -> (mean next-token loss, gradients sharded like
    params). With `mask` [M, T] bool the mean is over the masked targets only.

    `eot_id`: packed documents end with this token; every layer resets its GLA state and conv
    window at the token after each one (reset [b, T] computed on device from the inputs by
    `reset_after_eot`), so no document sees the one before it. None: no resets.

    `param_specs`: the PartitionSpec of every parameter (laplace_jax.sharding.param_specs);
    `batch_spec`: that of the token batch (its sequences split over the devices).
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {tuple(REMAT_POLICIES)}, got {remat!r}")
    cfg = model.config
    dtype = jnp.dtype(cfg.compute_dtype)
    mesh_axes = tuple(mesh.axis_names)
    L = cfg.n_layers

    flat_specs = traverse_util.flatten_dict(param_specs, sep="/")

    def gather_args(path):  # static (axis, dtype, mesh axes) of the parameter at `path`
        cast = param_group(path).gather_in_compute_dtype  # laplace_spec/param_groups.py
        return fsdp_axis(flat_specs[path]), dtype if cast else f32, mesh_axes

    layer_args = {  # "qkvg/kernel" -> static gather arguments (the same for every layer)
        p.split("/", 1)[1]: gather_args(p) for p in flat_specs if p.startswith("layer_0/")
    }

    def gather(params, path):
        return gather_weight(params[path], *gather_args(path))

    decoder_layer = DecoderLayer(cfg, model.unroll)  # built here, outside the model's apply

    def layer(x, stacked_shards, reset=None):  # x: [b, T, D]; one layer's shards; reset [b, T]
        weights = {p: gather_weight(stacked_shards[p], *layer_args[p]) for p in layer_args}
        b = x.shape[0]
        state = {
            "gla": jnp.zeros((b, *cfg.gla_state_shape), f32),
            "conv": jnp.zeros((b, *cfg.conv_state_shape), f32),
        }
        layer_params = traverse_util.unflatten_dict(weights, sep="/")
        kw = {} if reset is None else {"reset": reset}
        x, _ = decoder_layer.apply({"params": layer_params}, x, state, **kw)
        return x, None

    if REMAT_POLICIES[remat] is not None:
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat])

    def local_loss(shards, tokens, n_global, mask=None):
        # shards: this device's {path: shard}; tokens: its sequences [b, T + 1]; mask: [b, T]
        stacked = {  # [L, ...] per layer parameter: local shards only, no communication
            p: jnp.stack([shards[f"layer_{i}/{p}"] for i in range(L)]) for p in layer_args
        }

        def layers(x, reset):  # the decoder layers: a scan over the stacked shards, [b, T, D]
            x, _ = jax.lax.scan(lambda x, s: layer(x, s, reset), x, stacked)
            return x

        top = {p: gather(shards, p) for p in TOP_LEVEL}  # embedding, final norm, head
        top = traverse_util.unflatten_dict(top, sep="/")
        ce = next_token_losses(model, top, tokens, eot_id, layers)  # [b, T] fp32
        if mask is not None:  # only the scored targets count
            ce = jnp.where(mask, ce, 0.0)
        return ce.sum() / n_global  # this device's share of the global mean

    batch_axes = batch_spec[0] if isinstance(batch_spec[0], tuple) else (batch_spec[0],)
    split_axes = tuple(a for a in batch_axes if a is not None)  # the batch's mesh axes
    batch_shards = math.prod(mesh.shape[a] for a in split_axes)

    def body(shards, tokens, mask=None):  # per device: its shards, sequences [b, T + 1], mask
        if mask is None:  # every target of the whole micro-batch counts
            n_targets = batch_shards * tokens.shape[0] * (tokens.shape[1] - 1)
        else:  # the scored targets of the whole micro-batch (none: loss 0, not NaN)
            n_targets = mask.sum(dtype=f32)
            n_targets = jax.lax.psum(n_targets, split_axes) if split_axes else n_targets
            n_targets = jnp.maximum(n_targets, 1.0)
        loss, grads = jax.value_and_grad(local_loss)(shards, tokens, n_targets, mask)
        return jax.lax.psum(loss, mesh_axes), grads

    def loss_and_grad(params, tokens, mask=None):
        """`mask` [M, T] bool (optional): the loss is sum(ce * mask) / sum(mask) over the whole
        micro-batch (e.g. the answer positions of train/tasks.py); None: every target counts."""
        inputs = (traverse_util.flatten_dict(params, sep="/"), tokens)
        inputs += () if mask is None else (mask,)
        fn = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(flat_specs,) + (batch_spec,) * (len(inputs) - 1),
            out_specs=(PartitionSpec(), flat_specs),
            check_vma=False,
        )
        loss, grads = fn(*inputs)
        return loss, traverse_util.unflatten_dict(grads, sep="/")

    return loss_and_grad
