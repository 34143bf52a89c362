"""The Hugging Face config of Laplace (`model_type` "laplace"), built on `laplace_spec.config`.

`LaplaceHFConfig` declares no model field of its own: its fields, their defaults (laplace-3b)
and their validation are those of the `laplace_spec.config.LaplaceConfig` dataclass, and
`config.laplace_config` returns that dataclass, which every serving module reads for derived
sizes (projection widths, decay schedule, tiers, state shapes and bytes). What it adds is what
Hugging Face and vLLM look for: `model_type`, the standard attribute aliases, the serving
length `max_position_embeddings`, `tie_word_embeddings`, and `layer_types`, each layer's kind as
hybrid models name them ("linear_attention" for a GLA layer, "full_attention" for a hybrid's
attention layer), derived from `attention_every` (a `layer_types` that disagrees is an error).

    config = LaplaceHFConfig(**get_config("tiny").to_dict())   # or AutoConfig.from_pretrained
    config.laplace_config.state_bytes_per_sequence()["total"]
"""

from __future__ import annotations

import dataclasses

from transformers import AutoConfig, PreTrainedConfig

from laplace_spec.config import DEFAULT_SERVE_LENGTH, LaplaceConfig

FIELDS = tuple(f.name for f in dataclasses.fields(LaplaceConfig))


class LaplaceHFConfig(PreTrainedConfig):
    """`laplace_spec.config.LaplaceConfig`'s fields as a Hugging Face config."""

    model_type = "laplace"
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "intermediate_size": "ffn_dim",
    }

    def __init__(
        self,
        max_position_embeddings: int = DEFAULT_SERVE_LENGTH,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        # the model fields: defaults, int -> float coercion and validation from the dataclass;
        # fields given means a saved config.json, whose missing fields predate it (`from_saved`)
        fields = {k: kwargs.pop(k) for k in FIELDS if k in kwargs}
        spec = LaplaceConfig.from_saved(fields) if fields else LaplaceConfig()
        for name, value in spec.to_dict().items():
            setattr(self, name, value)
        given = kwargs.pop("layer_types", None)
        self.layer_types = spec.layer_types
        if given is not None and list(given) != self.layer_types:
            raise ValueError(
                f"layer_types {list(given)} disagrees with attention_every={spec.attention_every} "
                f"over {spec.n_layers} layers, which gives {self.layer_types}"
            )
        # the state is fixed-size, so any length is servable; this is the serving limit
        self.max_position_embeddings = max_position_embeddings
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def laplace_config(self) -> LaplaceConfig:
        """The model fields as the one source of truth (validated again: attributes may be set)."""
        return LaplaceConfig.from_dict({k: getattr(self, k) for k in FIELDS})


AutoConfig.register("laplace", LaplaceHFConfig, exist_ok=True)
