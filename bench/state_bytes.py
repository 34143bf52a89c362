"""What one sequence holds while it is served, against its context length: Laplace 3B's fixed
state, the 3:1 hybrid's (its GLA states plus its attention layers' keys and values) and the KV
cache of a softmax transformer of the same width and depth (a same-size Llama).

    python -m bench.state_bytes        # bench/results/state_bytes.json and state_bytes.png

Computed from the config's shapes (laplace_spec/config.py, docs/design.md s5), not measured: the
serving benchmark measures the same bytes on vLLM's pages for the `small` preset and finds them
equal to the computed ones (bench/results/serve.json, `state_bytes_per_seq_measured`). Laplace's
figure is the fp32 state of the JAX and PyTorch models (the 4-wide conv window); the hybrid's
and the transformer's keys and values are bf16, as they are served.
"""

from __future__ import annotations

import argparse

from bench.common import RESULTS, write_result
from laplace_spec.config import get_config

CONTEXTS = (1_024, 4_096, 16_384, 65_536, 262_144, 1_048_576)
HYBRID_EVERY = 4  # the 3:1 layout (docs/design.md s13)


def bytes_by_context(preset: str) -> dict[str, list[int]]:
    """Bytes one sequence holds at each of CONTEXTS: {"laplace", "hybrid4", "transformer"}."""
    laplace = get_config(preset)
    hybrid = get_config(preset, [f"attention_every={HYBRID_EVERY}"])
    state = laplace.state_bytes_per_sequence()["total"]
    hybrid_state = hybrid.state_bytes_per_sequence()["total"]
    return {
        "laplace": [state for _ in CONTEXTS],
        "hybrid4": [hybrid_state + hybrid.hybrid_kv_bytes(n) for n in CONTEXTS],
        "transformer": [laplace.kv_cache_bytes(n) for n in CONTEXTS],
    }


def plot(rows: dict[str, list[int]], preset: str, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    labels = {
        "laplace": f"Laplace ({preset}): fixed state",
        "hybrid4": "3:1 hybrid: GLA states + attention KV",
        "transformer": "same-size transformer: KV cache (bf16)",
    }
    for name, values in rows.items():
        ax.plot(CONTEXTS, [v / 2**20 for v in values], marker="o", label=labels[name])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("MiB per sequence")
    ax.set_title(f"Bytes one sequence holds ({preset}, from its shapes)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.state_bytes", description=__doc__)
    ap.add_argument("--config", default="laplace-3b", help="preset (default laplace-3b)")
    args = ap.parse_args(argv)
    rows = bytes_by_context(args.config)
    figure = RESULTS / "state_bytes.png"
    plot(rows, args.config, figure)
    last = len(CONTEXTS) - 1
    headline = {
        "state_bytes_laplace": rows["laplace"][0],
        "kv_bytes_transformer_32k": get_config(args.config).kv_cache_bytes(32_768),
        "kv_over_state_1m": rows["transformer"][last] / rows["laplace"][last],
        "hybrid4_over_state_1m": rows["hybrid4"][last] / rows["laplace"][last],
    }
    path = write_result(
        "state_bytes",
        headline,
        config=args.config,
        hybrid_attention_every=HYBRID_EVERY,
        contexts=list(CONTEXTS),
        bytes=rows,
        notes="computed from the config's shapes (laplace_spec/config.py), not measured",
    )
    for i, n in enumerate(CONTEXTS):
        print(f"{n:>9,} tokens: " + "  ".join(f"{k} {v[i]:>15,}" for k, v in rows.items()))
    print(path, figure)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
