"""vLLM serving: greedy parity JAX == PyTorch == vLLM, and the OpenAI server.

One offline engine is shared by the parity tests (module fixture) and one server process by the
server tests; each engine start costs tens of seconds on this CPU.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from laplace_export_helpers import random_params, tiny_config, write_tokenizer

N_NEW = 48
REPO = Path(__file__).resolve().parents[1]
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with a function (state pages)
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from export import exporter

    cfg = tiny_config()
    params = random_params(cfg, seed=1)
    root = tmp_path_factory.mktemp("vllm")
    tok = write_tokenizer(root / "tok", cfg.vocab_size)
    out = exporter.export_model(cfg, params, root / "model", tokenizer_dir=tok, max_len=1024)
    return cfg, params, out


@pytest.fixture(scope="module")
def prompts(exported):
    cfg = exported[0]
    rng = np.random.default_rng(7)
    return [
        [5],  # one token: vLLM schedules it as a decode
        rng.integers(0, cfg.vocab_size, 300).tolist(),  # several hundred tokens
        rng.integers(0, cfg.vocab_size, 17).tolist(),
    ]


@pytest.fixture(scope="module")
def reference(exported, prompts):
    """Greedy tokens of the JAX model, each prompt alone (the training reference)."""
    from laplace_jax.generate import greedy_generate

    cfg, params, _ = exported
    return [greedy_generate(params, cfg, p, N_NEW).tolist() for p in prompts]


@pytest.fixture(scope="module")
def llm(exported):
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    from serve.vllm_adapter import make_llm

    engine = make_llm(str(exported[2]), max_num_seqs=8)
    yield engine
    del engine


def test_torch_greedy_matches_jax(exported, prompts, reference):
    from serve.generation import greedy_generate
    from serve.modeling_laplace import LaplaceForCausalLM

    model = LaplaceForCausalLM.from_exported(exported[2])
    assert greedy_generate(model, prompts, N_NEW) == reference  # batched together
    assert [greedy_generate(model, [p], N_NEW)[0] for p in prompts] == reference  # alone


def test_vllm_greedy_matches_jax_batched_and_alone(llm, prompts, reference):
    from serve.vllm_adapter import generate

    together = [r["token_ids"] for r in generate(llm, prompts, N_NEW)]
    assert together == reference
    # alone, after the batch: pages are reused, so a fresh sequence must start from zeros
    for p, ref in zip(reversed(prompts), reversed(reference), strict=True):
        assert generate(llm, [p], N_NEW)[0]["token_ids"] == ref


def test_vllm_mixed_prefill_and_decode_steps(llm, prompts, reference):
    """Requests of very different lengths in one engine call: vLLM mixes decodes of short
    sequences with prefill chunks of long ones in the same steps."""
    from serve.vllm_adapter import generate

    many = [prompts[1], prompts[0], prompts[2], prompts[0], prompts[1]]
    want = [reference[1], reference[0], reference[2], reference[0], reference[1]]
    assert [r["token_ids"] for r in generate(llm, many, N_NEW)] == want


def _state_pages(worker):
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    layers = [m for m in worker.model_runner.model.modules() if isinstance(m, MambaBase)]
    return [[(tuple(t.shape[1:]), str(t.dtype), t[0].nbytes) for t in m.kv_cache] for m in layers]


def test_vllm_state_pages_hold_the_documented_state(llm, exported):
    """One page per sequence and layer: GLA [H, dk, dv] and conv window [W, D], fp32; their
    bytes, summed over the layers, are laplace_spec's state bytes per sequence."""
    cfg = exported[0]
    pages = [
        [(tuple(s), d, n) for s, d, n in layer] for layer in llm.collective_rpc(_state_pages)[0]
    ]
    gla, conv = (cfg.n_heads, cfg.d_k, cfg.d_v), (cfg.conv_width, cfg.d_model)
    assert pages == [[(gla, "torch.float32", 4 * math.prod(gla)),
                      (conv, "torch.float32", 4 * math.prod(conv))]] * cfg.n_layers  # fmt: skip
    assert sum(n for layer in pages for _, _, n in layer) == cfg.state_bytes_per_sequence()["total"]


