"""The state store's disk tier: two states of each finished request, one file each, LRU-capped.

A vLLM secondary tier (`SecondaryTierManager`, run by vLLM's `TieringOffloadingManager` in the
scheduler process, below its host-memory primary tier). What vLLM offers it, and what it does:

    lookup(key)          HIT when the key's file exists (any process may have written it). vLLM
                         looks up only a prompt's boundaries (those past what its own cache
                         holds, from the right): the furthest one asked is remembered as the
                         request's prompt end
    submit_store(keys)   a state the engine reached at a block boundary of a running request
                         (every 32 tokens of a reply too: `--prefix-cache-retention-interval`),
                         already in the primary tier: kept in one of the request's two slots,
                         the newest, and the newest at or before its prompt end (nothing is
                         written yet). A request vLLM looked nothing up for (the engine held
                         its whole prompt: the same prompt again) keeps the newest alone; its
                         prompt's state is on disk where the request that computed it kept it
    on_request_finished  the two slots (the prompt's last boundary, and the last boundary of
                         prompt and reply) are written, by one writer thread, as one file each
                         (`files.py`; one when they are the same state): a conversation's bytes
                         on disk grow with its turns, not its length. The next turn's prompt
                         always shares the first, whatever tokens its client's copy of the reply
                         becomes; it shares the second where the reply's text encodes to the
                         tokens the model generated
    submit_load(keys)    one reader thread fills the primary tier's chunk from the file; a file
                         that fails a check is removed with one warning and the job fails, so vLLM
                         counts a miss and the request computes its prefix instead

Capacity: `capacity_bytes` over the files of this store (every process that shares the folder
counts); past it the least recently used files go (a load touches its file). A write that fails
(a full disk, a folder made read-only) stops storing with one warning; serving goes on.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from serve.state_store import files
from serve.state_store.fingerprint import state_layout, store_fingerprint

logger = init_logger("vllm.laplace.state_store")  # under "vllm": printed as vLLM's own lines
STALE_TMP_S = 600  # a temporary file this old was left by a killed writer


def _conv_layout() -> str:
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    return str(get_conv_state_layout())


class StateFileTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.STORAGE  # hits are reported as source="disk"

    def __init__(
        self,
        offloading_spec,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        model_fingerprint: str,
        capacity_bytes: int,
        backpressure_detector=None,
    ):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        layout = state_layout(offloading_spec.config, _conv_layout())
        self.fingerprint = store_fingerprint(model_fingerprint, layout)
        self.root = Path(root_dir) / self.fingerprint.hex()[:16]
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.capacity = int(capacity_bytes)
        self._rows = primary_kv_view.cast("B")  # the primary tier's chunks, back to back
        config = offloading_spec.config  # a chunk's state bytes (the rest of a row is padding)
        self.state_bytes = config.worker_kv_bytes_per_block * config.parallel.world_size
        # req id -> its kept states: "newest" and "prompt", each (end token, key, state bytes)
        self._kept: dict[str, dict[str, tuple[int, OffloadKey, bytes]]] = {}
        self._prompt_end: dict[str, int] = {}  # req id -> the prompt's last reachable boundary
        self._finished: list[JobResult] = []
        self._lock = threading.Lock()  # _finished and _files, shared with the threads
        self._loads: set[Future] = set()
        self._writes: set[Future] = set()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="state-store-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="state-store-write")
        self._storing = True
        self._files = self._scan()  # path -> (bytes, last use)
        logger.info(
            "state store: %s (%d states, %.1f MiB of %.1f MiB; one state %.1f KiB)",
            self.root,
            len(self._files),
            sum(b for b, _ in self._files.values()) / 2**20,
            self.capacity / 2**20,
            self.state_bytes / 2**10,
        )

    # -- what is on disk ------------------------------------------------------------------------

    def _scan(self) -> dict[Path, tuple[int, float]]:
        """Every state file of this store (all writers), and stale temporary files removed."""
        found: dict[Path, tuple[int, float]] = {}
        now = time.time()
        for sub in os.scandir(self.root):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                try:
                    st = entry.stat()
                except FileNotFoundError:  # removed by another process meanwhile
                    continue
                if entry.name.endswith(files.SUFFIX):
                    found[Path(entry.path)] = (st.st_size, st.st_mtime)
                elif entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                    Path(entry.path).unlink(missing_ok=True)
        return found

    def _evict(self) -> None:
        """Least recently used files go until the store fits its capacity (writer thread)."""
        with self._lock:
            self._files = self._scan()
            total = sum(b for b, _ in self._files.values())
            for path, (size, _) in sorted(self._files.items(), key=lambda kv: kv[1][1]):
                if total <= self.capacity:
                    break
                path.unlink(missing_ok=True)
                del self._files[path]
                total -= size

    def _row(self, chunk) -> memoryview:
        """Chunk `chunk` of the primary tier: one sequence's state pages, every layer."""
        start = int(chunk) * self.block_size_bytes
        return self._rows[start : start + self.state_bytes]

    # -- vLLM's tier interface --------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when the key's file exists. Every key vLLM looks up is a prompt boundary (before
        the request stores anything): the furthest is kept as the request's prompt end, so that
        `submit_store` knows which offered state the next turn's prompt shares."""
        end = req_context.get_offload_key_position(key)
        req = req_context.req_id
        if end is not None and req not in self._kept:
            self._prompt_end[req] = max(end, self._prompt_end.get(req, 0))
        return LookupResult.HIT if files.state_path(self.root, key).is_file() else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Keep two of the request's states (by the token each ends at), writing nothing yet: the
        newest, and the newest at or before its prompt end, which the next turn's prompt shares
        however the reply's text is tokenised again."""
        ctx = job_metadata.req_context
        kept = self._kept.setdefault(ctx.req_id, {})
        prompt_end = self._prompt_end.get(ctx.req_id)
        for key, chunk in zip(job_metadata.keys, job_metadata.chunk_ids, strict=True):
            end = ctx.get_offload_key_position(key)  # None: unknown, taken as the newest
            state = None
            for slot, fits in (
                ("newest", True),
                ("prompt", end is not None and prompt_end is not None and end <= prompt_end),
            ):
                held = kept.get(slot)
                if fits and (held is None or end is None or end >= held[0]):
                    state = state or bytes(self._row(chunk))
                    kept[slot] = (end or 0, key, state)
        with self._lock:
            self._finished.append(JobResult(job_metadata.job_id, True))

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Write the request's kept states: at most two files a turn (one when its prompt's
        state is its newest)."""
        kept = self._kept.pop(req_context.req_id, {})
        self._prompt_end.pop(req_context.req_id, None)
        if not self._storing:
            return
        for _, key, state in {held[1]: held for held in kept.values()}.values():
            future = self._writer.submit(self._write, key, state)
            self._writes.add(future)
            future.add_done_callback(self._writes.discard)

    def _write(self, key: OffloadKey, state: bytes) -> None:
        path = files.state_path(self.root, key)
        if path.is_file():  # the same state: kept, made the newest
            os.utime(path)
            return
        if not self._storing:
            return
        try:
            size = files.write_state(path, self.fingerprint, key, state)
        except OSError as e:
            self._storing = False
            logger.warning(
                "state store: cannot write %s (%s); storing stopped, serving goes on", path, e
            )
            return
        with self._lock:
            self._files[path] = (size, time.time())
            over = sum(b for b, _ in self._files.values()) > self.capacity
        if over:
            self._evict()

    def submit_load(self, job_metadata: TransferJob) -> None:
        future = self._reader.submit(self._load, job_metadata)
        self._loads.add(future)
        future.add_done_callback(self._loads.discard)

    def _load(self, job: TransferJob) -> None:
        t0 = time.perf_counter()
        ok, nbytes = True, 0
        for key, chunk in zip(job.keys, job.chunk_ids, strict=True):
            path = files.state_path(self.root, key)
            out = self._row(chunk)
            try:
                files.read_state(path, self.fingerprint, key, out)
                os.utime(path)  # a use: the newest for the LRU
            except FileNotFoundError:  # evicted (here or by another process) since the lookup
                ok = False
            except (files.StateFileError, OSError) as e:
                ok = False
                path.unlink(missing_ok=True)
                logger.warning("state store: removed %s: %s; the prefix is recomputed", path, e)
            if not ok:
                break
            nbytes += out.nbytes
        result = JobResult(job.job_id, ok, None, time.perf_counter() - t0, nbytes)
        with self._lock:
            self._finished.append(result)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def has_pending_work(self) -> bool:
        return bool(self._loads)

    def drain_jobs(self) -> None:
        for future in list(self._loads) + list(self._writes):
            future.result()

    def shutdown(self) -> None:
        """Finish the writes in flight (a stopped server keeps its finished conversations)."""
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
