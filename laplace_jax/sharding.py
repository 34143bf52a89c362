"""Sharding as a rules table: logical axis names -> mesh axes. Every sharding comes from here.

The model tags every parameter with logical axes (`("embed", "mlp")`), and the trainer names
the axes of its batches (`("accum", "batch", "window")`); this module alone decides where they
go. Changing the parallelism changes `LOGICAL_RULES`, never the model or the trainer.

FSDP over mesh axis `fsdp`: the first axis of every matrix is split over the devices (so each
Muon matrix is sharded on dim 0 of its stored kernel), and so are a batch's sequences. Beyond one
instance a 2-D mesh `data x fsdp` adds data parallelism: parameters stay FSDP-sharded inside each
`fsdp` group (the large gathers stay on the fast links) and replicated across `data`, while a
batch is split over both axes. 1-D parameters stay replicated. A matrix axis that does not
divide by the mesh size cannot be split and is replicated instead: `replicated_fallbacks` lists
those, and the trainer prints them.

Long sequences (docs/design.md s11): a third mesh axis `context` of size S splits every sequence
into S contiguous slices, one per device of a context group (the logical axis `length`, the T
positions the model reads and scores). The batch is then split over `data x fsdp` only, while
parameters and optimizer state are split over `fsdp x context`: every device of an instance
still holds 1/(F S) of them, and the FSDP gathers and Muon's all_to_all run over both axes.
Stored token batches keep their T + 1 tokens (`window`: inputs and targets) whole on every
device of a context group; the step cuts inputs and targets from them and hands each device its
slice.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from laplace_jax.model import abstract_params, param_logical_axes
from laplace_spec.config import LaplaceConfig

FSDP = "fsdp"
DATA = "data"
CONTEXT = "context"

# (logical axis, mesh axes). A logical axis takes the mesh axes of its rule that the mesh has,
# that no earlier dimension of the same array uses, and whose sizes together divide it.
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # batches
    ("batch", (DATA, FSDP)),  # the sequences of a (micro-)batch: over every context group
    ("accum", None),  # gradient-accumulation steps of a global batch
    ("window", None),  # a token batch's T + 1 tokens (inputs and targets): whole
    ("length", CONTEXT),  # the T positions the model reads and scores: S contiguous slices
    ("devices", (DATA, FSDP, CONTEXT)),  # one entry per device (the matmul probe)
    # parameters: the first axis of every matrix, over every device of an instance
    ("vocab", (FSDP, CONTEXT)),
    ("embed", (FSDP, CONTEXT)),
    ("attn", (FSDP, CONTEXT)),
    ("mlp", (FSDP, CONTEXT)),
    # parameters: everything else stays whole
    ("qkvg", None),
    ("heads", None),
    ("head_k", None),
    ("head_v", None),
    ("tiers", None),
    ("conv", None),
    ("norm", None),
)


def make_mesh(n_devices: int | None = None, devices=None, data: int = 1, context: int = 1) -> Mesh:
    """A mesh over the first `n_devices` devices (default: all): `fsdp`, preceded by `data` when
    data > 1 and followed by `context` when context > 1 (data x fsdp x context, with
    fsdp = n_devices / (data context); a context group is adjacent devices)."""
    devices = jax.devices() if devices is None else devices
    n = len(devices) if n_devices is None else n_devices
    if not 1 <= n <= len(devices):
        raise ValueError(f"mesh of {n} devices requested, {len(devices)} available")
    if data < 1 or context < 1 or n % (data * context):
        raise ValueError(f"data={data} x context={context} must divide the {n} devices of the mesh")
    sizes = {DATA: data, FSDP: n // (data * context), CONTEXT: context}
    names = tuple(a for a, size in sizes.items() if a == FSDP or size > 1)
    return Mesh(np.asarray(devices[:n]).reshape([sizes[a] for a in names]), names)


def axis_size(mesh: Mesh, axes) -> int:
    """Devices along a mesh axis or a tuple of them (1 for None or axes the mesh lacks)."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return int(np.prod([mesh.shape.get(a, 1) for a in axes]))


def param_axes(mesh: Mesh):
    """The mesh axes a parameter's split dimension goes over on `mesh` (the rules table's
    `embed` entry): `fsdp`, or `("fsdp", "context")` with a context axis."""
    return logical_to_spec(("embed",), None, mesh)[0]


