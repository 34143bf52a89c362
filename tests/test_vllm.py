"""vLLM serving: greedy parity JAX == PyTorch == vLLM, and the OpenAI server.

The export, the offline engine and the server are the session's (tests/shared_fixtures.py):
the parity tests and the offline command line ask the shared engine, the server tests the
shared 2-replica server; each engine start costs tens of seconds on this CPU.
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
from laplace_export_helpers import post_json
from shared_fixtures import SERVER_MAX_LEN, set_vllm_env

N_NEW = 48


@pytest.fixture(scope="module")
def exported(tiny_export):
    return tiny_export


@pytest.fixture(scope="module")
def prompts(exported):
    cfg = exported[0]
    rng = np.random.default_rng(7)
    return [
        [5],  # one token: vLLM schedules it as a decode
        rng.integers(0, cfg.vocab_size, 300).tolist(),  # several hundred tokens
        rng.integers(0, cfg.vocab_size, 17).tolist(),
    ]


@pytest.fixture(scope="module")
def reference(exported, prompts):
    """Greedy tokens of the JAX model, each prompt alone (the training reference)."""
    from laplace_jax.generate import greedy_generate

    cfg, params, _ = exported
    return [greedy_generate(params, cfg, p, N_NEW).tolist() for p in prompts]


@pytest.fixture(scope="module")
def llm(vllm_engine):
    return vllm_engine


def test_torch_greedy_matches_jax(exported, prompts, reference):
    from serve.generation import greedy_generate
    from serve.modeling_laplace import LaplaceForCausalLM

    model = LaplaceForCausalLM.from_exported(exported[2])
    assert greedy_generate(model, prompts, N_NEW) == reference  # batched together
    assert [greedy_generate(model, [p], N_NEW)[0] for p in prompts] == reference  # alone


def test_hf_generate_matches_jax(exported, prompts, reference):
    """transformers' generate() on the folder, left-padded batch: the JAX tokens, which the
    vLLM tests below also match (tests/test_hf_generate.py covers generate() in depth)."""
    import torch
    from transformers import AutoModelForCausalLM

    import serve.modeling_laplace  # noqa: F401  registers the Auto classes

    model = AutoModelForCausalLM.from_pretrained(exported[2], dtype=torch.float32).eval()
    T = max(map(len, prompts))
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=N_NEW,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert out[:, T:].tolist() == reference


def test_vllm_greedy_matches_jax_batched_and_alone(llm, prompts, reference):
    from serve.vllm_adapter import generate

    together = [r["token_ids"] for r in generate(llm, prompts, N_NEW, ignore_eos=True)]
    assert together == reference
    # alone, after the batch: pages are reused, so a fresh sequence must start from zeros
    for p, ref in zip(reversed(prompts), reversed(reference), strict=True):
        assert generate(llm, [p], N_NEW, ignore_eos=True)[0]["token_ids"] == ref


def test_vllm_mixed_prefill_and_decode_steps(llm, prompts, reference):
    """Requests of very different lengths in one engine call: vLLM mixes decodes of short
    sequences with prefill chunks of long ones in the same steps."""
    from serve.vllm_adapter import generate

    many = [prompts[1], prompts[0], prompts[2], prompts[0], prompts[1]]
    want = [reference[1], reference[0], reference[2], reference[0], reference[1]]
    assert [r["token_ids"] for r in generate(llm, many, N_NEW, ignore_eos=True)] == want


def _state_pages(worker):
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    layers = [m for m in worker.model_runner.model.modules() if isinstance(m, MambaBase)]
    return [[(tuple(t.shape[1:]), str(t.dtype), t[0].nbytes) for t in m.kv_cache] for m in layers]


def test_vllm_state_pages_hold_the_documented_state(llm, exported):
    """One page per sequence and layer, laid out as vLLM's Mamba2 lays out its own: conv
    window [W - 1, D] and GLA [H, dv, dk], fp32; their bytes, summed over the layers, are
    laplace_spec's page bytes per sequence (the state with the W - 1 window)."""
    cfg = exported[0]
    pages = [
        [(tuple(s), d, n) for s, d, n in layer] for layer in llm.collective_rpc(_state_pages)[0]
    ]
    conv, gla = (cfg.conv_width - 1, cfg.d_model), (cfg.n_heads, cfg.d_v, cfg.d_k)
    assert (
        pages
        == [
            [
                (conv, "torch.float32", 4 * math.prod(conv)),
                (gla, "torch.float32", 4 * math.prod(gla)),
            ]
        ]
        * cfg.n_layers
    )
    assert sum(n for layer in pages for _, _, n in layer) == cfg.page_bytes_per_sequence()


