"""The two models of `bench.serve` and how their engines are built: Laplace exported from a
JAX initialisation, a same-size Llama, an engine of an exact state/KV budget, and the engine
environment the benchmark runs in."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from laplace_spec.config import BF16_BYTES, FP32_BYTES, LaplaceConfig

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB of state pages / KV cache
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc(callable)
    # Engine core and model in this process: no IPC in the timings, and the model's own forward
    # time can be measured beside the engine's step time (bench/serving/instrument.py).
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def set_engine_environment() -> None:
    """ENGINE_ENV where unset; before the first engine (and before vLLM reads its environment)."""
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)


def export_laplace(cfg: LaplaceConfig, out: Path, max_len: int) -> Path:
    """JAX initialisation, exported with the project's exporter."""
    import jax

    from export import exporter
    from laplace_jax.model import init_params

    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0)))
    return exporter.export_model(cfg, params, out, max_len=max_len)


def make_llama(out: Path, cfg: LaplaceConfig, max_len: int) -> Path:
    """A Llama with Laplace small's width, depth, FFN width and vocabulary; random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    lc = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        max_position_embeddings=max_len,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(lc).save_pretrained(out)
    return out


def make_budget_llm(
    model_dir: Path, max_len: int, max_num_seqs: int, budget_bytes: int, compile: bool = False
):
    """An engine whose state pages / KV cache hold exactly `budget_bytes` (`compile`: vLLM's
    compile mode, the adapter's `--compile`).

    vLLM 0.32's CPU platform (platforms/cpu.py) lets VLLM_CPU_KVCACHE_SPACE, in whole GiB,
    override `kv_cache_memory_bytes` whenever the variable is set, and vLLM parses it as an int
    when it caches its environment (so it cannot be blanked): it is unset while the engine is
    built and restored afterwards. `make_llm` would set the adapter's default again, so the
    adapter's own pieces (plugin, `engine_kwargs`) are used directly."""
    from vllm import LLM

    from serve.vllm_adapter import engine_kwargs, serving_platform
    from serve.vllm_plugin import register

    register()
    kw = engine_kwargs(
        str(model_dir),
        max_model_len=max_len,
        max_num_seqs=max_num_seqs,
        compile=compile,
        platform=serving_platform(),
    )
    saved = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    try:
        return LLM(**kw, kv_cache_memory_bytes=budget_bytes)
    finally:
        if saved is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved


def llama_kv_bytes_per_token(cfg: LaplaceConfig) -> int:
    """fp32 K and V, every layer (the served Llama's dtype): twice laplace_spec's bf16 count."""
    return cfg.kv_cache_bytes(1) * FP32_BYTES // BF16_BYTES