def logical_to_spec(
    axes: tuple[str, ...], shape: tuple[int, ...] | None, mesh: Mesh, rules=LOGICAL_RULES
) -> PartitionSpec:
    """Resolve one array's logical axes to a PartitionSpec under `rules`.

    With a `shape`, an axis that does not divide by its mesh axes stays whole (replicated);
    without one (batches, whose sizes the trainer checks), the rule applies as written.
    """
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for i, name in enumerate(axes):
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no rule in the sharding table")
        wanted = table[name] if isinstance(table[name], tuple) else (table[name],)
        mesh_axes = tuple(a for a in wanted if a in mesh.shape and a not in used)
        size = int(np.prod([mesh.shape[a] for a in mesh_axes]))
        if mesh_axes and (shape is None or shape[i] % size == 0):
            used.update(mesh_axes)
            spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
        else:
            spec.append(None)
    return PartitionSpec(*spec)


def logical_sharding(mesh: Mesh, axes: tuple[str, ...], rules=LOGICAL_RULES) -> NamedSharding:
    """The NamedSharding of an array with these logical axes, e.g. ("batch", "window")."""
    return NamedSharding(mesh, logical_to_spec(axes, None, mesh, rules))


def replicated(mesh: Mesh) -> NamedSharding:
    """Scalars and other arrays that every device holds whole."""
    return NamedSharding(mesh, PartitionSpec())


def one_device() -> jax.sharding.SingleDeviceSharding:
    """Where a one-sequence job (the trainer's end-of-run greedy sample) runs: the host's CPU
    device when JAX has its CPU backend (no accelerator memory or compile spent on it: a 3B
    model's sample would take most of a NeuronCore's HBM), else this process's first device.
    Either way its programs compile for that device alone, with no collective; run on
    parameters sharded over a mesh, the same job would compile to a program of the whole mesh,
    with collectives among devices that have nothing to exchange."""
    try:
        device = jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without cpu
        device = jax.local_devices()[0]
    return jax.sharding.SingleDeviceSharding(device)


def abstract_with_shardings(tree, shardings):
    """`jax.ShapeDtypeStruct`s of `tree` (arrays or structs) placed with `shardings`: what
    `jit(...).lower` and orbax's restore take to build arrays of that layout."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def param_specs(config: LaplaceConfig, mesh: Mesh, rules=LOGICAL_RULES) -> dict:
    """PartitionSpec of every Laplace parameter, shaped like the params dict."""
    shapes = abstract_params(config)
    axes = param_logical_axes(config)
    return jax.tree.map(
        lambda a, s: logical_to_spec(a, s.shape, mesh, rules),
        axes,
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def param_shardings(config: LaplaceConfig, mesh: Mesh, rules=LOGICAL_RULES) -> dict:
    """NamedSharding of every Laplace parameter, shaped like the params dict."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        param_specs(config, mesh, rules),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def boxed_shardings(boxed, mesh: Mesh, rules=LOGICAL_RULES) -> dict:
    """NamedShardings of any Flax params tree whose leaves carry logical axes
    (`nn.LogicallyPartitioned`, e.g. `jax.eval_shape(model.init, ...)["params"]`)."""
    return jax.tree.map(
        lambda b: NamedSharding(mesh, logical_to_spec(b.names, b.value.shape, mesh, rules)),
        boxed,
        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned),
    )


def replicated_fallbacks(config: LaplaceConfig, mesh: Mesh, rules=LOGICAL_RULES) -> list[str]:
    """Parameters whose rule asks for a mesh axis they cannot take (the size does not divide),
    as `"path [shape]: [size] on fsdp=7"`; such a parameter is replicated, and Muon
    then orthogonalises it on every device."""
    table = dict(rules)
    shapes = traverse_util.flatten_dict(abstract_params(config), sep="/")
    axes = traverse_util.flatten_dict(param_logical_axes(config), sep="/")
    specs = traverse_util.flatten_dict(param_specs(config, mesh, rules), sep="/")

    def mesh_axes(rule):
        return {a for a in (rule if isinstance(rule, tuple) else (rule,)) if a in mesh.shape}

    out = []
    for path, names in axes.items():
        wanted = set().union(*(mesh_axes(table[a]) for a in names))
        taken = set().union(*(mesh_axes(e) for e in specs[path] if e is not None))
        for mesh_axis in sorted(wanted - taken):
            shape = shapes[path].shape
            sizes = [
                s for a, s in zip(names, shape, strict=True) if mesh_axis in mesh_axes(table[a])
            ]
            out.append(f"{path} {list(shape)}: {sizes} on {mesh_axis}={mesh.shape[mesh_axis]}")
    return out
