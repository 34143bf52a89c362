"""The state store's disk tier: a conversation's states per turn and, for a hybrid, its
attention blocks once each; LRU-capped by bundle.

A vLLM secondary tier (`SecondaryTierManager`, run by vLLM's `TieringOffloadingManager` in the
scheduler process, below its host-memory primary tier). vLLM keys what it offers by the block
hash of the prefix and a KV-cache group; the groups of a hybrid are of two kinds:

    state groups       every layer's state pages (GLA matrices, conv windows): one page per
                       group at a block boundary stands for the whole prefix
    attention groups   a hybrid's attention layers' KV blocks: the prefix needs every block
                       (vLLM's `Attention` layers, named `*.attn` by serve/vllm_model.py)

What vLLM offers, and what the tier does (docs/design.md s10.1):

    on_new_request       a hybrid's requests ask for vLLM's REQUEST_LEVEL policy: every block of
                         the request is offered, those it loaded or found cached too, so the tier
                         knows each turn's whole chain of attention blocks
    lookup(key)          an attention key: HIT when its block file exists; a state key: HIT when
                         the bundle of its boundary exists (any process may have written either).
                         vLLM scans the attention groups from the left and the state groups from
                         the right: a hit is a boundary whose blocks and bundle are all there.
                         On the request's first lookup, its known keys end at its prompt's last
                         boundary: kept as the prompt end
    submit_store(keys)   attention blocks are written at once, each once (a block on disk is
                         never written again: a prompt shared by many conversations is stored
                         once); state pages are kept in memory, by boundary
    on_request_finished  two bundles are written (the prompt's last complete boundary and the
                         newest; one when they are the same), each with the list of attention
                         blocks it needs, after those blocks (one writer thread, in order; a bundle
                         whose blocks are not all on disk is not written): a lookup never finds a
                         boundary with a part missing. The next turn's prompt always shares the
                         first, whatever tokens its client's copy of the reply becomes; it shares
                         the second where the reply's text encodes to the tokens generated
    submit_load(keys)    one reader thread fills the primary tier's chunks from the files and
                         reports the keys that arrived: a file that fails a check is removed with
                         one warning and the hit ends before it (vLLM computes the rest)

Capacity: `capacity_bytes` over the files of this store (every process that shares the folder
counts). Past it the least recently used bundles go (a load touches its bundle), and with each
the blocks no other bundle needs; a block is never removed while a bundle needs it, nor while
a request of this process is storing it (another process's unclaimed blocks go once they are
ORPHAN_S old). A race between processes costs a hit, never a wrong token: every key is a hash
of the whole prefix. A write that fails (a full disk, a folder made read-only) stops storing
with one warning; serving goes on.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from serve.state_store import files
from serve.state_store.fingerprint import attention_groups, state_layout, store_fingerprint

logger = init_logger("vllm.laplace.state_store")  # under "vllm": printed as vLLM's own lines
STALE_TMP_S = 600  # a temporary file this old was left by a killed writer
ORPHAN_S = 600  # a block no bundle needs, this old, was left by a request that never finished


def _conv_layout() -> str:
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    return str(get_conv_state_layout())


def _known_positions(ctx: ReqContext) -> dict:
    """vLLM's record of the end token of every key of the request it has hashed so far."""
    return getattr(ctx, "_offload_key_positions", {})


