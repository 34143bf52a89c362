"""vLLM prefix caching of the recurrent state (`align` mode, `--enable-prefix-caching`).

A conversation: turn n+1's prompt = turn n's prompt + its greedy reply + a new message (token
ids). With caching, turn n+1 starts from the state vLLM saved at turn n's last block boundary
and prefills only the rest; its tokens must be those computed without the cache. Two engines:
one offline (prefix caching on; "without" = the same requests told to skip reading the cache,
and the PyTorch model), one server started as a user would, with vLLM's own flag.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from laplace_export_helpers import greedy_ids, post_json
from shared_fixtures import set_vllm_env

REPO = Path(__file__).resolve().parents[1]
REPLY = 40  # > the block size: replies cross block boundaries in decode (state page copies)
MESSAGE = 50


@pytest.fixture(scope="module")
def exported(tiny_export):
    return tiny_export[0], tiny_export[2]


@pytest.fixture(scope="module")
def torch_model(exported):
    from serve.modeling_laplace import LaplaceForCausalLM

    return LaplaceForCausalLM.from_exported(exported[1])


def _reference(model, prompt, n):
    from serve.generation import greedy_generate

    return greedy_generate(model, [prompt], n)[0]


@pytest.fixture(scope="module")
def llm(exported):
    """Its own engine: prefix caching changes the state pages (align mode, a page per block)."""
    set_vllm_env()
    from serve.vllm_adapter import make_llm

    engine = make_llm(
        str(exported[1]), max_num_seqs=8, prefix_caching=True, disable_log_stats=False
    )
    yield engine
    del engine


def _hits(llm) -> tuple[int, int]:
    m = {x.name: x.value for x in llm.get_metrics() if x.name.startswith("vllm:prefix_cache_")}
    return m["vllm:prefix_cache_hits"], m["vllm:prefix_cache_queries"]


def test_engine_runs_align_mode_with_explicit_block_size(llm):
    from serve.vllm_adapter import PREFIX_BLOCK_SIZE

    cc = llm.llm_engine.vllm_config.cache_config
    assert cc.enable_prefix_caching and cc.mamba_cache_mode == "align"
    assert cc.block_size == cc.mamba_block_size == PREFIX_BLOCK_SIZE


def test_multi_turn_same_tokens_fewer_prefill_tokens(llm, exported, torch_model):
    """5 turns: greedy tokens equal with the cache, without it (same engine, reading skipped)
    and in PyTorch; from turn 2 on, the cached tokens are turn n's prompt up to its last block
    boundary, and vLLM's hit counter counts them."""
    from serve.vllm_adapter import PREFIX_BLOCK_SIZE as B

    cfg = exported[0]
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, cfg.vocab_size, 150).tolist()
    hits0, _ = _hits(llm)
    computed, cached_total, prev = [], 0, None
    for turn in range(5):
        [(toks, cached)] = greedy_ids(llm, [prompt], REPLY)
        [(plain, none)] = greedy_ids(llm, [prompt], REPLY, skip_cache=True)
        assert toks == plain == _reference(torch_model, prompt, REPLY), f"turn {turn + 1}"
        assert none == 0
        want = 0 if prev is None else (len(prev) - 1) // B * B  # prev's last checkpoint
        assert cached == want and (want > 0 or turn == 0), (turn, cached, want)
        computed.append(len(prompt) - cached)
        cached_total += cached
        prev = prompt
        prompt = prompt + toks + rng.integers(0, cfg.vocab_size, MESSAGE).tolist()
    hits, _ = _hits(llm)
    assert hits - hits0 == cached_total
    # later turns prefill fewer tokens than their prompt, and no more than new + one block
    assert all(c < B + REPLY + MESSAGE for c in computed[1:]), computed


