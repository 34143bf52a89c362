"""The state store for hybrids (`--state-dir`, serve/state_store/): attention blocks stored once
each, a turn's state groups as bundles that list the blocks they need.

On the real tier and real files without an engine (tests/tier_helpers.py; the groups of the tiny
hybrid: two state groups, one attention group): what a turn leaves, a block shared by two
conversations written once, a damaged block, bundle or single page (the load reports the keys
that arrived, the file is removed with one warning), eviction that keeps a block another bundle
needs. Then real servers on one folder (tests/shared_fixtures.py, started early): a hybrid
conversation resumed after a SIGKILL on another server's two replicas, branched from its first
turn, and recomputed from an earlier turn past a damaged block, each turn's greedy tokens the
PyTorch model's.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import numpy as np
import pytest
from tier_helpers import HYBRID, key, load, make_tier, store

from serve.state_store import files

PAGE, B = 3000, 32  # a chunk's bytes; tokens per block


def h(name: str, i: int) -> bytes:
    """Conversation `name`'s block hash at its i-th boundary (i B tokens)."""
    return f"{name}{i}".encode().ljust(32, b".")


def offer_turn(tier, ctx, name, blocks, states, host, first_chunk=0):
    """A turn as vLLM offers it: attention blocks at each of `blocks` (their boundaries, in
    blocks; group 2), state pages of groups 0 and 1 at each of `states`; every chunk filled
    with its own byte."""
    offers, chunk = [], first_chunk
    for i in blocks:
        offers.append((key(h(name, i), 2), i * B, chunk))
        chunk += 1
    for i in states:
        offers += [(key(h(name, i), g), i * B, chunk + g) for g in (0, 1)]
        chunk += 2
    for _, _, c in offers:
        host[c, :PAGE] = c + 1
    store(tier, ctx, offers)
    return {k: c for k, _, c in offers}


def kv_files(root) -> set:
    return set(root.rglob(f"*{files.BLOCK_SUFFIX}"))


def bundles(root) -> set:
    return set(root.rglob(f"*{files.SUFFIX}"))


def test_a_hybrid_turn_stores_each_block_once_and_two_bundles(tmp_path):
    from vllm.v1.kv_offload.base import LookupResult, OffloadPolicy, ReqContext

    tier, host = make_tier(tmp_path, PAGE, 1 << 30, chunks=16, layers=HYBRID)
    ctx = ReqContext("a")
    assert tier.on_new_request(ctx).policy == OffloadPolicy.REQUEST_LEVEL  # the whole chain
    for i in (1, 2, 3):  # the prompt (100 tokens): its blocks are hashed when vLLM first asks
        for g in (0, 1, 2):
            ctx.set_offload_key_position(key(h("a", i), g), i * B)
    chunks = offer_turn(tier, ctx, "a", [1, 2, 3], [3], host)  # the prompt's
    chunks |= offer_turn(tier, ctx, "a", [4], [4], host, first_chunk=5)  # the reply's
    tier.on_request_finished(ctx)
    tier.drain_jobs()
    assert len(kv_files(tmp_path)) == 4 and len(bundles(tmp_path)) == 2  # prompt's and newest
    needs = files.read_needs(files.state_path(tier.root, h("a", 3)), tier.fingerprint)
    assert needs == b"".join(key(h("a", i), 2) for i in (1, 2, 3))
    hit = lambda i, g: tier.lookup(key(h("a", i), g), ctx) == LookupResult.HIT  # noqa: E731
    assert [hit(i, 2) for i in (1, 2, 3, 4)] == [True] * 4
    assert [hit(i, g) for i in (2, 3, 4) for g in (0, 1)] == [False, False, True, True, True, True]
    # the promotion of the newest boundary: every block and both state pages, as offered
    wanted = [key(h("a", i), 2) for i in (1, 2, 3, 4)] + [key(h("a", 4), g) for g in (0, 1)]
    host[:] = 0
    assert load(tier, wanted, list(range(6))).success
    assert [int(host[c, 0]) for c in range(6)] == [chunks[k] + 1 for k in wanted]
    assert (host[:6, :PAGE] == host[:6, :1]).all() and not host[:6, PAGE:].any()

    # another conversation with the same first two blocks: they are not written again
    written = {p: p.stat().st_mtime_ns for p in kv_files(tmp_path)}
    ctx = ReqContext("b")
    offer_turn(tier, ctx, "a", [1, 2], [], host)
    offer_turn(tier, ctx, "b", [3], [3], host, first_chunk=2)
    tier.on_request_finished(ctx)
    tier.drain_jobs()
    assert {p: p.stat().st_mtime_ns for p in written} == written
    assert len(kv_files(tmp_path)) == 5 and len(bundles(tmp_path)) == 3
    tier.shutdown()


