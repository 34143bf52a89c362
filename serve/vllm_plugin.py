"""vLLM general plugin (entry point `vllm.general_plugins: laplace`): registers Laplace.

vLLM calls `register()` in every process it starts (API server, engine core, workers), so a plain
vLLM process finds the architecture `LaplaceForCausalLM` of an exported folder's config.json.
"""

from __future__ import annotations

ARCH = "LaplaceForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    import serve.configuration_laplace  # noqa: F401  registers model_type "laplace" (AutoConfig)

    if ARCH not in ModelRegistry.get_supported_archs():
        # lazy "module:Class" form: the model module is imported only when it is used
        ModelRegistry.register_model(ARCH, "serve.vllm_model:LaplaceVLLMForCausalLM")

    # An out-of-tree state model needs vLLM's mamba config hook, which sets the state page's
    # block size (one page per sequence: block size = max_model_len without prefix caching).
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, MambaModelConfig

    MODELS_CONFIG_MAP.setdefault(ARCH, MambaModelConfig)

    # The servable length is `max_position_embeddings` alone: vLLM would otherwise take the
    # smallest of several keys, including `seq_len`, which is only the training length here.
    from vllm.transformers_utils.model_arch_config_convertor import (
        MODEL_ARCH_CONFIG_CONVERTORS,
        MambaModelArchConfigConvertor,
    )

    class LaplaceArchConfigConvertor(MambaModelArchConfigConvertor):
        def derive_max_model_len_and_key(self):
            return float(self.hf_text_config.max_position_embeddings), "max_position_embeddings"

    MODEL_ARCH_CONFIG_CONVERTORS.setdefault("laplace", LaplaceArchConfigConvertor)
