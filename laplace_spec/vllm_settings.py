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
