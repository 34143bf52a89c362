"""Which optimizer each parameter gets, whether it decays, and the dtype FSDP gathers it in.

One row per parameter of docs/parameters.md, keyed by its path with the layer index removed
(`layer_3/w12/kernel` -> `layer/w12/kernel`). The optimizer (laplace_jax/optim.py), the FSDP
gather (laplace_jax/fsdp.py) and the accounting all read this table; nothing else matches paths.

- `optimizer`: "muon" for the 2-D matrices of the decoder layers, "adamw" for everything else
  (the embedding and the LM head are 2-D too, but go to AdamW);
- `weight_decay`: decoupled weight decay applies (matrices and the embedding; not norm scales,
  biases or the augmentation balance);
- `gather_in_compute_dtype`: FSDP casts the shard to the compute dtype before its all_gather (the
  model multiplies it in that dtype anyway); the others travel and are used in fp32.

Like the rest of laplace_spec this imports neither JAX nor PyTorch.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    optimizer: str  # "muon" | "adamw"
    weight_decay: bool
    gather_in_compute_dtype: bool


MUON = ParamGroup("muon", weight_decay=True, gather_in_compute_dtype=True)
ADAMW_MATRIX = ParamGroup("adamw", weight_decay=True, gather_in_compute_dtype=True)
ADAMW_CONV = ParamGroup("adamw", weight_decay=True, gather_in_compute_dtype=False)
ADAMW_VECTOR = ParamGroup("adamw", weight_decay=False, gather_in_compute_dtype=False)

PARAM_GROUPS: dict[str, ParamGroup] = {
    "embed/embedding": ADAMW_MATRIX,
    "layer/ln_1/scale": ADAMW_VECTOR,
    "layer/ln_0/scale": ADAMW_VECTOR,  # a hybrid's attention layers reading x_0 (s13.5)
    "layer/conv/kernel": ADAMW_CONV,  # [D, W], applied in fp32 by the causal conv
    "layer/conv/bias": ADAMW_VECTOR,
    "layer/qkvg/kernel": MUON,
    "layer/aug_balance": ADAMW_VECTOR,
    "layer/head_norm/scale": ADAMW_VECTOR,
    "layer/out/kernel": MUON,
    "layer/branch/gain": ADAMW_VECTOR,  # w of a GLA branch's s (1 + w) (s13.5)
    "layer/ln_2/scale": ADAMW_VECTOR,
    "layer/w12/kernel": MUON,
    "layer/w3/kernel": MUON,
    "ln_f/scale": ADAMW_VECTOR,
    "lm_head/kernel": ADAMW_MATRIX,
}


def table_key(path: str) -> str:
    """`layer_3/w12/kernel` -> `layer/w12/kernel`; top-level paths are unchanged."""
    head, _, rest = path.partition("/")
    if head.startswith("layer_") and head[len("layer_") :].isdigit() and rest:
        return f"layer/{rest}"
    return path


def param_group(path: str) -> ParamGroup:
    """The row of the parameter at `path`; a path the table does not know is an error."""
    key = table_key(path)
    if key not in PARAM_GROUPS:
        raise KeyError(f"parameter {path!r} is not in laplace_spec.param_groups.PARAM_GROUPS")
    return PARAM_GROUPS[key]


def is_muon_path(path: str) -> bool:
    """`layer_3/w12/kernel` -> True; `embed/embedding`, `lm_head/kernel` -> False."""
    return table_key(path) in PARAM_GROUPS and PARAM_GROUPS[table_key(path)].optimizer == "muon"
