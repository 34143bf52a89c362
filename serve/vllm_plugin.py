"""vLLM general plugin (entry point `vllm.general_plugins: laplace`): registers Laplace.

vLLM calls `register()` in every process it starts (API server, engine core, workers), so a plain
vLLM process finds the architecture of an exported folder's config.json: `LaplaceForCausalLM`, or
`LaplaceHybridForCausalLM` for a hybrid (attention layers among the GLA layers).

It also starts, in an engine or worker process vLLM spawned, the watch that ends it with the
process that started it (serve/parent_watch.py: vLLM's engines outlived a server killed with
SIGKILL).

The model goes through vLLM's public `ModelRegistry`. Two more tables of vLLM 0.32 have no
public registration call, and an out-of-tree state model still needs an entry in each (added
only where absent; tests/test_vllm_model.py fails when either table is gone or no longer needed):

    vllm.model_executor.models.config.MODELS_CONFIG_MAP
        architecture -> config hook. vLLM sizes a state model's pages (`mamba_block_size`:
        max_model_len, or the block size with prefix caching, which also needs align mode)
        only in `MambaModelConfig`, and applies it only to the architectures listed here;
        without it the engine stops at the unset block size.
    vllm.transformers_utils.model_arch_config_convertor.MODEL_ARCH_CONFIG_CONVERTORS
        model_type -> config convertor. The default takes the servable length as the smallest
        of several config keys, `seq_len` (here only the training length) among them; Laplace's
        is `max_position_embeddings` alone. It also gives a hybrid's KV head size and count.
"""

from __future__ import annotations

ARCH = "LaplaceForCausalLM"
HYBRID_ARCH = "LaplaceHybridForCausalLM"  # attention_every > 0 (laplace_spec's `architecture`)
MODEL_TYPE = "laplace"


def register() -> None:
    from serve.parent_watch import watch_parent

    watch_parent()  # an engine or worker ends with the process that started it

    from vllm import ModelRegistry

    import serve.configuration_laplace  # noqa: F401  registers model_type "laplace" (AutoConfig)

    for arch, cls in (
        (ARCH, "LaplaceVLLMForCausalLM"),
        (HYBRID_ARCH, "LaplaceHybridVLLMForCausalLM"),
    ):
        if arch not in ModelRegistry.get_supported_archs():
            # lazy "module:Class" form: the model module is imported only when it is used
            ModelRegistry.register_model(arch, f"serve.vllm_model:{cls}")

    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, MambaModelConfig

    # (the hybrid needs no entry: vLLM runs its hybrid hook, which runs MambaModelConfig's, on
    # every model whose class declares IsHybrid)
    MODELS_CONFIG_MAP.setdefault(ARCH, MambaModelConfig)

    from vllm.transformers_utils.model_arch_config_convertor import (
        MODEL_ARCH_CONFIG_CONVERTORS,
        MambaModelArchConfigConvertor,
    )

    class LaplaceArchConfigConvertor(MambaModelArchConfigConvertor):
        """The servable length is `max_position_embeddings` alone. A hybrid's attention layers
        have n_heads KV heads of `kv_page_head_size` (keys and values zero-padded to it), the
        sizes vLLM gives its KV pages; a pure model has none (as Mamba's convertor says)."""

        def derive_max_model_len_and_key(self):
            return float(self.hf_text_config.max_position_embeddings), "max_position_embeddings"

        def get_head_size(self) -> int:
            spec = self.hf_text_config.laplace_config
            return spec.kv_page_head_size if spec.attention_every else 0

        def get_total_num_kv_heads(self) -> int:
            spec = self.hf_text_config.laplace_config
            return spec.n_heads if spec.attention_every else 0

    MODEL_ARCH_CONFIG_CONVERTORS.setdefault(MODEL_TYPE, LaplaceArchConfigConvertor)
