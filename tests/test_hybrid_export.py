"""A hybrid (`attention_every=2`: a GLA layer, then an attention layer) from JAX to the exported
folder and the PyTorch model: its config and tensors, its logits against the JAX model's, its
state (the attention layer's keys and values) carried through decoding and `generate()`
(vLLM's form: tests/test_hybrid_vllm.py).

Truths: the JAX model (`LaplaceLM.apply`, and `laplace_jax.generate.greedy_generate`, which
recomputes the whole sequence for every token of a model with attention layers) and the
PyTorch model's own full forward for the decoded state.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch

from laplace_jax.generate import greedy_generate as jax_greedy
from laplace_jax.model import LaplaceLM
from serve.configuration_laplace import LaplaceHFConfig
from serve.generation import greedy_generate
from serve.modeling_laplace import LaplaceForCausalLM

N_NEW = 12


@pytest.fixture(scope="module")
def hybrid(tiny_hybrid_export):
    """(cfg, params, exported folder) of the tiny hybrid with random weights."""
    return tiny_hybrid_export


@pytest.fixture(scope="module")
def model(hybrid):
    return LaplaceForCausalLM.from_exported(hybrid[2])


def test_the_export_carries_the_layer_types_and_every_tensor(hybrid):
    cfg, _, folder = hybrid
    conf = json.loads((folder / "config.json").read_text())
    assert conf["attention_every"] == 2
    assert conf["architectures"] == ["LaplaceHybridForCausalLM"]  # vLLM's hybrid class
    assert conf["layer_types"] == ["linear_attention", "full_attention"]
    assert LaplaceHFConfig.from_dict(conf).laplace_config == cfg
    with pytest.raises(ValueError, match="layer_types"):
        LaplaceHFConfig.from_dict({**conf, "layer_types": ["linear_attention"] * 2})


def test_logits_equal_the_jax_model(hybrid, model):
    cfg, params, _ = hybrid
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40)).astype(np.int32)
    want, _ = jax.jit(LaplaceLM(cfg).apply)({"params": params}, tokens)
    with torch.no_grad():
        got = model(torch.tensor(tokens, dtype=torch.long)).logits
    np.testing.assert_allclose(got.numpy(), np.asarray(want), atol=2e-4, rtol=2e-4)


def test_decoding_carries_the_keys_and_values(hybrid, model):
    """A prefill then one token at a time gives the full forward's logits and state: the
    attention layer's keys and values grow by one a step, the GLA layer's state stays fixed."""
    cfg = hybrid[0]
    ids = torch.tensor(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 30)))
    with torch.no_grad():
        full = model(ids)
        out = model(ids[:, :20])
        steps = [out.logits[:, -1]]
        for t in range(20, 30):
            out = model(ids[:, t : t + 1], state=out.state)
            steps.append(out.logits[:, -1])
    torch.testing.assert_close(torch.stack(steps[:-1], 1), full.logits[:, 19:29])
    keys, values = out.state.kv[1]
    assert keys.shape == (1, 30, cfg.n_heads, cfg.d_k) and values.shape[-1] == cfg.d_v
    assert out.state.kv[0] is None and out.state.gla[1].numel() == 0
    for a, b in zip(out.state.tensors(), full.state.tensors(), strict=True):
        torch.testing.assert_close(a, b)


def test_greedy_tokens_equal_jax_and_generate(hybrid, model):
    """Greedy tokens: JAX's recomputed greedy = serve.generation's prefill-then-decode (prompts
    of different lengths decoded together: the keys left-padded and masked) = transformers'
    generate() on a left-padded batch."""
    cfg, params, folder = hybrid
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (7, 19)]
    want = [
        np.asarray(jax_greedy(params, cfg, np.array([p], np.int32), N_NEW))[0].tolist()
        for p in prompts
    ]
    assert greedy_generate(model, prompts, N_NEW) == want
    auto = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    out = auto.generate(  # no stop at an end-of-text token: random weights may pick it
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=N_NEW,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert out[:, T:].tolist() == want


@pytest.mark.parametrize(
    "form",
    [
        {"gla_branch": "layer_scale"},
        {"gla_branch": "post_norm", "attention_input": "stream_and_embedding"},
    ],
    ids=["layer_scale", "post_norm-reads_embedding"],
)
def test_each_branch_form_exports_and_decodes_as_jax_computes(tmp_path, form):
    """The hybrid's other forms (docs/design.md s13.5): a GLA branch s (1 + w) y or
    s (1 + w) RMSNorm(y), an attention layer reading LayerNorm_1(x) + LayerNorm_0(x_0); with
    random gains and norm scales the exported model's logits equal JAX's, and a prefill then
    one token at a time gives the full forward's logits (x_0 carried into every step)."""
    from laplace_export_helpers import random_params, tiny_config

    from export import exporter

    cfg = tiny_config().replace(attention_every=2, **form)
    params = random_params(cfg, seed=5, noise=0.3)
    folder = exporter.export_model(cfg, params, tmp_path / "model", max_len=1024)
    model = LaplaceForCausalLM.from_exported(folder)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 40)).astype(np.int32)
    want, _ = jax.jit(LaplaceLM(cfg).apply)({"params": params}, tokens)
    ids = torch.tensor(tokens, dtype=torch.long)
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :30])
        steps = [out.logits[:, -1]]
        for t in range(30, 39):
            out = model(ids[:, t : t + 1], state=out.state)
            steps.append(out.logits[:, -1])
    np.testing.assert_allclose(full.numpy(), np.asarray(want), atol=2e-4, rtol=2e-4)
    # the steps and the chunked prefill add in different orders: fp32 rounding, up to 1.2e-5
    # measured on an AMD EPYC (1e-5, torch's default, failed there)
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 29:39], atol=1e-4, rtol=1e-4)
    # the form is carried (a model without it differs)
    plain, _ = LaplaceLM(tiny_config().replace(attention_every=2)).apply(
        {"params": random_params(tiny_config().replace(attention_every=2), seed=5, noise=0.3)},
        tokens,
    )
    assert float(np.abs(np.asarray(plain) - np.asarray(want)).max()) > 1e-2
