"""`python -m bench.serve --agent-resume`: a conversation resumed after a server restart, from
the state store (`--state-dir`, serve/state_store/) against a cold re-prefill of its history.

For each history length H (`resume_histories`), with `python -m serve.vllm_adapter --state-dir`
servers as a user starts them (subprocesses, eager, `small` with random weights):
    turn 1   a server takes an H-token history and replies (`resume_reply` greedy tokens); the
             request's states are written to the store (at its prompt's last block boundary and
             its newest); the server is stopped (SIGTERM)
    restart  a new server on the same folder (`resume_rounds` times, each time anew; the files
             turn 2 wrote are removed before the next restart, which resumes from turn 1's)
    turn 2   history + reply + a new message (`resume_message` tokens), one new token: the
             request's time on the new server (after one unrelated 16-token request, which
             takes a fresh server's first-request costs), reading the state from disk
             (`usage.prompt_tokens_details.cached_tokens`), then the same request with another
             `cache_salt` (vLLM's: every block hash differs, nothing cached is found: the cold
             re-prefill of the whole history); both on the same server, store first (after the
             cold request the server's own memory would hold the state)
The ratio cold / store is taken round by round (median and range). Bytes on disk per
conversation: every file its requests left (the warm-up and cold requests store nothing:
vLLM's per-request `max_offload_tokens` 0); Llama's: its fp32 KV bytes for the same tokens,
computed (the store keeps at most two states per finished request, which an attention model
does not have). The replica row: a 2-replica server, turn 1 on replica 0, turn 2 on replica 1
(vLLM's `X-data-parallel-rank` header).

The same rows for the 3:1 hybrid (`small` with attention_every=4), whose store also keeps its
attention layer's blocks, once each; beside its bytes on disk, `formula_bytes` (docs/design.md
s10.1: a file per block of every attention group, a bundle of every state group's page per
kept boundary) from the blocks and bundles the turns leave; and `shared_prompt`: `shared_n`
conversations that open with the same `shared_prompt`-token system prompt, one turn each, on one
server: the files on disk, the prompt's blocks among them once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from laplace_spec.vllm_settings import PREFIX_BLOCK_SIZE, kv_block_bytes, served_block_size
from serve.state_store import files

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """`python -m serve.vllm_adapter --state-dir ...` in a subprocess, ready when it answers."""

    def __init__(self, model_dir: Path, max_len: int, state_dir: Path, log: Path, *extra):
        self.port = _free_port()
        cmd = [sys.executable, "-m", "serve.vllm_adapter", "--model", str(model_dir)]
        cmd += ["--port", str(self.port), "--max-model-len", str(max_len), "--max-num-seqs", "4"]
        cmd += ["--served-model-name", "small", "--state-dir", str(state_dir), *extra]
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        with open(log, "a") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=out)
        self.log = log
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ask(self, prompt, new_tokens: int, salt: str | None = None, rank: int | None = None):
        """(seconds, output ids, cached prompt tokens) of one greedy request; a salted request
        (not the conversation's) stores nothing (vLLM's `max_offload_tokens` 0)."""
        body = {
            "model": "small",
            "prompt": prompt,
            "max_tokens": new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if salt is not None:
            body["cache_salt"] = salt
            body["kv_transfer_params"] = {"max_offload_tokens": 0}
        headers = {"Content-Type": "application/json"}
        if rank is not None:
            headers["X-data-parallel-rank"] = str(rank)
        req = urllib.request.Request(
            f"{self.url}/v1/completions", json.dumps(body).encode(), headers=headers
        )
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        seconds = time.perf_counter() - t0
        cached = out["usage"]["prompt_tokens_details"]["cached_tokens"] or 0
        return seconds, out["choices"][0]["token_ids"], cached

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)


def _store_files(root: Path) -> dict[Path, int]:
    """Every file of the store (bundles and attention blocks): its bytes."""
    found = [*root.rglob(f"*{files.SUFFIX}"), *root.rglob(f"*{files.BLOCK_SUFFIX}")]
    return {p: p.stat().st_size for p in found}


def _bundles(paths) -> set[Path]:
    return {p for p in paths if p.suffix == files.SUFFIX}


def _wait_for_files(root: Path, before: dict, n: int, timeout: float = 60) -> None:
    """Until `n` bundles were written since `before` (the writer thread runs after the reply;
    a bundle is written after the blocks it needs)."""
    deadline = time.monotonic() + timeout
    while len(_bundles(set(_store_files(root)) - set(before))) < n:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)


def kept_ends(prompt: int, total: int, block: int) -> set[int]:
    """The boundaries a finished request's bundles are at (serve/state_store/tier.py): its
    newest, the last block boundary before its last token (sampled, never computed through),
    and its prompt's last full block, or the newest where that is sooner."""
    newest = (total - 1) // block * block
    return {min(prompt // block * block, newest), newest} - {0}


def formula_bytes(cfg, block: int, kv_bytes: int, ends: list[int], n_blocks: int) -> int:
    """The store's bytes (docs/design.md s10.1) for `n_blocks` attention blocks of each
    attention layer and a bundle at each of `ends` (tokens): a file is a 64-byte header, its
    key (a 32-byte block hash; a block's, + 4 for its group), the keys of the blocks a bundle
    needs, and its pages. Every chunk is one layer's block, `block` tokens of keys and values
    (state pages padded to it in a hybrid; pure Laplace: one state of every layer)."""
    if not cfg.attention_every:
        return len(ends) * (64 + 32 + cfg.page_bytes_per_sequence())
    page = kv_block_bytes(cfg, block, kv_bytes)
    blocks = cfg.n_attention_layers * n_blocks * (64 + 36 + page)
    needs = [cfg.n_attention_layers * (end // block) * 36 for end in ends]
    return blocks + sum(64 + 32 + n + cfg.n_layers * page for n in needs)


def run_agent_resume(
    cfg, sz, model_dir: Path, max_len: int, llama_kv_per_token: int, replica: bool = True
) -> dict:
    BLOCK = served_block_size(cfg, 4)  # fp32 keys and values: the export's dtype on the CPU
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="agent_resume_") as tmp:
        root, log = Path(tmp) / "states", Path(tmp) / "servers.log"
        for history in sz.resume_histories:
            print(f"agent resume: {history:,}-token history", flush=True)
            prompt1 = rng.integers(3, cfg.vocab_size, history).tolist()
            warmup = rng.integers(3, cfg.vocab_size, 16).tolist()
            before = _store_files(root) if root.exists() else {}
            server = _Server(model_dir, max_len, root, log)
            _, reply, _ = server.ask(prompt1, sz.resume_reply)
            turn1 = len(kept_ends(history, history + len(reply), BLOCK))
            _wait_for_files(root, before, turn1)  # the prompt's state and the newest
            server.stop()
            turn1_files = _store_files(root)
            message = rng.integers(3, cfg.vocab_size, sz.resume_message).tolist()
            prompt2 = prompt1 + reply + message
            store_s, cold_s, cached, equal = [], [], [], []
            for r in range(sz.resume_rounds):
                server = _Server(model_dir, max_len, root, log)  # a restart: nothing in memory
                server.ask(warmup, 1, salt=f"warm-{history}-{r}")  # a first request's costs
                t_store, out_store, hit = server.ask(prompt2, 1)
                t_cold, out_cold, _ = server.ask(prompt2, 1, salt=f"cold-{history}-{r}")
                server.stop()  # its writes finish first
                turn2 = {p: n for p, n in _store_files(root).items() if p not in turn1_files}
                for path in turn2:  # the next restart resumes from turn 1's states again
                    path.unlink()
                store_s.append(t_store)
                cold_s.append(t_cold)
                cached.append(hit)
                equal.append(out_store == out_cold)
            written = {p: n for p, n in turn1_files.items() if p not in before} | turn2
            ends = sorted(
                kept_ends(len(prompt1), len(prompt1) + len(reply), BLOCK)
                | kept_ends(len(prompt2), len(prompt2) + 1, BLOCK)
            )
            n_blocks = len(prompt2) // BLOCK
            ratios = [c / s for c, s in zip(cold_s, store_s, strict=True)]
            rows.append(
                {
                    "history": history,
                    "turn2_prompt": len(prompt2),
                    "cached_tokens": cached,
                    "expected_cached": (len(prompt1) + len(reply) - 1) // BLOCK * BLOCK,
                    "prefill_after_restart": [len(prompt2) - c for c in cached],
                    "first_token_equal_cold": equal,
                    "ttft_store_s": store_s,
                    "ttft_cold_s": cold_s,
                    "cold_over_store": {
                        "median": statistics.median(ratios),
                        "min": min(ratios),
                        "max": max(ratios),
                        "samples": ratios,
                    },
                    # the conversation's files: each turn's prompt end and newest (turn 2's as
                    # one round wrote them; each round's are removed before the next restart)
                    "store_files": len(written),
                    "store_bytes": sum(written.values()),
                    "formula_bytes": formula_bytes(cfg, BLOCK, 4, ends, n_blocks),
                    "llama_kv_bytes": llama_kv_per_token * (len(prompt2) + 1),
                }
            )
        out = {"rows": rows, "block": BLOCK}
        if replica:
            out["replica"] = _replica_handover(cfg, sz, model_dir, max_len, root, log, rng)
        if cfg.attention_every:
            shared = _shared_prompt(cfg, sz, model_dir, max_len, BLOCK, Path(tmp), rng)
            out["shared_prompt"] = shared
    return out


def _shared_prompt(cfg, sz, model_dir, max_len, BLOCK: int, tmp: Path, rng) -> dict:
    """`shared_n` conversations opening with one `shared_prompt`-token system prompt, one turn
    each, on one server with a folder of its own: the bytes on disk, and the blocks among them
    that the shared prompt's full blocks take (once)."""
    root, log = tmp / "shared_states", tmp / "shared.log"
    system = rng.integers(3, cfg.vocab_size, sz.shared_prompt).tolist()
    server = _Server(model_dir, max_len, root, log)
    try:
        for _ in range(sz.shared_n):
            message = rng.integers(3, cfg.vocab_size, sz.resume_message).tolist()
            before = _store_files(root) if root.exists() else {}
            _, reply, _ = server.ask(system + message, sz.resume_reply)
            total = len(system) + len(message) + len(reply)
            _wait_for_files(root, before, len(kept_ends(total - len(reply), total, BLOCK)))
    finally:
        server.stop()
    on_disk = _store_files(root)
    blocks = len(on_disk) - len(_bundles(on_disk))
    shared_blocks = len(system) // BLOCK
    own = (len(system) + sz.resume_message + sz.resume_reply - 1) // BLOCK - shared_blocks
    return {
        "conversations": sz.shared_n,
        "shared_prompt": len(system),
        "store_bytes": sum(on_disk.values()),
        "attention_blocks": blocks,
        "attention_blocks_if_shared_once": shared_blocks + sz.shared_n * own,
        "attention_blocks_if_copied": sz.shared_n * (shared_blocks + own),
    }


def _replica_handover(cfg, sz, model_dir, max_len, root, log, rng) -> dict:
    """A 2-replica server on the folder: turn 1 on replica 0, turn 2 on replica 1."""
    server = _Server(model_dir, max_len, root, log, "--data-parallel-size", "2")
    try:
        history = min(sz.resume_histories)
        prompt1 = rng.integers(3, cfg.vocab_size, history).tolist()
        before = _store_files(root)
        _, reply, _ = server.ask(prompt1, sz.resume_reply, rank=0)
        _wait_for_files(root, before, 1)
        prompt2 = prompt1 + reply + rng.integers(3, cfg.vocab_size, sz.resume_message).tolist()
        _, _, cached = server.ask(prompt2, 1, rank=1)
    finally:
        server.stop()
    want = (len(prompt1) + len(reply) - 1) // PREFIX_BLOCK_SIZE * PREFIX_BLOCK_SIZE
    return {"history": history, "cached_tokens": cached, "expected": want, "hit": cached == want}
