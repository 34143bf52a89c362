"""`--state-dir`: the engine settings that turn the state store on, and the checks before it.

vLLM engine                                  why
--enable-prefix-caching, align mode, 32-token the states at block boundaries are what a
blocks                                        later prompt starts from (docs/design.md s10)
--prefix-cache-retention-interval B           the block size (`served_block_size`: 32 tokens,
                                              a hybrid's as vLLM raises it): vLLM offers the
                                              state of every block boundary, a reply's too (its
                                              default, 0, offers only the prompt's last: a
                                              reply would never be stored)
--kv-transfer-config: vLLM's OffloadingConnector with `spec.LaplaceStateSpec` (its host-
memory tier, `primary_bytes`) over `tier.StateFileTier` (`--state-dir`), prompt and reply alike
(`offload_prompt_only` false); a failed load is recomputed
--enable-prompt-tokens-details (server)       usage.prompt_tokens_details.cached_tokens
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

from laplace_spec.vllm_settings import kv_block_bytes

MIN_PRIMARY_STATES = 16  # the host-memory tier holds a state per running sequence, at least this
DEFAULT_CAPACITY = 16 * 2**30  # bytes on disk, or half the free space when that is less


class StateDirError(Exception):
    """--state-dir cannot be used (not a writable folder, or a model it cannot serve)."""


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '16G', '1.5GiB' -> bytes (K/M/G/T are powers of 1024)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = 1
    if t and t[-1] in "KMGT":
        scale = 1024 ** ("KMGT".index(t[-1]) + 1)
        t = t[:-1]
    try:
        value = float(t)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 16G, 512M, 1073741824)") from None
    if value <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return int(value * scale)


def prepare_state_dir(state_dir) -> Path:
    """Create the folder (readable by its owner only) and prove it takes a file: StateDirError
    naming the problem otherwise."""
    root = Path(state_dir).expanduser().resolve()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        probe = root / f".probe.{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise StateDirError(f"--state-dir {root}: not a writable folder ({e})") from None
    return root


def default_capacity(root: Path) -> int:
    """DEFAULT_CAPACITY, or half the free space of the folder's file system when less."""
    return min(DEFAULT_CAPACITY, shutil.disk_usage(root).free // 2)


def primary_bytes(cfg, max_num_seqs: int, max_model_len: int, block: int, kv_bytes: int) -> int:
    """The host-memory tier (in /dev/shm) between the engine and the files, for `cfg` (a
    LaplaceConfig) served with `block`-token blocks and keys and values of `kv_bytes`.

    Pure Laplace: max(MIN_PRIMARY_STATES, max_num_seqs) states, one per running sequence on its
    way to disk (a state offered to a full tier is not stored: the request's bundle then holds
    an earlier boundary). A hybrid (every chunk one layer's block, its state pages padded to
    it): one boundary of every group per running sequence, and the attention blocks of one
    max_model_len history, the most one promotion carries back from the files."""
    pad = 2 * 4096  # each chunk's alignment
    seqs = max(MIN_PRIMARY_STATES, max_num_seqs)
    if not cfg.attention_every:
        return seqs * (cfg.page_bytes_per_sequence() + pad)
    chunk = kv_block_bytes(cfg, block, kv_bytes) + pad
    history = cfg.n_attention_layers * math.ceil(max_model_len / block) * chunk
    return history + seqs * (cfg.n_layers + cfg.n_attention_layers) * chunk


def kv_transfer_config(root: Path, model_fp: str, capacity: int, primary: int) -> dict:
    """vLLM's --kv-transfer-config for the store (primary: `primary_bytes`)."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "spec_name": "LaplaceStateSpec",
            "spec_module_path": "serve.state_store.spec",
            "offload_prompt_only": False,
            "cpu_bytes_to_use": primary,
            "eviction_policy": "lru",
            "secondary_tiers": [
                {
                    "type": "StateFileTier",
                    "module_path": "serve.state_store.tier",
                    "root_dir": str(root),
                    "model_fingerprint": model_fp,
                    "capacity_bytes": int(capacity),
                }
            ],
        },
    }