def test_concurrent_conversations_and_a_diverging_history(llm, exported, torch_model):
    """Two conversations advanced in one engine call, plus a request that shares only part of
    a cached history (an edited message): each gets its own tokens."""
    cfg = exported[0]
    rng = np.random.default_rng(12)
    convs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (70, 200)]
    for turn in range(3):
        outs = greedy_ids(llm, convs, REPLY)
        for c, (toks, cached) in zip(convs, outs, strict=True):
            assert toks == _reference(torch_model, c, REPLY)
            assert turn == 0 or cached > 0
        convs = [
            c + t + rng.integers(0, cfg.vocab_size, MESSAGE).tolist()
            for c, (t, _) in zip(convs, outs, strict=True)
        ]
    edited = list(convs[1])
    edited[100] = (edited[100] + 1) % cfg.vocab_size  # same first 100 tokens only
    [(toks, cached)] = greedy_ids(llm, [edited], REPLY)
    assert cached <= 100 and toks == _reference(torch_model, edited, REPLY)


def test_resent_prompt_resumes_one_token_before_its_end(llm, exported, torch_model):
    """A prompt of k blocks + 1 token sent again hits k blocks: its one remaining token runs as a
    decode row (seq_len > 1, so from the copied state, not zeros), next to a 1-token prompt."""
    from serve.vllm_adapter import PREFIX_BLOCK_SIZE as B

    cfg = exported[0]
    prompt = np.random.default_rng(14).integers(0, cfg.vocab_size, 3 * B + 1).tolist()
    want = _reference(torch_model, prompt, REPLY)
    assert greedy_ids(llm, [prompt], REPLY) == [(want, 0)]
    again = greedy_ids(llm, [prompt, [5]], REPLY)
    assert again == [(want, 3 * B), (_reference(torch_model, [5], REPLY), 0)]


def test_engine_kwargs_and_server_argv(exported, monkeypatch):
    """--enable-prefix-caching (ours, or vLLM's through --vllm-arg) turns on align mode with the
    explicit block size; off by default. max_num_seqs' default halves (two pages a sequence)."""
    import runpy

    from serve import vllm_adapter

    out = exported[1]
    kw = vllm_adapter.engine_kwargs(out, prefix_caching=True, platform="cpu")
    assert kw["enable_prefix_caching"] and kw["mamba_cache_mode"] == "align"
    assert kw["block_size"] == vllm_adapter.PREFIX_BLOCK_SIZE
    assert kw["max_num_seqs"] == vllm_adapter.default_max_num_seqs(out) // 2
    assert not vllm_adapter.engine_kwargs(out, platform="cpu")["enable_prefix_caching"]

    seen = {}
    monkeypatch.setattr(runpy, "run_module", lambda *a, **k: seen.update(argv=list(sys.argv)))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    base = ["--model", str(out), "--port", "1"]
    for extra in (["--enable-prefix-caching"], ["--vllm-arg=--enable-prefix-caching"]):
        assert vllm_adapter.main(base + extra) == 0
        argv = seen["argv"]
        assert "--enable-prefix-caching" in argv and "--no-enable-prefix-caching" not in argv
        assert argv[argv.index("--mamba-cache-mode") + 1] == "align"
        assert argv[argv.index("--block-size") + 1] == str(vllm_adapter.PREFIX_BLOCK_SIZE)
    assert vllm_adapter.main(base) == 0
    assert "--no-enable-prefix-caching" in seen["argv"]
    assert "--enable-prefix-caching" not in seen["argv"]


# ---- the server, started as the user did ---------------------------------------------


def test_server_with_vllm_prefix_caching_flag_serves_a_conversation(
    exported, torch_model, prefix_flag_server
):
    """`--vllm-arg=--enable-prefix-caching` used to kill the engine on the first request. Its own
    server (shared_fixtures.prefix_flag_server, started early): the flag is the command line's,
    the behaviour under test."""
    cfg, _ = exported
    base, log_path = prefix_flag_server
    rng = np.random.default_rng(13)
    prompt = rng.integers(0, cfg.vocab_size, 120).tolist()
    for turn in range(3):
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        status, text = post_json(base + "/v1/completions", body)
        assert status == 200, (turn, text, log_path.read_text()[-3000:])
        toks = json.loads(text)["choices"][0]["token_ids"]
        assert toks == _reference(torch_model, prompt, 16), turn
        prompt = prompt + toks + rng.integers(0, cfg.vocab_size, 30).tolist()
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    hits = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total")
    )
    assert hits > 0, [m for m in metrics.splitlines() if "prefix_cache" in m]