def test_a_damaged_block_bundle_or_page_ends_the_hit_there(tmp_path, caplog):
    """A promotion reports the keys that arrived (vLLM's hit then ends before the first that
    did not); each damaged file is removed with one warning line."""
    from vllm.v1.kv_offload.base import ReqContext

    tier, host = make_tier(tmp_path, PAGE, 1 << 30, chunks=16, layers=HYBRID)
    ctx = ReqContext("a")
    offer_turn(tier, ctx, "a", [1, 2], [2], host)  # the prompt, 2 blocks: its bundle
    offer_turn(tier, ctx, "a", [3, 4], [4], host, first_chunk=4)  # and the newest
    tier.on_request_finished(ctx)
    tier.drain_jobs()
    caplog.set_level("WARNING", logger="vllm.laplace.state_store")

    def flip(path, at):
        data = bytearray(path.read_bytes())
        data[at] ^= 0xFF
        path.write_bytes(bytes(data))

    block = files.block_path(tier.root, key(h("a", 2), 2))  # mid-chain
    flip(block, -100)
    wanted = [key(h("a", i), 2) for i in (1, 2, 3, 4)] + [key(h("a", 4), g) for g in (0, 1)]
    result = load(tier, wanted, list(range(6)))
    assert not result.success and set(result.successful_keys) == set(wanted) - {wanted[1]}
    assert not block.exists()
    newest = files.state_path(tier.root, h("a", 4))
    newest.write_bytes(newest.read_bytes()[:-10])  # a truncated bundle
    result = load(tier, [key(h("a", 4), g) for g in (0, 1)], [0, 1])
    assert not result.success and result.successful_keys is None and not newest.exists()
    older = files.state_path(tier.root, h("a", 2))
    flip(older, -PAGE - 10)  # one byte of group 0's page: the bundle is one whole
    result = load(tier, [key(h("a", 2), 1)], [0])
    assert not result.success and not older.exists()
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 3, warned
    assert "checksum" in warned[0] and "truncated payload" in warned[1], warned
    assert "checksum" in warned[2], warned
    tier.shutdown()


