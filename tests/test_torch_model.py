"""The PyTorch Laplace (serve/modeling_laplace.py): its own parity chain, with no JAX.

Tolerances (fp32): chunked GLA vs the token-by-token recurrence, abs 1e-5 on outputs and state;
full forward vs prefill + decode, abs 5e-5 on logits of magnitude ~3 (observed ~7e-6);
padded vs unpadded decode: bit-identical (torch.equal).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from serve.modeling_laplace import (  # noqa: E402
    DecodeRunner,
    LaplaceConfig,
    LaplaceForCausalLM,
    LaplaceState,
    gla_chunked,
    gla_step,
    log_decay_schedule,
)

REPO = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=320, d_model=64, n_layers=2, n_heads=4, d_k=8, d_v=16, conv_width=4,
            ffn_dim=128, t_max=64.0, n_tiers=2, seq_len=64, chunk_size=16)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = LaplaceForCausalLM(LaplaceConfig(**TINY)).eval()
    with torch.no_grad():  # perturb every tensor: aug_balance 0 and head-norm 1 are too easy
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def _close(a, b, atol):
    assert (a - b).abs().max().item() <= atol, (a - b).abs().max().item()


@pytest.mark.parametrize("T", [1, 16, 37, 80])
def test_chunked_gla_matches_recurrence_with_initial_state(T):
    torch.manual_seed(T)
    B, H, K, V = 2, 4, 8, 16
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, H, V)
    log_decay = log_decay_schedule(H, 1.0, 64.0)
    s0 = torch.randn(B, H, K, V)
    o, s = gla_chunked(q, k, v, log_decay, s0, K**-0.5, chunk_size=16)
    ref_s, ref_o = s0, []
    for t in range(T):
        o_t, ref_s = gla_step(q[:, t], k[:, t], v[:, t], log_decay, ref_s, K**-0.5)
        ref_o.append(o_t)
    _close(o, torch.stack(ref_o, 1), 1e-5)
    _close(s, ref_s, 1e-5)


@torch.no_grad()
def test_full_forward_equals_prefill_plus_decode(model):
    torch.manual_seed(1)
    ids = torch.randint(0, 320, (2, 45))
    full = model(ids)
    # prefill 20 tokens, prefill 9 more from the state (chunked prefill continued), then decode
    out = model(ids[:, :20])
    logits, state = [out.logits], out.state
    out = model(ids[:, 20:29], state=state)
    logits.append(out.logits)
    state = out.state
    for t in range(29, 45):
        out = model(ids[:, t : t + 1], state=state)
        logits.append(out.logits)
        state = out.state
    _close(torch.cat(logits, 1), full.logits, 5e-5)
    for a, b in zip(state.gla + state.conv, full.state.gla + full.state.conv, strict=True):
        _close(a, b, 5e-5)


def test_state_size_is_the_documented_one():
    c3b = LaplaceConfig()  # laplace-3b defaults
    assert c3b.state_bytes_per_seq() == 29_491_200  # DESIGN.md s2: 28,311,552 + 1,179,648
    tiny = LaplaceConfig(**TINY)
    st = LaplaceState.zeros(tiny, 3)
    assert st.nbytes_per_seq() == tiny.state_bytes_per_seq() == 4 * 2 * (4 * 8 * 16 + 4 * 64)
    assert [tuple(t.shape) for t in st.gla] == [(3, 4, 8, 16)] * 2
    assert [tuple(t.shape) for t in st.conv] == [(3, 4, 64)] * 2


@torch.no_grad()
def test_padded_decode_is_bit_identical(model):
    exact = DecodeRunner(model, row_exact=True)
    padded = DecodeRunner(model, widths=(4, 8))
    _, st1 = model.prefill([[7]])
    alone, _ = exact.step(torch.tensor([3]), st1)
    for n in (1, 3, 5, 7):
        _, st = model.prefill([[7]] + [[i + 1, i + 2] for i in range(n - 1)])
        tokens = torch.tensor([3] + list(range(n - 1)))
        l0, s0 = exact.step(tokens, st)
        l1, s1 = padded.step(tokens, st)
        assert torch.equal(l0, l1)
        assert all(
            torch.equal(a, b) for a, b in zip(s0.gla + s0.conv, s1.gla + s1.conv, strict=True)
        )
        assert torch.equal(l1[:1], alone)  # a row does not depend on its batch-mates
    assert padded.shapes_seen == {4, 8}


@torch.no_grad()
def test_compiled_padded_decode_compiles_once_per_width(model):
    """torch.compile (graph capture only, backend 'eager', to keep the test fast) sees two
    shapes for seven batch widths, and matches eager decode exactly."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    runner = DecodeRunner(model, compile=True, widths=(4, 8), backend="eager")
    exact = DecodeRunner(model, row_exact=True)
    for n in (3, 4, 2, 5, 7, 8, 1):
        _, st = model.prefill([[i + 1] for i in range(n)])
        logits, _ = runner.step(torch.arange(n), st)
        assert torch.equal(logits, exact.step(torch.arange(n), st)[0])
    assert counters["stats"]["unique_graphs"] == 2


@torch.no_grad()
def test_greedy_batched_equals_alone(model):
    prompts = [[5], list(range(1, 40)), [9, 8, 7]]
    together = model.greedy_generate(prompts, 12)
    assert together == [model.greedy_generate([p], 12)[0] for p in prompts]


def test_serving_side_imports_no_jax(tmp_path):
    """The exported folder loads and runs where JAX cannot be imported."""
    code = f"""
import sys
sys.modules["jax"] = None  # any `import jax` now fails
import torch
from serve.modeling_laplace import LaplaceConfig, LaplaceForCausalLM
from export import exporter, names
m = LaplaceForCausalLM(LaplaceConfig(**{TINY!r}))
sd = {{k: v.detach().numpy() for k, v in m.state_dict().items()}}
flat = {{e.jax_path: e.to_jax(sd[e.name]) for e in names.table(m.config)}}
from laplace_jax.config import LaplaceConfig as JC
exporter.export_model(JC(**{TINY!r}), flat, {str(tmp_path)!r})
m2 = LaplaceForCausalLM.from_exported({str(tmp_path)!r})
ids = torch.tensor([[1, 2, 3]])
assert torch.equal(m(ids).logits, m2(ids).logits)
assert "jax" not in [k for k, v in sys.modules.items() if v is not None]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
