"""The state store's real tier (serve/state_store/tier.py) in the test's process, on the spec
vLLM's connector would give it, over host memory the test owns: tests/test_state_store.py (one
state group, pure Laplace) and tests/test_state_store_hybrid.py (state and attention groups)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

PURE = ("model.layers.0.mixer",)
HYBRID = ("model.layers.0.mixer", "model.layers.1.mixer", "model.layers.1.mixer.attn")


def make_tier(root: Path, page_bytes: int, capacity: int, chunks: int = 4, layers=PURE, block=32):
    """(tier, host [chunks, 4096 * k] int8): one group per name in `layers` (vLLM's group
    index = its position; a name ending in `.attn` is an attention group), each chunk one
    group's block of `page_bytes`, `block` tokens a block."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    from serve.state_store.spec import LaplaceStateSpec
    from serve.state_store.tier import StateFileTier

    row = -(-page_bytes // 4096) * 4096
    config = OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(block, (n,), i) for i, n in enumerate(layers)),
        worker_kv_bytes_per_block=page_bytes,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": chunks * row, "offload_prompt_only": False},
        engine_id="test",
        model=OffloadingModelConfig("tiny", "float32"),
        cache=OffloadingCacheConfig(block, 1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )
    host = np.zeros((chunks, row), np.int8)
    tier = StateFileTier(
        LaplaceStateSpec(config), memoryview(host), "StateFileTier", str(root), "f" * 64, capacity
    )
    return tier, host


def key(block_hash: bytes, group: int) -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(block_hash, group)


def store(tier, ctx, keys_ends_chunks, job_id: int = 0) -> None:
    """Offer (key, end token, chunk) triples to the tier as one store job (known to vLLM's
    request context first, as the scheduler records them)."""
    from vllm.v1.kv_offload.tiering.base import TransferJob

    for k, end, _ in keys_ends_chunks:
        ctx.set_offload_key_position(k, end)
    chunks = np.array([c for _, _, c in keys_ends_chunks])
    tier.submit_store(TransferJob(job_id, [k for k, _, _ in keys_ends_chunks], chunks, False, ctx))
    assert all(r.success for r in tier.get_finished_jobs())  # copied, done


def load(tier, keys, chunks, job_id: int = 99):
    """A promotion of `keys` into `chunks`: its JobResult."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    tier.submit_load(TransferJob(job_id, list(keys), np.array(chunks), True, ReqContext("load")))
    tier.drain_jobs()
    (result,) = tier.get_finished_jobs()
    return result