@dataclass
class _Request:
    """What one running request has offered: its attention blocks by (end token, group), its
    state pages by boundary ({group: page}), each boundary's block hash."""

    prompt_end: int | None = None
    blocks: dict[tuple[int, int], OffloadKey] = field(default_factory=dict)
    states: dict[int, dict[int, bytes]] = field(default_factory=dict)
    hashes: dict[int, bytes] = field(default_factory=dict)


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
        config = offloading_spec.config
        layout = state_layout(config, _conv_layout())
        self.fingerprint = store_fingerprint(model_fingerprint, layout)
        self.root = Path(root_dir) / self.fingerprint.hex()[:16]
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.capacity = int(capacity_bytes)
        self._rows = primary_kv_view.cast("B")  # the primary tier's chunks, back to back
        # a chunk's bytes: one block of one group (the rest of a row is padding)
        self.page_bytes = config.worker_kv_bytes_per_block * config.parallel.world_size
        self.attention = frozenset(attention_groups(config))
        self.state_groups = tuple(
            g.group_id for g in config.groups if g.group_id not in self.attention
        )
        self.tokens = {g.group_id: g.tokens_per_block for g in config.groups}  # per chunk
        self._requests: dict[str, _Request] = {}
        self._finished: list[JobResult] = []
        self._lock = threading.Lock()  # _finished, _files and _needs, shared with the threads
        self._loads: set[Future] = set()
        self._writes: set[Future] = set()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="state-store-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="state-store-write")
        self._storing = True
        self._needs: dict[Path, frozenset[Path]] = {}  # a bundle -> the block files it needs
        self._files = self._scan()  # path -> (bytes, last use)
        logger.info(
            "state store: %s (%d files, %.1f MiB of %.1f MiB; a state bundle %.1f KiB%s)",
            self.root,
            len(self._files),
            sum(b for b, _ in self._files.values()) / 2**20,
            self.capacity / 2**20,
            self.page_bytes * len(self.state_groups) / 2**10,
            f", an attention block {self.page_bytes / 2**10:.1f} KiB" if self.attention else "",
        )

    # -- what is on disk ------------------------------------------------------------------------

    def _scan(self) -> dict[Path, tuple[int, float]]:
        """Every file of this store (all writers), and stale temporary files removed."""
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
                if entry.name.endswith((files.SUFFIX, files.BLOCK_SUFFIX)):
                    found[Path(entry.path)] = (st.st_size, st.st_mtime)
                elif entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                    Path(entry.path).unlink(missing_ok=True)
        return found

    def _needed_blocks(self, bundle: Path) -> frozenset[Path]:
        """The block files a bundle needs (read once; an unreadable bundle needs none)."""
        if bundle not in self._needs:
            try:
                needs = files.read_needs(bundle, self.fingerprint)
            except (OSError, files.StateFileError):
                needs = b""
            self._needs[bundle] = frozenset(self._block_paths(needs, len(bundle.stem) // 2))
        return self._needs[bundle]

    def _block_paths(self, needs: bytes, hash_bytes: int) -> list[Path]:
        """The block files a bundle's list of needed keys names (each key: a block hash of
        `hash_bytes`, then the group index)."""
        width = hash_bytes + 4
        return [
            files.block_path(self.root, needs[i : i + width]) for i in range(0, len(needs), width)
        ]

    def _evict(self) -> None:
        """Least recently used bundles go, each with the blocks no other bundle needs, until the
        store fits its capacity; first, blocks no one has claimed for ORPHAN_S (writer thread)."""
        with self._lock:
            self._files = found = self._scan()
            bundles = [p for p in found if p.suffix == files.SUFFIX]
            self._needs = {p: n for p, n in self._needs.items() if p in found}
            refs = Counter(b for p in bundles for b in self._needed_blocks(p))
            storing = {  # the blocks this process's running requests may yet need (snapshots:
                # the scheduler's thread adds to these dicts meanwhile)
                files.block_path(self.root, k)
                for r in list(self._requests.values())
                for k in list(r.blocks.values())
            }
            total = sum(size for size, _ in found.values())
            now = time.time()
            for path, (_, mtime) in list(found.items()):
                if path.suffix == files.BLOCK_SUFFIX and not refs[path] and path not in storing:
                    if now - mtime > ORPHAN_S:
                        total -= self._remove(path)
            for bundle in sorted(bundles, key=lambda p: found[p][1]):
                if total <= self.capacity:
                    break
                total -= self._remove(bundle)
                for block in self._needs.pop(bundle, ()):
                    refs[block] -= 1
                    if refs[block] <= 0 and block not in storing and block in self._files:
                        total -= self._remove(block)

    def _remove(self, path: Path) -> int:
        """Delete one file (caller holds the lock); its bytes."""
        path.unlink(missing_ok=True)
        return self._files.pop(path, (0, 0))[0]

    def _row(self, chunk) -> memoryview:
        """Chunk `chunk` of the primary tier: one block of one group."""
        start = int(chunk) * self.block_size_bytes
        return self._rows[start : start + self.page_bytes]

    # -- vLLM's tier interface --------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        if self.attention:
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    def _request(self, ctx: ReqContext) -> _Request:
        """The request's record; made on first contact, when vLLM has hashed its prompt and no
        more: its known keys end at the prompt's last boundary."""
        req = self._requests.get(ctx.req_id)
        if req is None:
            req = self._requests[ctx.req_id] = _Request()
            req.prompt_end = max(_known_positions(ctx).values(), default=None)
        return req

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when the key's file exists: its block, or the bundle of its boundary."""
        self._request(req_context)
        if get_offload_group_idx(key) in self.attention:
            path = files.block_path(self.root, key)
        else:
            path = files.state_path(self.root, get_offload_block_hash(key))
        return LookupResult.HIT if path.is_file() else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Write the attention blocks not on disk yet; keep the state pages by boundary (the
        request's newest complete boundary, its prompt's, and any newer one still filling)."""
        ctx = job_metadata.req_context
        req = self._request(ctx)
        for key, chunk in zip(job_metadata.keys, job_metadata.chunk_ids, strict=True):
            end = ctx.get_offload_key_position(key)  # None: unknown, not kept
            group = get_offload_group_idx(key)
            if group in self.attention:
                if end is not None:
                    req.blocks[(end, group)] = key
                path = files.block_path(self.root, key)
                if self._storing and not path.is_file():
                    self._submit_write(self._write, path, key, bytes(self._row(chunk)))
            elif end is not None:
                req.states.setdefault(end, {})[group] = bytes(self._row(chunk))
                req.hashes[end] = get_offload_block_hash(key)
        self._keep_needed_states(req)
        with self._lock:
            self._finished.append(JobResult(job_metadata.job_id, True))

    def _complete(self, req: _Request) -> list[int]:
        """The boundaries at which every state group's page is kept, oldest first."""
        return sorted(e for e, pages in req.states.items() if len(pages) == len(self.state_groups))

    def _bundle_ends(self, req: _Request) -> set[int]:
        """The boundaries a finished request writes: its newest complete one, and the newest
        complete one at or before its prompt end."""
        complete = self._complete(req)
        ends = set(complete[-1:])
        if req.prompt_end is not None:
            ends.update([e for e in complete if e <= req.prompt_end][-1:])
        return ends

    def _keep_needed_states(self, req: _Request) -> None:
        keep = self._bundle_ends(req)
        newest = max(keep, default=-1)
        for end in [e for e in req.states if e not in keep and e < newest]:
            del req.states[end]

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Write the request's bundles (at most two a turn), each after the blocks it needs."""
        req = self._requests.pop(req_context.req_id, None)
        if req is None or not self._storing:
            return
        for end in sorted(self._bundle_ends(req)):
            needs = [
                req.blocks.get((i, g))
                for g in sorted(self.attention)
                for i in range(self.tokens[g], end + 1, self.tokens[g])
            ]
            if None in needs:  # an attention block was never offered: no bundle (a lost hit)
                logger.debug("state store: %s's boundary %d lacks a block", req_context.req_id, end)
                continue
            payload = b"".join(req.states[end][g] for g in self.state_groups)
            path = files.state_path(self.root, req.hashes[end])
            self._submit_write(self._write, path, req.hashes[end], payload, b"".join(needs))

    def _submit_write(self, fn, *args) -> None:
        future = self._writer.submit(fn, *args)
        self._writes.add(future)
        future.add_done_callback(self._writes.discard)

    def _write(self, path: Path, key: bytes, payload: bytes, needs: bytes = b"") -> None:
        if path.is_file():  # the same state or block: kept, made the newest
            os.utime(path)
            return
        if not self._storing:
            return
        blocks = self._block_paths(needs, len(key))
        if not all(b.is_file() for b in blocks):  # a block's write failed or was evicted
            return
        try:
            size = files.write_state(path, self.fingerprint, key, payload, needs)
        except OSError as e:
            self._storing = False
            logger.warning(
                "state store: cannot write %s (%s); storing stopped, serving goes on", path, e
            )
            return
        with self._lock:
            self._files[path] = (size, time.time())
            if path.suffix == files.SUFFIX:
                self._needs[path] = frozenset(blocks)
            over = sum(b for b, _ in self._files.values()) > self.capacity
        if over:
            self._evict()

    def submit_load(self, job_metadata: TransferJob) -> None:
        future = self._reader.submit(self._load, job_metadata)
        self._loads.add(future)
        future.add_done_callback(self._loads.discard)

    def _load(self, job: TransferJob) -> None:
        """Fill each key's chunk from its file; the keys that arrived are reported (vLLM's hit
        then ends before the first that did not)."""
        t0 = time.perf_counter()
        arrived, nbytes = [], 0
        bundles: dict[bytes, bytearray | None] = {}  # a bundle read once per job
        for key, chunk in zip(job.keys, job.chunk_ids, strict=True):
            group, out = get_offload_group_idx(key), self._row(chunk)
            if group in self.attention:
                ok = self._read(files.block_path(self.root, key), key, out)
            else:
                block_hash = get_offload_block_hash(key)
                if block_hash not in bundles:
                    payload = bytearray(self.page_bytes * len(self.state_groups))
                    path = files.state_path(self.root, block_hash)
                    bundles[block_hash] = payload if self._read(path, block_hash, payload) else None
                payload = bundles[block_hash]
                ok = payload is not None
                if ok:
                    i = self.state_groups.index(group) * self.page_bytes
                    out[:] = payload[i : i + self.page_bytes]
            if ok:
                arrived.append(key)
                nbytes += out.nbytes
        every = len(arrived) == len(job.keys)
        result = JobResult(
            job.job_id, every, None if every else arrived or None, time.perf_counter() - t0, nbytes
        )
        with self._lock:
            self._finished.append(result)

    def _read(self, path: Path, key: bytes, out) -> bool:
        """Fill `out` from one file: False when it is gone or damaged (then removed, with one
        warning line)."""
        try:
            files.read_state(path, self.fingerprint, key, out)
            os.utime(path)  # a use: the newest for the LRU
            return True
        except FileNotFoundError:  # evicted (here or by another process) since the lookup
            return False
        except (files.StateFileError, OSError) as e:
            path.unlink(missing_ok=True)
            logger.warning("state store: removed %s: %s; the prefix is recomputed", path, e)
            return False

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