def test_cli_offline_json(llm, exported, prompts, reference, monkeypatch, capsys):
    """`python -m serve.vllm_adapter --prompt ... --prompt-ids ... --json`: its main() on the
    shared engine (the engine it would build differs from the fixture's only in max_num_seqs, a
    derived default; the server tests below ask a server the command started)."""
    from serve import vllm_adapter

    built = {}

    def shared_engine(model, **kwargs):
        built.update(model=model, **kwargs)
        return llm

    monkeypatch.setattr(vllm_adapter, "make_llm", shared_engine)
    ids = ",".join(map(str, prompts[2]))
    argv = ["--model", str(exported[2]), "--prompt-ids", ids, "--prompt", "the quick brown"]
    flags = ["--max-tokens", "8", "--temperature", "0", "--ignore-eos", "--json"]
    assert vllm_adapter.main([*argv, *flags]) == 0
    engine_args = dict(max_model_len=None, max_num_seqs=None, compile=None, seed=0)
    assert built == dict(model=str(exported[2]), dtype="auto", prefix_caching=None, **engine_args)
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    # text prompts first, then token-id prompts
    assert rows[0]["prompt"] == "the quick brown" and len(rows[0]["token_ids"]) == 8
    assert rows[1]["token_ids"] == reference[2][:8]


def test_offline_greedy_stops_at_the_end_of_text_token(llm, exported):
    """Offline generation stops at the end-of-text token, as the server does (before, greedy
    offline generation ran past it: `ignore_eos` was on for every temperature-0 call);
    `ignore_eos=True` gives fixed lengths. The prompts are found with the PyTorch model: random
    ones whose greedy continuation reaches the end-of-text token within 48 tokens."""
    from serve.generation import greedy_generate
    from serve.modeling_laplace import LaplaceForCausalLM
    from serve.vllm_adapter import generate

    cfg, _, folder = exported
    eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    model = LaplaceForCausalLM.from_exported(folder)
    rng = np.random.default_rng(3)
    stopping = []
    for _ in range(20):  # batches of 32 random prompts, until two reach the token
        batch = [rng.integers(0, cfg.vocab_size, 9).tolist() for _ in range(32)]
        for prompt, tokens in zip(batch, greedy_generate(model, batch, N_NEW), strict=True):
            if eos in tokens and len(stopping) < 2:
                stopping.append((prompt, tokens[: tokens.index(eos) + 1]))
        if len(stopping) == 2:
            break
    assert len(stopping) == 2, "no random prompt's greedy continuation reached the token"
    got = generate(llm, [p for p, _ in stopping], N_NEW)
    assert [r["token_ids"] for r in got] == [want for _, want in stopping]
    fixed = generate(llm, [p for p, _ in stopping], N_NEW, ignore_eos=True)
    assert all(len(r["token_ids"]) == N_NEW for r in fixed)


# ---- the OpenAI-compatible server (the session's 2-replica server) ---------------------------


@pytest.fixture(scope="module")
def server(replica_server):
    return replica_server.base, replica_server.proc


