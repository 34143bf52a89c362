"""`python -m laplace_jax.info --config laplace-3b`: parameter and state accounting."""

from __future__ import annotations

import argparse

from laplace_jax.accounting import parameter_counts
from laplace_spec.config import get_config


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="laplace-3b", help="preset name or JSON file")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    cfg = get_config(args.config, args.overrides)

    counts = parameter_counts(cfg)
    state = cfg.state_bytes_per_sequence()
    print(f"config {args.config}")
    print(f"  Muon matrices        {counts['muon_matrices']:>16,}")
    print(f"  Muon parameters      {counts['muon_params']:>16,}")
    print(f"  AdamW parameters     {counts['adamw_params']:>16,}")
    print(f"  total parameters     {counts['total_params']:>16,}")
    print("recurrent state per sequence (fp32)")
    print(f"  GLA matrices         {state['gla']:>16,} bytes")
    print(f"  conv window ({cfg.conv_width}-wide) {state['conv']:>16,} bytes")
    print(f"  total                {state['total']:>16,} bytes  (training, PyTorch)")
    print(
        f"  total, {cfg.page_conv_window}-wide window {cfg.page_bytes_per_sequence():>16,} bytes"
        "  (vLLM's state pages)"
    )
    if cfg.attention_every:
        print(
            f"hybrid: attention every {cfg.attention_every} layers: {cfg.n_gla_layers} GLA layers "
            f"keep a state, {cfg.n_attention_layers} attention layers a KV cache (every layer "
            "a conv window)"
        )
        for n in (2_048, 8_192, 32_768):
            kv = cfg.hybrid_kv_bytes(n)
            print(f"  {n:>6,} tokens        {kv:>16,} bytes  bf16 KV of the attention layers")
    print("bf16 KV cache of a transformer of the same width and depth")
    for n in (2_048, 8_192, 32_768):
        kv = cfg.kv_cache_bytes(n)
        print(f"  {n:>6,} tokens        {kv:>16,} bytes  {kv / state['total']:7.1f}x the state")


if __name__ == "__main__":
    main()
