"""The state store's offloading spec: vLLM's tiering spec with a worker that runs on CPU.

`OffloadingConnector` (vLLM's, unmodified) builds this spec by name (`spec_name` and
`spec_module_path` in `kv_connector_extra_config`) in the scheduler process and in the worker:

    scheduler: TieringOffloadingManager = host-memory primary tier (vLLM's, LRU, in a shared-
               memory file) + the secondary tiers of `secondary_tiers` (ours: `tier.StateFileTier`)
    worker:    HostStateWorker (`worker.py`): engine pages <-> the same shared-memory file

vLLM's `TieringOffloadingSpec` builds all of it but its worker, which needs CUDA or XPU.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from serve.state_store.worker import HostStateWorker


class LaplaceStateSpec(TieringOffloadingSpec):
    def __init__(self, config):
        super().__init__(config)
        if self.blocks_per_chunk != 1:
            raise ValueError(
                f"the state store keeps one block per chunk, got blocks_per_chunk="
                f"{self.blocks_per_chunk}: leave `block_size` out of kv_connector_extra_config"
            )

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not self._worker:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    def create_worker(self, kv_caches: CanonicalKVCaches) -> HostStateWorker:
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=0 if self.replicated_layout else self.config.parallel.rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return HostStateWorker(kv_caches, region)
        except Exception:
            region.cleanup()
            raise