def test_eviction_goes_by_bundle_and_keeps_a_block_another_bundle_needs(tmp_path):
    """Three conversations, the first two sharing their first block, under a capacity that
    holds two: the least recently used bundle goes with the block only it needs; the shared
    block stays."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    block_file = 64 + 36 + PAGE
    bundle_file = 64 + 32 + 2 * 36 + 2 * PAGE
    tier, host = make_tier(tmp_path, PAGE, 25000, chunks=16, layers=HYBRID)
    for name, first in (("a", "a"), ("b", "a"), ("c", "c")):
        ctx = ReqContext(name)
        offer_turn(tier, ctx, first, [1], [], host)
        offer_turn(tier, ctx, name, [2], [2], host, first_chunk=1)
        tier.on_request_finished(ctx)
        tier.drain_jobs()
        time.sleep(0.02)
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert on_disk == 4 * block_file + 2 * bundle_file <= 25000  # a's bundle and block 2 went
    ctx = ReqContext("x")
    hit = lambda n, i, g: tier.lookup(key(h(n, i), g), ctx) == LookupResult.HIT  # noqa: E731
    assert hit("a", 1, 2) and hit("b", 2, 0) and hit("b", 2, 2) and hit("c", 2, 0)
    assert not hit("a", 2, 0) and not hit("a", 2, 2)
    tier.shutdown()


# ---- real servers: the tiny hybrid (a GLA layer, then attention) on one folder ---------------

MESSAGE, REPLY = 40, 40  # prompts end mid-block; a reply crosses a block boundary


def boundary(total: int) -> int:
    """The newest bundle a finished request leaves: its last block boundary before its last
    token (the last token is sampled, never computed through)."""
    return (total - 1) // B * B


def turn(base: str, history: list[int], rng, rank: int | None = None):
    """history + a new message, greedy, through the OpenAI client: (prompt, reply, cached)."""
    from openai import OpenAI

    prompt = history + rng.integers(3, 300, MESSAGE).tolist()
    assert len(prompt) % B  # the prompt ends mid-block
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}  # vLLM's replica
    out = OpenAI(base_url=f"{base}/v1", api_key="none").completions.create(
        model="hybrid",
        prompt=prompt,
        max_tokens=REPLY,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
        extra_headers=headers,
        timeout=120,
    )
    cached = out.usage.prompt_tokens_details.cached_tokens
    return prompt, out.choices[0].token_ids, cached


def settled(root, count: int, timeout: float = 20) -> None:
    """Wait until the store holds `count` bundles (the writer thread runs after the reply)."""
    deadline = time.monotonic() + timeout
    while len(bundles(root)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(bundles(root)) == count


@pytest.fixture(scope="module")
def hybrid_torch(tiny_hybrid_export):
    from serve.modeling_laplace import LaplaceForCausalLM

    return LaplaceForCausalLM.from_exported(tiny_hybrid_export[2])


def test_a_hybrid_conversation_resumes_across_a_sigkill_replicas_branches_and_damage(
    hybrid_store_server, hybrid_replica_server, hybrid_state_dir, hybrid_torch, tiny_hybrid_export
):
    from shared_fixtures import descendants

    from serve.generation import greedy_generate

    def reference(prompt):
        return greedy_generate(hybrid_torch, [prompt], REPLY)[0]

    rng = np.random.default_rng(3)
    (base_a, server_a), (base_b, server_b) = hybrid_store_server, hybrid_replica_server
    history, histories, prompts, new_blocks, ends = [], [], [], [], []
    for k in range(4):  # turns 1-4 on the one-engine server
        before = kv_files(hybrid_state_dir)
        prompt, reply, cached = turn(base_a, history, rng)
        assert reply == reference(prompt), k
        assert cached == (boundary(len(history)) if history else 0), k  # the engine's cache
        history = prompt + reply
        histories.append(history)
        prompts.append(prompt)
        if k < 3:
            ends += sorted({boundary(len(prompt)), boundary(len(history))})
            settled(hybrid_state_dir, len(ends))
            made = kv_files(hybrid_state_dir) - before  # in the order written: by position
            new_blocks.append(sorted(made, key=lambda p: p.stat().st_mtime_ns))
            three_turns = bundles(hybrid_state_dir)
    # the bytes: a file per attention block, written once; two bundles a turn, each its state
    # pages and the names of the blocks it needs (the tiny hybrid: a group per layer)
    cfg = tiny_hybrid_export[0]
    page = B * 2 * cfg.n_heads * cfg.kv_page_head_size * 4  # a block of keys and values, fp32
    assert [len(b) for b in new_blocks] == [
        (boundary(len(h)) - (boundary(len(g)) if g else 0)) // B
        for g, h in zip([[], *histories[:2]], histories[:3], strict=True)
    ]
    assert all(p.stat().st_size == 64 + 36 + page for b in new_blocks for p in b)
    sizes = [p.stat().st_size - 64 - 32 - cfg.n_layers * page for p in three_turns]
    assert sorted(s // 36 * B for s in sizes) == ends and all(s % 36 == 0 for s in sizes)

    # killed with SIGKILL right after turn 4's reply, its files written or not
    for pid in [*descendants(server_a.proc.pid), server_a.proc.pid]:
        os.kill(pid, signal.SIGKILL)
    assert server_a.proc.wait(timeout=30) == -signal.SIGKILL
    # turn 5 on replica 0 of the other server: from the newest whole bundle on disk
    prompt, reply, cached = turn(base_b, histories[3], rng, rank=0)
    kept = (boundary(len(histories[3])), boundary(len(prompts[3])), boundary(len(histories[2])))
    assert cached in kept and reply == reference(prompt)
    histories.append(prompt + reply)

    # a damaged block in turn 3's reply; turn 3 branched on replica 1 (it has computed nothing):
    # the hit ends before the block, at turn 3's prompt bundle; the block is removed with one
    # warning, and written again whole as the request computes it
    first_reply_block = (boundary(len(prompts[2])) - boundary(len(histories[1]))) // B
    block = new_blocks[2][first_reply_block]
    data = bytearray(block.read_bytes())
    data[-100] ^= 0xFF
    block.write_bytes(bytes(data))
    prompt, reply, cached = turn(base_b, histories[2], rng, rank=1)
    assert cached == boundary(len(prompts[2])) and reply == reference(prompt)
    assert block.read_bytes() != bytes(data)
    fingerprint = block.read_bytes()[28:60]  # its header's (serve/state_store/files.py)
    files.read_state(block, fingerprint, bytes.fromhex(block.stem), bytearray(page))
    log = server_b.log_path.read_text().splitlines()
    warned = [line for line in log if "state store: removed" in line]
    assert len(warned) == 1 and "checksum mismatch" in warned[0], warned

    # turn 6 on replica 1: from the bundle replica 0 wrote for turn 5
    time.sleep(1)  # turn 5's bundles are written after its reply
    prompt, reply, cached = turn(base_b, histories[4], rng, rank=1)
    assert cached == boundary(len(histories[4])) and reply == reference(prompt)
    # a branch from turn 1 on replica 0: from turn 1's newest bundle
    prompt, reply, cached = turn(base_b, histories[0], rng, rank=0)
    assert cached == boundary(len(histories[0])) and reply == reference(prompt)


def test_states_are_kept_at_the_engines_block_for_every_size():
    """--prefix-cache-retention-interval is the engine's block (vLLM refuses one that is not a
    multiple of the state groups' block): for a hybrid, the smallest multiple of 32 tokens whose
    keys and values in one attention layer take a layer's fp32 state page, as vLLM raises it."""
    import math

    from laplace_spec.config import get_config
    from laplace_spec.vllm_settings import served_block_size

    for name, kv_bytes, want in (("small", 4, 32), ("laplace-3b", 4, 64), ("laplace-3b", 2, 128)):
        cfg = get_config(name).replace(attention_every=4)
        block = served_block_size(cfg, kv_bytes)
        assert block == want, name
        page = (math.prod(cfg.gla_state_shape) + cfg.page_conv_window * cfg.d_model) * 4
        per_token = 2 * cfg.n_heads * cfg.kv_page_head_size * kv_bytes
        assert (block - 32) * per_token < page <= block * per_token
    assert served_block_size(get_config("laplace-3b"), 2) == 32  # pure Laplace: no KV to fit
