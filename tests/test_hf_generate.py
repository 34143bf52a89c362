"""transformers' `generate()` on an exported folder (`AutoModelForCausalLM`), the recurrent state
carried as the cache (`cache_params`).

Truths: `serve.generation.greedy_generate` (each prompt prefilled alone, then batched O(1)
decode) for greedy, and a plain sampling loop over the model's own forward for sampling; both
compared token for token (the same kernels run on the same rows, so no tolerance is needed).
Prompts: 1 token, 300 tokens, 17 tokens; 48 new tokens, as in tests/test_vllm.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from laplace_export_helpers import random_params, tiny_config, write_tokenizer

from serve.generation import greedy_generate, prefill
from serve.modeling_laplace import LaplaceForCausalLM, LaplaceState

N_NEW = 48
PAD = 0


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from export import exporter

    cfg = tiny_config()
    root = tmp_path_factory.mktemp("hfgen")
    tok = write_tokenizer(root / "tok", cfg.vocab_size)
    return exporter.export_model(cfg, random_params(cfg, seed=2), root / "model", tokenizer_dir=tok)


@pytest.fixture(scope="module")
def auto(exported):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [[5], rng.integers(1, 320, 300).tolist(), rng.integers(1, 320, 17).tolist()]


@pytest.fixture(scope="module")
def reference(exported, prompts):
    return greedy_generate(LaplaceForCausalLM.from_exported(exported), prompts, N_NEW)


def _left_padded(prompts):
    T = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _input_lengths(model):
    """Records the token count of every forward of the backbone (to see the state carried)."""
    lengths: list[int] = []
    handle = model.model.register_forward_pre_hook(lambda m, a: lengths.append(a[0].shape[1]))
    return lengths, handle


def test_generate_greedy_equals_greedy_generate_batched_and_alone(auto, prompts, reference):
    assert type(auto) is LaplaceForCausalLM
    ids, mask = _left_padded(prompts)
    lengths, handle = _input_lengths(auto)
    try:
        out = auto.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=N_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=PAD,
        )
    finally:
        handle.remove()
    assert out[:, ids.shape[1] :].tolist() == reference
    # the state is the cache: each row prefilled once on its own tokens, then 1 token per step
    assert lengths == [len(p) for p in prompts] + [1] * (N_NEW - 1)
    for p, ref in zip(prompts, reference, strict=True):
        one = auto.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=N_NEW,
            eos_token_id=None,
            pad_token_id=PAD,
        )
        assert one[0, len(p) :].tolist() == ref


def test_generate_without_cache_recomputes_the_same_tokens(auto, prompts, reference):
    """use_cache=False: every step runs the whole (left-padded) sequence again, no state kept."""
    ids, mask = _left_padded(prompts)
    out = auto.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        use_cache=False,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    assert out[:, ids.shape[1] :].tolist() == [r[:6] for r in reference]


def test_beam_search_is_refused(auto):
    with pytest.raises(ValueError, match="beam search"):
        auto.generate(torch.tensor([[3, 4]]), max_new_tokens=2, num_beams=2, pad_token_id=PAD)


def test_generate_returns_the_state_of_the_whole_sequence(auto, prompts):
    """The returned cache equals the state of one forward over prompt + generated tokens."""
    p = prompts[2]
    out = auto.generate(
        torch.tensor([p]),
        max_new_tokens=8,
        eos_token_id=None,
        pad_token_id=PAD,
        return_dict_in_generate=True,
    )
    state = out.past_key_values  # transformers returns any cache under this name
    assert isinstance(state, LaplaceState)
    with torch.no_grad():  # the last token is not fed back by generate: the state ends before it
        full = auto(out.sequences[:, :-1]).state
    for a, b in zip(state.gla + state.conv, full.gla + full.conv, strict=True):
        assert (a - b).abs().max().item() <= 1e-5


def test_generate_stops_at_eos(auto, prompts, reference):
    eos = reference[0][5]  # a token row 0 produces at step 5 (maybe earlier too)
    ids, mask = _left_padded(prompts)
    out = auto.generate(
        ids, attention_mask=mask, max_new_tokens=N_NEW, eos_token_id=eos, pad_token_id=PAD
    )
    new = out[:, ids.shape[1] :].tolist()
    expect = [ref[: ref.index(eos) + 1] if eos in ref else ref for ref in reference]
    width = max(map(len, expect))  # generation stops once every row has ended
    assert width < N_NEW or all(eos not in r for r in reference)
    assert new == [e + [PAD] * (width - len(e)) for e in expect]


@torch.no_grad()
def _sample_loop(model, prompts, n, temperature, seed):
    """Independent sampling: per-prompt prefill, batched decode, torch.multinomial."""
    torch.manual_seed(seed)
    logits, state = prefill(model, prompts)
    out = []
    for i in range(n):
        probs = torch.softmax(logits / temperature, dim=-1)
        tokens = torch.multinomial(probs, num_samples=1)[:, 0]
        out.append(tokens)
        if i < n - 1:
            step = model(tokens[:, None], state)
            logits, state = step.logits[:, -1], step.state
    return torch.stack(out, 1).tolist()


@pytest.mark.parametrize("seed", [0, 1])
def test_generate_sampling_equals_a_plain_sampling_loop(auto, prompts, seed):
    ids, mask = _left_padded(prompts)
    torch.manual_seed(seed)
    out = auto.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=N_NEW,
        do_sample=True,
        temperature=0.8,
        top_k=0,
        top_p=1.0,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    new = out[:, ids.shape[1] :].tolist()
    assert new == _sample_loop(auto, prompts, N_NEW, 0.8, seed)
    greedy = auto.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, pad_token_id=PAD)
    assert new != greedy[:, ids.shape[1] :].tolist()  # sampling did sample


def test_right_or_inner_padding_is_refused(auto):
    ids = torch.tensor([[3, 4, 5, PAD], [3, 4, 5, 6]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="left padding"):
        auto.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=PAD)
