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
full gradient are live at a time. A hybrid (`attention_every=k`) scans blocks of k layers
(MaxText scans Qwen3-Next's blocks this way): in the body an inner scan over the block's k - 1
GLA layers, then its attention layer, each layer its own remat checkpoint. With a `remat`
policy each layer is a `jax.checkpoint`: the backward keeps each layer's input only, gathers
the layer's weights again and recomputes it, the FSDP ideal's second gather (docs/design.md s8).
The parameter tree is unchanged (`layer_{i}/...`): the stacking is of each device's local
shards, inside the step, and moves no data between devices.

The math is the model's own: `LaplaceLM` runs the embedding, final norm and head on gathered
weights, with its decoder layers replaced by the scan of `DecoderLayer` (its `layers` argument),
and the loss is laplace_jax/loss.py's; only where the weights come from differs. Which weights
travel in the compute dtype is the `gather_in_compute_dtype` column of
laplace_spec/param_groups.py. `tests/test_fsdp.py` checks loss and gradients against
`jax.value_and_grad` of the plain model.

Long sequences (docs/design.md s11): on a mesh with a `context` axis of size S, every device of
a context group receives the group's whole token windows and cuts its contiguous slice of
inputs, targets and document starts from them (laplace_jax/loss.py's `next_token_slice`: the
target of a slice's last token is the next slice's first token); a task's mask arrives already
split (the rules table's `length`). The decoder layers are `DecoderLayer`s with
`context_axis="context"` (laplace_jax/context_parallel.py: one exchange per layer for the GLA, a
ppermute for the conv). Parameters are split over `fsdp x context`, so the gathers and the
gradients' reduce-scatter run over both axes, and a slice's gradient is summed with the other
slices' there. The mean is over every scored target of the micro-batch, all slices together.
`tests/test_context_training.py` checks loss and gradients against the plain model.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax.sharding import Mesh, PartitionSpec

from laplace_jax.context_parallel import CONTEXT_STATE, CONTEXT_WINDOW, slice_decays
from laplace_jax.loss import next_token_slice, token_losses, token_scores
from laplace_jax.model import DecoderLayer, LaplaceLM
from laplace_jax.sharding import CONTEXT, logical_to_spec
from laplace_spec.param_groups import param_group

f32 = jnp.float32

# What the backward of a decoder layer keeps from its forward (`remat`): "none" keeps every
# activation (and the gathered weights); "layer" keeps each layer's input only and recomputes the
# layer, weights gathered again; "dots" keeps the matmul outputs too (less recompute, more memory).
# Both keep what a context-parallel layer received (CONTEXT_STATE, [b, H, dk, dv], and the conv
# window CONTEXT_WINDOW, [b, W, D], per layer), so the recomputed forward makes no second exchange.
_keep_exchange = jax.checkpoint_policies.save_only_these_names(CONTEXT_STATE, CONTEXT_WINDOW)
REMAT_POLICIES = {
    "none": None,
    "layer": _keep_exchange,
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _keep_exchange
    ),
}

# The parameters outside the decoder layers, which `LaplaceLM` applies itself around the scan.
TOP_LEVEL = ("embed/embedding", "ln_f/scale", "lm_head/kernel")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def gather_weight(shard, axis: int | None, over, dtype, mesh_axes: tuple[str, ...]):
    """This device's shard -> the whole weight in `dtype` (all_gather over the mesh axes `over`,
    e.g. `fsdp` or `("fsdp", "context")`, along dimension `axis`; `axis` None: a replicated
    parameter, only cast). Its gradient is the fp32 sum over all devices, scattered back to the
    shard."""
    w = shard.astype(dtype)
    return w if axis is None else jax.lax.all_gather(w, over, axis=axis, tiled=True)


def _gather_fwd(shard, axis, over, dtype, mesh_axes):
    return gather_weight(shard, axis, over, dtype, mesh_axes), None


def _gather_bwd(axis, over, dtype, mesh_axes, _, ct):
    ct = ct.astype(f32)  # reduce in fp32 whatever the compute dtype
    split = () if axis is None else ((over,) if isinstance(over, str) else tuple(over))
    others = tuple(a for a in mesh_axes if a not in split)
    if axis is not None:  # [D, F] -> this device's [D/n, F] of the sum over its gather group
        ct = jax.lax.psum_scatter(ct, over, scatter_dimension=axis, tiled=True)
    if others:  # replicas of this shard (data axis; all axes for a replicated parameter)
        ct = jax.lax.psum(ct, others)
    return (ct,)


gather_weight.defvjp(_gather_fwd, _gather_bwd)


def split_dim(spec: PartitionSpec) -> tuple[int | None, str | tuple[str, ...] | None]:
    """(the dimension a parameter's PartitionSpec splits, the mesh axes it is split over), or
    (None, None) for a replicated parameter."""
    for i, entry in enumerate(spec):
        if entry is not None:
            return i, entry
    return None, None


def _check_slices(cfg, T: int, context: int) -> None:
    if T % context:
        raise ValueError(
            f"a sequence of {T} positions cannot be cut into context={context} equal slices: "
            "seq_len must be a multiple of the context axis"
        )
    if T // context < cfg.conv_width:
        raise ValueError(
            f"slices of {T // context} tokens (seq_len {T} over context={context}) are shorter "
            f"than the conv window ({cfg.conv_width}): use fewer context devices"
        )


def device_forward(model: LaplaceLM, mesh: Mesh, param_specs, remat: str, eot_id):
    """f(shards, tokens [b, T + 1], outputs) -> outputs(model, top weights, inputs, targets,
    reset, layers) on one device inside `shard_map`: this device's slice of inputs, targets and
    document starts cut from its windows (`next_token_slice`), the decoder layers a scan of
    `DecoderLayer` over weights gathered layer by layer, the top-level weights gathered.
    `outputs` is laplace_jax/loss.py's `token_losses` (training) or `token_scores` (eval)."""
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {tuple(REMAT_POLICIES)}, got {remat!r}")
    cfg = model.config
    dtype = jnp.dtype(cfg.compute_dtype)
    mesh_axes = tuple(mesh.axis_names)
    L = cfg.n_layers
    context = mesh.shape.get(CONTEXT, 1)
    flat_specs = traverse_util.flatten_dict(param_specs, sep="/")

    def gather_args(path):  # static (axis, over, dtype, mesh axes) of the parameter at `path`
        cast = param_group(path).gather_in_compute_dtype  # laplace_spec/param_groups.py
        return *split_dim(flat_specs[path]), dtype if cast else f32, mesh_axes

    layer_args = {  # "qkvg/kernel" -> static gather arguments (the same for every layer that
        # has it: a hybrid's GLA and attention layers may each have parameters the other lacks)
        p.split("/", 1)[1]: gather_args(p)
        for p in sorted(flat_specs)
        if p.startswith("layer_")
    }

    # built here, outside the model's apply; on a context axis it holds one slice of each
    # sequence. A hybrid's layers repeat in blocks of k = cfg.block_size: k - 1 GLA layers, then
    # an attention layer (k = 1 otherwise: every layer alike). The scan runs over blocks; inside
    # a block an inner scan runs the k - 1 GLA layers one at a time (so the backward holds one
    # layer's intermediates, not the block's), then the attention layer: no conditional picks a
    # layer's mixer.
    k = cfg.block_size
    axis = CONTEXT if context > 1 else None
    layer_kw = {
        "unroll": model.unroll,
        "context_axis": axis,
        "attention_context": model.attention_context,
    }
    first, last = DecoderLayer(cfg, mixer=cfg.layer_mixers[0], **layer_kw), None
    if k > 1:
        last = DecoderLayer(cfg, mixer=cfg.layer_mixers[k - 1], **layer_kw)

    def layer(decoder_layer, x, shards, reset=None, decays=None, embedding=None):  # x: [b, T, D]
        weights = {p: gather_weight(shards[p], *layer_args[p]) for p in layer_args}
        b = x.shape[0]
        state = {
            "gla": jnp.zeros((b, *cfg.gla_state_shape), f32),
            "conv": jnp.zeros((b, *cfg.conv_state_shape), f32),
        }
        layer_params = traverse_util.unflatten_dict(weights, sep="/")
        kw = {} if reset is None else {"reset": reset}
        if decays is not None:
            kw["decays"] = decays
        if embedding is not None:
            kw["embedding"] = embedding
        x, _ = decoder_layer.apply({"params": layer_params}, x, state, **kw)
        return x

    def checkpointed(f):  # per-layer remat: each layer its own checkpoint
        policy = REMAT_POLICIES[remat]
        return f if policy is None else jax.checkpoint(f, policy=policy)

    first_layer = checkpointed(functools.partial(layer, first))
    last_layer = None if last is None else checkpointed(functools.partial(layer, last))

    def block(x, block_shards, reset, decays, x0):  # shards: [k, ...] per path ([...] if k = 1)
        if k == 1:
            return first_layer(x, block_shards, reset, decays, x0), None
        gla = {p: a[: k - 1] for p, a in block_shards.items()}  # [k - 1, ...]
        x, _ = jax.lax.scan(lambda x, s: (first_layer(x, s, reset, decays, x0), None), x, gla)
        last_shards = {p: a[k - 1] for p, a in block_shards.items()}
        return last_layer(x, last_shards, reset, decays, x0), None

    def forward(shards, tokens, outputs):
        # shards: this device's {path: shard}; tokens: its sequences' windows [b, T + 1]
        inputs, targets, reset = next_token_slice(tokens, eot_id, axis)
        stacked = {  # [L, ...] per layer parameter: local shards only, no communication; a
            # layer without it (the other kind of a hybrid's layer) stacks zeros it never reads
            p: jnp.stack([layer_shard(shards, i, p) for i in range(L)])
            for p in layer_args
        }
        if k > 1:  # [L / k, k, ...]: blocks of k layers
            stacked = {p: a.reshape(L // k, k, *a.shape[1:]) for p, a in stacked.items()}

        def layers(x, reset):  # the decoder layers: a scan over the blocks' shards, [b, T, D]
            decays = None  # on a context axis: once per step, for every GLA layer
            if axis is not None and "gla" in cfg.layer_mixers:
                log_decay = jnp.asarray(cfg.log_decay(), f32)  # [H], the same in every layer
                decays = slice_decays(log_decay, axis, *x.shape[:2], reset)
            x0 = x if cfg.attention_reads_embedding else None  # the embedding (s13.5)
            x, _ = jax.lax.scan(lambda x, s: block(x, s, reset, decays, x0), x, stacked)
            return x

        top = {p: gather_weight(shards[p], *gather_args(p)) for p in TOP_LEVEL}
        top = traverse_util.unflatten_dict(top, sep="/")  # embedding, final norm, head
        return outputs(model, top, inputs, targets, reset, layers)  # [b, T / S] each

    def layer_shard(shards, i, p):  # layer i's shard of parameter p, zeros if it has none
        if f"layer_{i}/{p}" in shards:
            return shards[f"layer_{i}/{p}"]
        owner = next(q for q in shards if q.startswith("layer_") and q.endswith(f"/{p}"))
        return jnp.zeros_like(shards[owner])

    return forward


def _check_tokens(cfg, mesh: Mesh, tokens) -> None:
    _check_slices(cfg, tokens.shape[1] - 1, mesh.shape.get(CONTEXT, 1))


def make_sharded_loss(
    model: LaplaceLM,
    mesh: Mesh,
    param_specs,
    remat: str = "none",
    eot_id: int | None = None,
    grad: bool = True,
):
    """f(params, tokens [M, T + 1], mask=None) -> (mean next-token loss, gradients sharded like
    params); with `grad=False` the loss only (evaluation: the same sharded forward). With `mask`
    [M, T] bool the mean is over the masked targets only.

    `eot_id`: packed documents end with this token; every layer resets its GLA state and conv
    window at the token after each one (`reset_after_eot` of the whole sequence), so no document
    sees the one before it. None: no resets.

    `param_specs`: the PartitionSpec of every parameter (laplace_jax.sharding.param_specs). The
    sequences are split over the rules table's `batch` axes and, with a `context` axis, their
    positions over `length` (module docstring).
    """
    forward = device_forward(model, mesh, param_specs, remat, eot_id)
    mesh_axes = tuple(mesh.axis_names)
    window_spec = logical_to_spec(("batch", "window"), None, mesh)  # tokens [M, T + 1]
    slice_spec = logical_to_spec(("batch", "length"), None, mesh)  # a mask [M, T]
    split_axes = tuple(a for a in mesh_axes if a in jax.tree.leaves(tuple(slice_spec)))
    flat_specs = traverse_util.flatten_dict(param_specs, sep="/")

    def local_loss(shards, n_global, tokens, mask=None):  # mask: this device's [b, T / S]
        ce = forward(shards, tokens, token_losses)  # [b, T / S] fp32
        if mask is not None:  # only the scored targets count
            ce = jnp.where(mask, ce, 0.0)
        return ce.sum() / n_global  # this device's share of the global mean

    def body(shards, n_targets, tokens, mask):  # per device: shards, windows, mask slice
        if mask is not None:  # the scored targets of the whole micro-batch (none: loss 0)
            n_targets = jax.lax.psum(mask.sum(dtype=f32), split_axes) if split_axes else mask.sum()
            n_targets = jnp.maximum(n_targets.astype(f32), 1.0)
        args = (shards, n_targets, tokens, mask)
        if not grad:
            return jax.lax.psum(local_loss(*args), mesh_axes)
        loss, grads = jax.value_and_grad(local_loss)(*args)
        return jax.lax.psum(loss, mesh_axes), grads

    def sharded_loss(params, tokens, mask=None):
        """`mask` [M, T] bool (optional): the loss is sum(ce * mask) / sum(mask) over the whole
        micro-batch (e.g. the answer positions of train/tasks.py); None: every target counts."""
        _check_tokens(model.config, mesh, tokens)
        n_targets = jnp.asarray(tokens.shape[0] * (tokens.shape[1] - 1), f32)  # M T targets
        fn = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(
                flat_specs,
                PartitionSpec(),
                window_spec,
                None if mask is None else slice_spec,
            ),
            out_specs=(PartitionSpec(), flat_specs) if grad else PartitionSpec(),
            check_vma=False,
        )
        out = fn(traverse_util.flatten_dict(params, sep="/"), n_targets, tokens, mask)
        if not grad:
            return out
        loss, grads = out
        return loss, traverse_util.unflatten_dict(grads, sep="/")

    return sharded_loss


def make_token_scores(model: LaplaceLM, mesh: Mesh, param_specs, eot_id: int | None = None):
    """f(params, tokens [M, T + 1]) -> (ce [M, T] fp32, greedy next token [M, T] int32) at every
    position (laplace_jax/loss.py's `token_scores`), through the training step's sharded
    forward: what `train.eval` scores a checkpoint with, at its length, on many devices."""
    forward = device_forward(model, mesh, param_specs, "none", eot_id)
    window_spec = logical_to_spec(("batch", "window"), None, mesh)
    slice_spec = logical_to_spec(("batch", "length"), None, mesh)
    flat_specs = traverse_util.flatten_dict(param_specs, sep="/")

    def scores(params, tokens):
        _check_tokens(model.config, mesh, tokens)
        fn = jax.shard_map(
            lambda shards, t: forward(shards, t, token_scores),
            mesh=mesh,
            in_specs=(flat_specs, window_spec),
            out_specs=(slice_spec, slice_spec),
            check_vma=False,
        )
        return fn(traverse_util.flatten_dict(params, sep="/"), tokens)

    return scores


def make_loss_and_grad(
    model: LaplaceLM,
    mesh: Mesh,
    param_specs,
    remat: str = "none",
    eot_id: int | None = None,
):
    """f(params, tokens [M, T + 1], mask=None) -> (mean next-token loss, gradients sharded like
    params): `make_sharded_loss` with its gradient."""
    return make_sharded_loss(model, mesh, param_specs, remat, eot_id, grad=True)


def make_loss(model: LaplaceLM, mesh: Mesh, param_specs, eot_id: int | None = None):
    """f(params, tokens [M, T + 1], mask=None) -> the mean next-token loss, the training step's
    sharded forward (weights gathered layer by layer; a context axis splits each sequence)."""
    return make_sharded_loss(model, mesh, param_specs, "none", eot_id, grad=False)
