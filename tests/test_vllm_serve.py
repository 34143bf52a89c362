"""`vllm serve EXPORT`: vLLM's own command line serves an export (the plugin registers the model
through its `vllm.general_plugins` entry point; the export's vllm_serve.yaml carries the settings
the adapter uses too), with the adapter's greedy tokens."""

from __future__ import annotations

import json

import numpy as np
from laplace_export_helpers import post_json

N_NEW = 48


def test_vllm_serve_gives_the_adapters_greedy_tokens(vllm_serve_server, vllm_engine, tiny_export):
    """3 prompts x 48 greedy tokens from `vllm serve FOLDER --config FOLDER/vllm_serve.yaml
    --enforce-eager` (a server vLLM's CLI started) equal the adapter's engine's (eager, fp32)."""
    from serve.vllm_adapter import generate

    cfg, _, folder = tiny_export
    base, job = vllm_serve_server
    rng = np.random.default_rng(13)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (1, 70, 300)]
    want = [r["token_ids"] for r in generate(vllm_engine, prompts, N_NEW, ignore_eos=True)]
    for prompt, tokens in zip(prompts, want, strict=True):
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": N_NEW,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        status, text = post_json(base + "/v1/completions", body)
        assert status == 200, text
        assert json.loads(text)["choices"][0]["token_ids"] == tokens
    log = job.log_path.read_text()
    assert "LaplaceForCausalLM" in log  # the architecture the plugin registered, in vLLM's log
    settings = (folder / "vllm_serve.yaml").read_text()
    assert "dtype: float32" in settings and "enable-prefix-caching: false" in settings
