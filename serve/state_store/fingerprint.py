"""What makes a stored state valid for an engine: the model, and the layout of its state pages.

A state is the product of every weight and of the architecture, and it is laid out by the engine
(dtypes, the conv window's orientation, which layers in which group, which groups hold attention
blocks, how many bytes). The store keeps its files
under `--state-dir/<store fingerprint>/` and writes the fingerprint into each file's header, so a
store written by one model (or one layout) is never read by another:

    model fingerprint = sha256(config.json, canonical; every *.safetensors file, by name; the
                               served dtype; --vllm-arg dtype flags)   -- the adapter, at start
    store fingerprint = sha256(model fingerprint; the engine's state layout)   -- the tier

The layout record is built in the engine process (`state_layout`), where vLLM has chosen it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

_CHUNK = 1 << 24


def model_fingerprint(model_dir, dtype: str, engine_args=()) -> str:
    """sha256 (hex) of the exported folder's config, weights, the served dtype and the engine
    arguments that set the state pages' dtypes (vLLM's --mamba-*-dtype, given by --vllm-arg)."""
    folder = Path(model_dir)
    h = hashlib.sha256()
    config = json.loads((folder / "config.json").read_text())
    h.update(json.dumps(config, sort_keys=True).encode())
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights to fingerprint")
    for path in weights:
        h.update(path.name.encode())
        with open(path, "rb") as f:
            while block := f.read(_CHUNK):
                h.update(block)
    h.update(dtype.encode())
    for arg in sorted(a for a in engine_args if "dtype" in a):
        h.update(arg.encode())
    return h.hexdigest()


ATTENTION_LAYER_SUFFIX = ".attn"  # vLLM's `Attention` in a hybrid's attention layer (vllm_model)


def attention_groups(offloading_config) -> list[int]:
    """The KV-cache groups that hold attention blocks (a hybrid's): every layer in them is a
    vLLM `Attention`; the other groups hold state pages."""
    return [
        g.group_id
        for g in offloading_config.groups
        if all(name.endswith(ATTENTION_LAYER_SUFFIX) for name in g.layer_names)
    ]


def state_layout(offloading_config, conv_layout: str) -> dict:
    """The engine's pages as a record: bytes per block (which the state pages' dtypes change),
    each group's kind, layers and tokens per block, the model dtype, the conv window's
    orientation (the one change of layout that keeps the bytes)."""
    attention = attention_groups(offloading_config)
    return {
        "bytes_per_block": offloading_config.worker_kv_bytes_per_block,
        "groups": [
            {
                "kind": "attention" if g.group_id in attention else "state",
                "tokens_per_block": g.tokens_per_block,
                "layers": list(g.layer_names),
            }
            for g in offloading_config.groups
        ],
        "tokens_per_hash": offloading_config.cache.tokens_per_hash,
        "model_dtype": str(offloading_config.model.dtype),
        "conv_layout": conv_layout,
    }


def store_fingerprint(model_fp: str, layout: dict) -> bytes:
    """The 32 bytes every file of this store carries (its folder: their first 8, as hex)."""
    h = hashlib.sha256(model_fp.encode())
    h.update(json.dumps(layout, sort_keys=True).encode())
    return h.digest()
