"""The tiny hybrid (a GLA layer, then an attention layer) on the unmodified vLLM engine: the GLA
layer on its state pages, the attention layer on vLLM's paged KV cache (docs/design.md s13.4).

Truth: the PyTorch model's greedy tokens (tests/test_hybrid_export.py holds those to JAX's).
Two engines: eager with prefix caching, 64-token prefill chunks and a pool of 64 blocks (so
long prompts are split and a batch of them cannot run at once), and compile mode with vLLM's
defaults (a prompt prefilled in one piece; tests/compiled_engines.py, in the background queue).
"""

from __future__ import annotations

import numpy as np
import pytest
from laplace_export_helpers import greedy_ids
from shared_fixtures import set_vllm_env

N_NEW = 24
CHUNK = 64  # tokens per prefill step of the eager engine
BLOCKS = 64  # the eager engine's KV blocks (of 32 tokens; every layer's page in each block)


@pytest.fixture(scope="module")
def torch_model(tiny_hybrid_export):
    from serve.modeling_laplace import LaplaceForCausalLM

    return LaplaceForCausalLM.from_exported(tiny_hybrid_export[2])


def _engine(folder, **kw):
    set_vllm_env()
    from serve.vllm_adapter import make_llm

    return make_llm(str(folder), max_num_seqs=8, max_model_len=1024, **kw)


@pytest.fixture(scope="module")
def eager(tiny_hybrid_export):
    engine = _engine(
        tiny_hybrid_export[2],
        prefix_caching=True,
        max_num_batched_tokens=CHUNK,
        num_gpu_blocks_override=BLOCKS,
        disable_log_stats=False,
    )
    yield engine
    del engine


def _reference(model, prompts, n=N_NEW):
    from serve.generation import greedy_generate

    return [greedy_generate(model, [p], n)[0] for p in prompts]


def _prompts(seed, lengths, vocab):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def test_vllm_serves_it_as_a_hybrid(eager, tiny_hybrid_export):
    """vLLM's hybrid path: a state page for both layers (conv windows, the GLA layer's
    matrices), KV blocks of 32 tokens for the attention layer (n_heads heads of 32 values: keys
    of 8 and values of 16 zero-padded), every state page padded to one KV block's bytes."""
    from bench.serving.measure import page_layout

    cfg = tiny_hybrid_export[0]
    vc = eager.llm_engine.vllm_config
    assert vc.model_config.is_hybrid and vc.model_config.architecture == cfg.architecture
    assert vc.model_config.get_head_size() == cfg.kv_page_head_size == 32
    block = 32 * 2 * cfg.n_heads * cfg.kv_page_head_size * 4  # 32 tokens' fp32 keys and values
    assert vc.cache_config.block_size == 32 and cfg.page_bytes_per_sequence() / 2 < block
    assert page_layout(eager) == {
        "model.layers.0.mixer": {"kind": "state", "bytes": block},
        "model.layers.1.mixer": {"kind": "state", "bytes": block},
        "model.layers.1.mixer.attn": {"kind": "kv", "bytes": block},
    }


def test_greedy_equals_pytorch_in_64_token_prefill_chunks(eager, torch_model, tiny_hybrid_export):
    """Prompts of 7 to 300 tokens together (the long ones prefilled in 64-token pieces, each
    piece continuing the conv window, GLA state and keys of the ones before) decode the
    PyTorch model's greedy tokens."""
    prompts = _prompts(0, (7, 19, 150, 300), tiny_hybrid_export[0].vocab_size)
    assert eager.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens == CHUNK
    got = greedy_ids(eager, prompts, N_NEW, skip_cache=True)
    assert [t for t, _ in got] == _reference(torch_model, prompts)


def test_compile_mode_one_piece_equals_pytorch(
    compiled_hybrid_run, torch_model, tiny_hybrid_export
):
    """Compile mode, each prompt prefilled in one piece: the same tokens as PyTorch (and so as
    the eager engine's 64-token pieces). The engine is built and run in a subprocess of the
    background queue (tests/compiled_engines.py)."""
    from compiled_engines import N_NEW as COMPILED_N_NEW
    from compiled_engines import hybrid_calls

    (prompts,) = hybrid_calls(tiny_hybrid_export[0].vocab_size)
    assert compiled_hybrid_run["enforce_eager"] is False
    assert compiled_hybrid_run["calls"] == [_reference(torch_model, prompts, COMPILED_N_NEW)]


def test_a_prefix_cache_hit_continues_like_a_cold_run(eager, torch_model, tiny_hybrid_export):
    """Three turns of a conversation: from turn 2 the prompt's cached blocks (the GLA state page
    and the keys and values up to turn 1's last block boundary) are reused, and the tokens are
    those of the same request without the cache and of PyTorch."""
    from serve.vllm_adapter import PREFIX_BLOCK_SIZE as B

    vocab = tiny_hybrid_export[0].vocab_size
    rng = np.random.default_rng(3)
    prompt, prev = rng.integers(0, vocab, 100).tolist(), None
    for turn in range(3):
        [(toks, cached)] = greedy_ids(eager, [prompt], N_NEW)
        [(cold, none)] = greedy_ids(eager, [prompt], N_NEW, skip_cache=True)
        assert toks == cold == _reference(torch_model, [prompt])[0], f"turn {turn + 1}"
        assert none == 0 and cached == (0 if prev is None else (len(prev) - 1) // B * B)
        prev, prompt = prompt, prompt + toks + rng.integers(0, vocab, 30).tolist()


def test_requests_beyond_the_kv_budget_queue_or_are_refused(eager, torch_model, tiny_hybrid_export):
    """8 requests of 300 + 24 tokens need more KV blocks than the engine's 64 at once: vLLM
    queues them and each gets its tokens. A prompt longer than the serving length is refused
    with vLLM's own message, and the engine serves on."""
    from vllm.exceptions import VLLMValidationError

    vocab = tiny_hybrid_export[0].vocab_size
    prompts = _prompts(5, [300] * 8, vocab)
    B = eager.llm_engine.vllm_config.cache_config.block_size
    assert 8 * -(-(300 + N_NEW) // B) > BLOCKS  # cannot all hold their keys at once
    got = greedy_ids(eager, prompts, N_NEW, skip_cache=True)
    assert [t for t, _ in got] == _reference(torch_model, prompts)
    with pytest.raises(VLLMValidationError, match="maximum context length is 1024"):
        greedy_ids(eager, _prompts(6, [1100], vocab), 4)
    assert greedy_ids(eager, prompts[:1], N_NEW, skip_cache=True) == got[:1]