def test_vllm_compiled_greedy_matches_jax(exported, prompts, reference):
    """vLLM's compile mode (on CPU: traced once, symbolic token count, inductor); about 52 s on
    the project's 2-core CPU, with cold and warm compile caches alike."""
    from serve.vllm_adapter import generate, make_llm

    engine = make_llm(str(exported[2]), max_num_seqs=8, compile=True)
    try:
        assert [r["token_ids"] for r in generate(engine, prompts, N_NEW)] == reference
    finally:
        del engine


def test_cli_offline_json(exported, prompts, reference):
    env = {**os.environ, **ENV}
    cmd = [sys.executable, "-m", "serve.vllm_adapter", "--model", str(exported[2]),
           "--prompt-ids", ",".join(map(str, prompts[2])), "--prompt", "the quick brown",
           "--max-tokens", "8", "--temperature", "0", "--json"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    # text prompts first, then token-id prompts
    assert rows[0]["prompt"] == "the quick brown" and len(rows[0]["token_ids"]) == 8
    assert rows[1]["token_ids"] == reference[2][:8]


# ---- the OpenAI-compatible server ------------------------------------------------------------

SERVER_MAX_LEN = 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url, body, timeout=120):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def server(exported):
    port = _free_port()
    env = {**os.environ, **ENV}
    cmd = [sys.executable, "-m", "serve.vllm_adapter", "--model", str(exported[2]),
           "--port", str(port), "--max-model-len", str(SERVER_MAX_LEN),
           "--served-model-name", "laplace-tiny", "--max-num-seqs", "4"]  # fmt: skip
    log = open(exported[2].parent / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            log.close()
            pytest.fail("server exited: " + (exported[2].parent / "server.log").read_text()[-3000:])
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("server did not come up")
        time.sleep(1)
    yield base, proc
    proc.send_signal(signal.SIGINT)  # stopped by its own process id
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


def test_server_completion_matches_greedy(server, prompts, reference):
    base, _ = server
    body = {"model": "laplace-tiny", "prompt": prompts[2], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    status, text = _post(base + "/v1/completions", body)
    assert status == 200, text
    choice = json.loads(text)["choices"][0]
    assert choice["token_ids"] == reference[2][:12]


def test_server_text_prompt_and_stream(server):
    base, _ = server
    body = {"model": "laplace-tiny", "prompt": "the lazy dog", "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    status, text = _post(base + "/v1/completions", body)
    assert status == 200, text
    full = json.loads(text)["choices"][0]
    assert len(full["token_ids"]) == 6
    status, text = _post(base + "/v1/completions", {**body, "stream": True})
    assert status == 200, text
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = [t for c in chunks for ch in c["choices"] for t in (ch.get("token_ids") or [])]
    assert streamed == full["token_ids"]
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == full["text"]


@pytest.mark.parametrize(
    "bad",
    [
        {"prompt": "", "max_tokens": 4},
        {"prompt": "the dog", "max_tokens": -1},
        {"prompt": list(range(1, SERVER_MAX_LEN + 20)), "max_tokens": 4},  # over max-model-len
    ],
    ids=["empty-prompt", "negative-max-tokens", "prompt-too-long"],
)
def test_server_rejects_bad_requests_and_keeps_serving(server, bad):
    base, proc = server
    status, text = _post(base + "/v1/completions", {"model": "laplace-tiny", **bad})
    assert 400 <= status < 500, (status, text)
    status, _ = _post(
        base + "/v1/completions", {"model": "laplace-tiny", "prompt": [3, 4], "max_tokens": 2}
    )
    assert status == 200 and proc.poll() is None
