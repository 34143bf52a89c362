"""The worker half of the state store: copies state pages between the engine and host memory.

vLLM's offloading connector hands this worker jobs of the form "block b of every layer of group g
to chunk c of the host region" (a store) or the reverse (a load). vLLM's own worker for this
(`CPUOffloadingWorker`) drives CUDA or XPU streams and refuses other platforms; on vLLM's CPU
backend the engine's pages are already host memory, so a job is one `index_copy_` per tensor,
done when it is submitted. The host region is the same shared-memory file vLLM's tiering spec
creates (`SharedOffloadRegion`), so the scheduler process's tiers (`tier.py`) read and write
what this worker copies.

Inline copies are safe where vLLM's worker uses streams: a stored block is one the scheduler has
committed to its prefix cache and the next forward does not write, a block freed before its copy
is flushed by the connector first (`jobs_to_flush`), and a loaded block is not read until its
request leaves the waiting-for-remote state.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)


class HostStateWorker(OffloadingWorker):
    """Store: engine block -> host chunk; load: host chunk -> engine block (one block a chunk)."""

    def __init__(self, kv_caches: CanonicalKVCaches, mmap_region):
        # engine[t]: [num_blocks, page_bytes] int8, host[t]: [num_chunks, page_bytes] int8
        self._region = mmap_region
        self._engine: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        for t in kv_caches.tensors:
            self._engine.append(t.tensor.view(torch.int8).view(-1, t.page_size_bytes))
            self._host.append(mmap_region.create_next_worker_view(t.page_size_bytes))
        self._refs = kv_caches.group_data_refs  # per group: (tensor index, page bytes) refs
        self._finished: list[TransferResult] = []

    def _copy(self, job_id, engine_spec: GPULoadStoreSpec, host_spec, to_host: bool) -> bool:
        t0 = time.perf_counter()
        blocks = np.asarray(engine_spec.block_ids, np.int64)
        chunks = np.asarray(host_spec.block_ids, np.int64)
        if len(blocks) != len(chunks):  # one engine block per host chunk (blocks_per_chunk=1)
            raise ValueError(f"job {job_id}: {len(blocks)} blocks for {len(chunks)} chunks")
        nbytes, start = 0, 0
        for refs, size in zip(self._refs, engine_spec.group_sizes, strict=True):
            b = torch.from_numpy(blocks[start : start + size])
            c = torch.from_numpy(chunks[start : start + size])
            start += size
            for ref in refs:
                page = ref.page_size_bytes
                engine, host = self._engine[ref.tensor_idx], self._host[ref.tensor_idx]
                if to_host:
                    host[:, :page].index_copy_(0, c, engine[:, :page].index_select(0, b))
                else:
                    engine[:, :page].index_copy_(0, b, host[:, :page].index_select(0, c))
                nbytes += size * page
        self._finished.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec):
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        return self._copy(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec):
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        return self._copy(job_id, dst_spec, src_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every job is done when submitted

    def shutdown(self) -> None:
        self._host.clear()  # the region's views go before the region
        self._region.cleanup()