def test_server_completion_matches_greedy(server, prompts, reference):
    base, _ = server
    body = {
        "model": "laplace-tiny",
        "prompt": prompts[2],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    status, text = post_json(base + "/v1/completions", body)
    assert status == 200, text
    choice = json.loads(text)["choices"][0]
    assert choice["token_ids"] == reference[2][:12]


def test_server_text_prompt_and_stream(server):
    base, _ = server
    body = {
        "model": "laplace-tiny",
        "prompt": "the lazy dog",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    status, text = post_json(base + "/v1/completions", body)
    assert status == 200, text
    full = json.loads(text)["choices"][0]
    assert len(full["token_ids"]) == 6
    status, text = post_json(base + "/v1/completions", {**body, "stream": True})
    assert status == 200, text
    events = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = [t for c in chunks for ch in c["choices"] for t in (ch.get("token_ids") or [])]
    assert streamed == full["token_ids"]
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == full["text"]


@pytest.mark.parametrize(
    "bad",
    [
        {"prompt": "", "max_tokens": 4},
        {"prompt": "the dog", "max_tokens": -1},
        {"prompt": list(range(1, SERVER_MAX_LEN + 20)), "max_tokens": 4},  # over max-model-len
    ],
    ids=["empty-prompt", "negative-max-tokens", "prompt-too-long"],
)
def test_server_rejects_bad_requests_and_keeps_serving(server, bad):
    base, proc = server
    status, text = post_json(base + "/v1/completions", {"model": "laplace-tiny", **bad})
    assert 400 <= status < 500, (status, text)
    status, _ = post_json(
        base + "/v1/completions", {"model": "laplace-tiny", "prompt": [3, 4], "max_tokens": 2}
    )
    assert status == 200 and proc.poll() is None


# ---- bf16 served as bf16; defaults derived from the folder -----------------------------------

# The two bf16 paths follow one contract (docs/design.md s12.4), so they differ only where vLLM's
# kernels sum in another fp32 order than the PyTorch ones (GEMMs, the GLA's output), and an entry
# then rounds to the neighbouring bf16 value. On an Intel Xeon (AMX) none did in this tiny model
# (0.0 on every step); on an AMD EPYC (AVX-512 BF16, no AMX) 2 of the 300-token prompt's GLA
# outputs in layer 0 did (of 19,200), and 3 of its 48 steps were 1.45e-2 to 1.57e-2 apart, the
# other 141 of 144 within 8e-4. So most steps must be within BF16_LOGPROB_TOL, and the rest within
# one such rounding's reach, BF16_FLIP_TOL (before the contract most steps differed: 3.3e-2 at
# most, against the module's whole-sequence form)
BF16_LOGPROB_TOL = 5e-3
BF16_FLIP_TOL = 2.5e-2
BF16_FLIP_STEPS = 0.1  # the share of steps that may be past BF16_LOGPROB_TOL


def _dtypes(worker):
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    model = worker.model_runner.model
    pages = {str(t.dtype) for m in model.modules() if isinstance(m, MambaBase) for t in m.kv_cache}
    return sorted({str(p.dtype) for p in model.parameters()}), sorted(pages)


def test_vllm_bf16_export_served_as_bf16(exported, prompts):
    """A bf16 export is served with bf16 weights and fp32 state pages; the log-probabilities of
    the tokens vLLM picks equal the PyTorch bf16 module's on the same tokens (teacher-forced,
    prefill then one token at a time, as vLLM runs) within BF16_LOGPROB_TOL on most steps and
    within BF16_FLIP_TOL on every step, and each greedy token vLLM picks is the module's best
    or within BF16_FLIP_TOL of it (a near tie that a rounding apart can flip); a pick further
    behind reports the module's top-two margin there."""
    import torch
    from vllm import SamplingParams

    from export import exporter
    from serve.generation import stepwise_logprobs
    from serve.modeling_laplace import LaplaceForCausalLM
    from serve.vllm_adapter import make_llm

    cfg, params, out = exported
    bf = exporter.export_model(
        cfg,
        params,
        out.parent / "bf16",
        tokenizer_dir=out.parent / "tok",
        max_len=1024,
        dtype="bf16",
    )
    set_vllm_env()
    engine = make_llm(str(bf), max_num_seqs=8)  # its own engine: the dtype is the export's
    try:
        assert engine.collective_rpc(_dtypes)[0] == (["torch.bfloat16"], ["torch.float32"])
        sp = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True, logprobs=1)
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    finally:
        del engine
    module = LaplaceForCausalLM.from_exported(bf, dtype=torch.bfloat16)
    for p, o in zip(prompts, outs, strict=True):
        toks = list(o.outputs[0].token_ids)
        got = torch.tensor([d[t].logprob for d, t in zip(o.outputs[0].logprobs, toks, strict=True)])
        logp = stepwise_logprobs(module, p, toks)  # [N_NEW, vocab]
        want = logp[torch.arange(N_NEW), toks]
        gap = (got - want).abs()
        apart = (gap > BF16_LOGPROB_TOL).float().mean().item()
        assert apart <= BF16_FLIP_STEPS, (len(p), gap.tolist())
        assert gap.max().item() <= BF16_FLIP_TOL, (len(p), gap.argmax().item(), gap.max())
        # vLLM's greedy pick is the module's best token, or one the module ranks within a
        # rounding's reach of it (a near tie: seen on the AMD CPU, a tie of 0.0 at one step)
        behind = logp.max(-1).values - want  # [N_NEW] how far vLLM's pick is behind the best
        if behind.max().item() > BF16_FLIP_TOL:
            t = behind.argmax().item()
            top2 = logp[t].topk(2).values
            margin = (top2[0] - top2[1]).item()
            raise AssertionError(f"prompt of {len(p)}: greedy parts at step {t}, margin {margin}")


def test_default_max_num_seqs_from_the_state_page_budget(llm, exported):
    """The engine's page count is budget // state bytes per sequence (one page per sequence);
    the default max_num_seqs is that minus vLLM's null page, capped; a given value wins."""
    from serve.vllm_adapter import (
        MAX_DEFAULT_SEQS,
        default_max_num_seqs,
        engine_kwargs,
        state_budget_bytes,
    )

    cfg, _, out = exported
    per_seq = cfg.page_bytes_per_sequence()
    pages = state_budget_bytes() // per_seq
    assert llm.llm_engine.vllm_config.cache_config.num_gpu_blocks == pages
    assert default_max_num_seqs(out) == min(pages - 1, MAX_DEFAULT_SEQS)
    assert default_max_num_seqs(out, budget_bytes=100 * per_seq) == 99
    assert engine_kwargs(out, platform="cpu")["max_num_seqs"] == default_max_num_seqs(out)
    assert engine_kwargs(out, max_num_seqs=8, platform="cpu")["max_num_seqs"] == 8
    assert engine_kwargs(out, platform="cpu")["dtype"] == "float32"


def test_server_argv_has_seed_dtype_and_skip_tokenizer_init(exported, tmp_path, monkeypatch):
    """Server mode passes --seed, the dtype, the derived --max-num-seqs and, for a folder
    without tokenizer.json, --skip-tokenizer-init (as the offline path does)."""
    import runpy
    import shutil

    from serve import vllm_adapter

    cfg, _, out = exported
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(out / f, bare / f)
    seen = {}
    monkeypatch.setattr(runpy, "run_module", lambda *a, **k: seen.update(argv=list(sys.argv)))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(vllm_adapter, "serving_platform", lambda: "cpu")  # the CPU's argv
    args = ["--model", str(bare), "--port", "1", "--seed", "7", "--dtype", "bf16"]
    assert vllm_adapter.main(args) == 0
    argv = seen["argv"]
    flag = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
    assert flag["--seed"] == "7" and flag["--dtype"] == "bfloat16"
    assert flag["--max-num-seqs"] == str(vllm_adapter.default_max_num_seqs(bare))
    assert "--skip-tokenizer-init" in argv
    assert vllm_adapter.main([*args[:-2], "--max-num-seqs", "5"]) == 0
    argv = seen["argv"]
    assert "--skip-tokenizer-init" in argv and argv[argv.index("--max-num-seqs") + 1] == "5"
    assert argv[argv.index("--dtype") + 1] == "float32"  # the export's own dtype
