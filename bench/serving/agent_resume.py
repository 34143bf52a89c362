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

from serve.vllm_adapter import PREFIX_BLOCK_SIZE as BLOCK

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
    return {p: p.stat().st_size for p in root.rglob("*.state")}


def _wait_for_files(root: Path, before: dict, n: int, timeout: float = 60) -> None:
    """Until `n` files were written since `before` (the writer thread runs after the reply)."""
    deadline = time.monotonic() + timeout
    while len(set(_store_files(root)) - set(before)) < n and time.monotonic() < deadline:
        time.sleep(0.1)


def run_agent_resume(cfg, sz, model_dir: Path, max_len: int, llama_kv_per_token: int) -> dict:
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
            turn1 = len({(history - 1) // BLOCK, (history + len(reply) - 1) // BLOCK})
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
                    "llama_kv_bytes": llama_kv_per_token * (len(prompt2) + 1),
                }
            )
        replica = _replica_handover(cfg, sz, model_dir, max_len, root, log, rng)
    return {"rows": rows, "replica": replica, "block": BLOCK}


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
    want = (len(prompt1) + len(reply) - 1) // BLOCK * BLOCK
    return {"history": history, "cached_tokens": cached, "expected": want, "hit": cached == want}
