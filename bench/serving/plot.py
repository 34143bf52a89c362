"""The PNG beside a `bench.serve` result: throughput, cost per token, memory, ratios."""

from __future__ import annotations

from pathlib import Path


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    quick = " [QUICK]" if results.get("quick") else ""
    ax = axes[0]
    for key, label in (
        ("laplace_throughput_p128", "Laplace"),
        ("llama_throughput_p128", "Llama"),
        ("laplace_compiled_throughput_p128", "Laplace, compiled"),
        ("llama_compiled_throughput_p128", "Llama, compiled"),
    ):
        if key in results:
            rows = results[key]
            ax.plot(
                [r["concurrency"] for r in rows],
                [r["median_tokens_per_s"] for r in rows],
                "o-" if "compiled" not in key else "s--",
                label=label,
            )
    ax.set(
        xscale="log",
        xlabel="concurrent sequences",
        ylabel="output tokens/s",
        title="Output tokens/s, 128-token prompts (medians)" + quick,
    )
    ax.legend()
    ax = axes[1]
    for key, label in (("laplace_cost", "Laplace"), ("llama_cost", "Llama")):
        if key in results:
            rows = results[key]
            ms = [1e3 * r["median_seconds_per_output_token"] for r in rows]
            ax.plot([r["prompt_len"] for r in rows], ms, "o-", label=label)
    ax.set(
        xlabel="prompt tokens",
        ylabel="ms per output token",
        title="Cost per output token vs prompt length" + quick,
    )
    ax.legend()
    ax = axes[2]
    rows = results["memory_per_seq"]
    ax.plot(
        [r["context"] for r in rows],
        [r["laplace_state_bytes"] / 1e6 for r in rows],
        "o-",
        label="Laplace state (fixed)",
    )
    ax.plot(
        [r["context"] for r in rows],
        [r["llama_kv_bytes_fp32"] / 1e6 for r in rows],
        "o-",
        label="Llama KV cache (fp32)",
    )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="context tokens",
        ylabel="MB per sequence",
        title="Memory per sequence",
    )
    ax.legend()
    ax = axes[3]
    ratios = {
        k.removeprefix("over_llama_tokens_per_s_"): v
        for k, v in results["headline"].items()
        if k.startswith("over_llama")
    }
    ax.bar(list(ratios), list(ratios.values()))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(ylabel="Laplace / Llama output tokens/s", title="Laplace over Llama" + quick)
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
