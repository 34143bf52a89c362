"""The vLLM settings an export carries, whatever the platform: `vllm_serve.yaml`, vLLM's own
`--config` file, written beside the model (`export/`), so that

    vllm serve FOLDER --config FOLDER/vllm_serve.yaml
    python -m serve.vllm_adapter --model FOLDER

start the engine from one source of settings (the adapter reads the file; the platform's own
defaults, eager on a CPU or CUDA graphs on a GPU, are the adapter's and vLLM's, not the file's:
serve/vllm_adapter.py). No vLLM: the exporter writes it without one.

    dtype                  the export's (vLLM's "auto" would serve an fp32 export in fp16 on a GPU)
    enable-prefix-caching  false: one state page per sequence unless a server asks for the cache
    block-size             a hybrid's: PREFIX_BLOCK_SIZE tokens, from which vLLM raises its KV
                           block until a block's keys and values take one state page's bytes
                           (docs/design.md s13.4); a pure model's pages have no block size
"""

from __future__ import annotations

import math
from pathlib import Path

from laplace_spec.config import LaplaceConfig

SETTINGS_FILE = "vllm_serve.yaml"
PREFIX_BLOCK_SIZE = 32  # tokens per prefix-cache block (state checkpoint granularity), s10
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "float32": "float32", "bfloat16": "bfloat16"}


def vllm_settings(cfg: LaplaceConfig, dtype: str) -> dict:
    """The settings of an export of `cfg` in `dtype` (fp32 / bf16), as vLLM's flags name them."""
    settings = {"dtype": DTYPES[dtype], "enable-prefix-caching": False}
    if cfg.attention_every:
        settings["block-size"] = PREFIX_BLOCK_SIZE
    return settings


def kv_block_bytes(cfg: LaplaceConfig, block: int, kv_bytes: int) -> int:
    """One attention layer's keys and values for `block` tokens on vLLM's paged KV cache (every
    head at `kv_page_head_size`, `kv_bytes` each): a hybrid's chunk, to which vLLM pads each
    layer's state page (docs/design.md s13.4)."""
    return block * 2 * cfg.n_heads * cfg.kv_page_head_size * kv_bytes


def served_block_size(cfg: LaplaceConfig, kv_bytes: int) -> int:
    """Tokens per KV block and per stored state boundary of `cfg` served with prefix caching on
    vLLM's CPU backend: PREFIX_BLOCK_SIZE for pure Laplace; for a hybrid, vLLM's raised block,
    the smallest multiple of PREFIX_BLOCK_SIZE (itself a multiple of the CPU attention kernel's
    32) whose keys and values in one attention layer (`kv_bytes` each) take at least one layer's
    fp32 state page, its GLA matrices and W - 1 conv inputs (docs/design.md s13.4): 32 for
    `small`, 64 for a 3B hybrid in fp32."""
    if not cfg.attention_every:
        return PREFIX_BLOCK_SIZE
    page = (math.prod(cfg.gla_state_shape) + cfg.page_conv_window * cfg.d_model) * 4
    return PREFIX_BLOCK_SIZE * math.ceil(page / kv_block_bytes(cfg, PREFIX_BLOCK_SIZE, kv_bytes))


def write_settings(folder: Path, settings: dict) -> Path:
    """FOLDER/vllm_serve.yaml, a comment naming the command that reads it, then the settings."""
    import yaml

    name = Path(folder).name
    head = f"# vLLM's settings for this export: vllm serve {name} --config {name}/{SETTINGS_FILE}\n"
    path = Path(folder) / SETTINGS_FILE
    path.write_text(head + yaml.safe_dump(settings, sort_keys=False))
    return path


def read_settings(folder: Path) -> dict:
    """FOLDER/vllm_serve.yaml's settings ({} for an export written before it)."""
    import yaml

    path = Path(folder) / SETTINGS_FILE
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
