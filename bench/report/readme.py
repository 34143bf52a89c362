"""README.md, the front page: the fixed-state picture (bench.state_bytes), the default run
(bench.default_run) and the headline figures, each linking to the manual page that explains it."""

from __future__ import annotations

from bench.report.fmt import load, minutes, pct, ratio, spread, table
from bench.report.training import default_run

PAGE = "README.md"


def state_bytes() -> str:
    d = load("state_bytes")
    b, h = d["bytes"], d["headline"]
    rows = [
        [f"{n:,}", f"{b['laplace'][i]:,}", f"{b['hybrid4'][i]:,}", f"{b['transformer'][i]:,}"]
        for i, n in enumerate(d["contexts"])
    ]
    head = ["context (tokens)", "Laplace 3B: fixed state", "3:1 hybrid: states + KV"]
    head += ["same-size transformer: KV cache"]
    return (
        "![bytes per sequence](bench/results/state_bytes.png)\n\n" + table(head, rows) + "\n\n"
        f"Bytes one sequence holds while it is served, computed from the `{d['config']}` shapes "
        f"by `python -m bench.state_bytes` (`bench/results/state_bytes.json`; keys and values in "
        f"bf16, the state in fp32): at 1,048,576 tokens the transformer's KV cache is "
        f"**{h['kv_over_state_1m']:,.0f}x** Laplace's state."
    )


def headlines() -> str:
    serve, train, plan = load("serve"), load("train"), load("plan")
    muon, retrieval, suite = load("muon"), load("retrieval"), load("test_suite")
    passkey = load("passkey")
    r, ph, rh = serve["ratios"], plan["headline"], retrieval["headline"]
    found = " / ".join(
        pct(passkey["headline"][f"passkey_acc_{m}_4096_min"])
        for m in ("laplace", "hybrid", "hybrid4", "attention")
    )
    recall = " / ".join(pct(rh[f"mqar_acc_{m}_128_8"]) for m in ("laplace", "hybrid4", "attention"))
    hybrid4 = "3:1 hybrid" if "gla_branch_scale" in retrieval else "3:1 hybrid (before its scale)"
    rows = [
        [
            "vLLM decode, 8,192-token agent histories, 8 sequences, compiled: Laplace over a "
            "same-size Llama (`small` width)",
            f"**{spread(r['over_llama_tokens_per_s_agent8k_s8_compiled'])}**",
            "[Benchmarks: serving](docs/benchmarks.md#serving)",
        ],
        [
            "1,280 requests in one 1 GiB page budget: Laplace over Llama (one run)",
            f"**{ratio(serve['headline']['over_llama_tokens_per_s_1280_requests'])}**",
            "[Benchmarks: serving](docs/benchmarks.md#serving)",
        ],
        [
            "training step at 8,192 tokens: Laplace over its attention baseline (`small`, CPU)",
            f"**{spread(train['gla_over_transformer_speedup']['8192'])}**",
            "[Benchmarks: training step](docs/benchmarks.md#training-step)",
        ],
        [
            "Laplace 3B train step on 64 NeuronCores, compiled (never run): GiB per device, "
            "at 2,048 / 1,048,576 tokens per sequence",
            f"**{ph['train_step_gib_per_device']:.2f} / {ph['train_step_gib_per_device_1m']:.2f}**",
            "[Long context](docs/long-context.md)",
        ],
        [
            "the 3:1 hybrid 3B at 1,048,576 tokens on 64 NeuronCores, compiled (never run), its "
            f"attention layers in the {ph['attention_context_default']} form: GiB per device / "
            "modelled cost per token over pure Laplace",
            f"**{ph['train_step_gib_per_device_hybrid4_1m']:.2f} / "
            f"{ratio(ph['cost_per_token_hybrid4_1m_over_laplace'], 2)}**",
            "[Hybrid: memory](docs/hybrid.md#memory-at-3b-and-long-contexts)",
        ],
        [
            "Muon's traffic per device, `a2a` over `gather` (3B, 64 devices)",
            f"**{muon['headline']['traffic_ratio']:.1f}x less**",
            "[Benchmarks: Muon](docs/benchmarks.md#muon)",
        ],
        [
            f"MQAR recall at (128, 8), tiny models: Laplace / {hybrid4} / attention "
            f"(mean of {retrieval['seeds']} seeds)",
            f"**{recall}**",
            "[Retrieval](docs/retrieval.md)",
        ],
        [
            "passkey at 4,096 tokens after training at 64, tiny models, the worst depth and "
            f"seed of {passkey['seeds']}: Laplace (one seed) / hybrid / 3:1 hybrid / attention",
            f"**{found}**",
            "[Retrieval: passkey](docs/retrieval.md#passkey)",
        ],
        [
            "the test suite on a 2-core CPU",
            f"{suite['headline']['tests_passed']} tests, {minutes(suite['headline']['wall_s'])}",
            "[Development](docs/development.md)",
        ],
    ]
    return table(["what", "figure", "where it is explained"], rows)


BLOCKS = {"state-bytes": state_bytes, "default-run": default_run, "headlines": headlines}
