"""The hybrid (`attention_every=k`, docs/design.md s13): an attention layer closing every block of
k layers, the others Laplace's.

Truths: `causal_attention_reference` (laplace_jax/attention.py: the definition, all scores at
once) for the blockwise attention a context slice runs; the pure model's and the attention
baseline's own layers applied in order by hand for the hybrid's forward; `jax.value_and_grad`
of the plain model on one device (tests/test_context_training.py's helpers) for FSDP's block
scan, with and without a context axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_context_training import assert_equals_the_single_device_model

from laplace_jax.accounting import parameter_counts
from laplace_jax.attention import causal_attention_reference
from laplace_jax.attention_context import blockwise_attention
from laplace_jax.model import DecoderLayer, LaplaceLM, init_params, init_state, reset_after_eot
from laplace_spec.config import ConfigError, get_config
from train import main as train_main

EOT = 3
TINY4 = get_config("tiny", ["n_layers=4"])
HYBRID = TINY4.replace(attention_every=2)  # layers: gla, attention, gla, attention


def test_layer_mixers_counts_state_and_kv_bytes():
    assert HYBRID.layer_mixers == ("gla", "attention", "gla", "attention")
    assert (HYBRID.block_size, HYBRID.n_gla_layers, HYBRID.n_attention_layers) == (2, 2, 2)
    assert TINY4.layer_mixers == ("gla",) * 4 and TINY4.block_size == 1
    # the same parameters as pure Laplace: only step 4 of some layers differs
    assert parameter_counts(HYBRID) == parameter_counts(TINY4)
    # Laplace 3B with one attention layer in four: 18 GLA states, 24 conv windows, 6 layers of KV
    big = get_config("laplace-3b", ["attention_every=4"])
    state = big.state_bytes_per_sequence()
    assert state["gla"] == 18 * 16 * 96 * 192 * 4 == 21_233_664
    assert state["conv"] == 24 * 4 * 3072 * 4
    assert big.hybrid_kv_bytes(8_192) == 6 * 16 * (96 + 192) * 2 * 8_192 == 452_984_832
    assert get_config("laplace-3b").hybrid_kv_bytes(8_192) == 0


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["attention_every=1"], "that is token_mixer=attention"),
        (["attention_every=3"], r"must divide n_layers \(2\)"),
        (["attention_every=-2"], "must be 0 .* or >= 2"),
        (["attention_every=2", "token_mixer=attention"], "needs token_mixer=gla"),
    ],
)
def test_bad_attention_every_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        get_config("tiny", overrides)


def test_bad_attention_every_exits_2_with_one_line(capsys):
    assert train_main.main(["--config", "tiny", "attention_every=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: attention_every=3 must divide n_layers (2): the layers repeat in blocks of 3"
    ]


def test_blockwise_attention_equals_the_definition_with_its_gradients():
    """A context slice's view: the queries of positions [16, 32) against all 40 keys, in blocks
    of 12 keys (the last one padded), documents starting at 7, 8 and 30 in sequence 0."""
    rng = np.random.default_rng(0)
    B, T, H, K, V, scale = 2, 40, 2, 8, 16, 8**-0.5
    q, k, v = (jnp.asarray(rng.normal(size=(B, T, H, d)), jnp.float32) for d in (K, K, V))
    reset = np.zeros((B, T), bool)
    reset[0, [7, 8, 30]] = True
    reset = jnp.asarray(reset)
    pos = jnp.arange(T, dtype=jnp.int32)
    doc = jnp.cumsum(reset, 1, dtype=jnp.int32)
    w = jnp.asarray(rng.normal(size=(B, 16, H, V)), jnp.float32)  # a cotangent

    def sliced(q, k, v):
        o = blockwise_attention(q[:, 16:32], k, v, pos[16:32], pos, doc[:, 16:32], doc, scale, 12)
        return jnp.sum(o * w), o

    def definition(q, k, v):
        o = causal_attention_reference(q, k, v, reset, scale)[:, 16:32]
        return jnp.sum(o * w), o

    (_, o), grads = jax.value_and_grad(sliced, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    (_, o_ref), grads_ref = jax.value_and_grad(definition, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    np.testing.assert_allclose(o, o_ref, atol=1e-6)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        np.testing.assert_allclose(g, g_ref, atol=1e-5)
    assert float(jnp.abs(grads[1][:, 32:]).max()) == 0.0  # later keys: never attended


def test_blockwise_attention_memory_does_not_grow_with_the_key_blocks():
    """Under the trainer's per-layer remat, the compiled backward's temporaries hold a fixed
    number of key blocks: 8x the keys adds under a quarter of their bytes. (The form that let JAX
    precompute every block's mask and laid the keys out block-major added 1.6x their bytes.)"""

    def temporaries(Tk, Tq=512, H=2, K=8, V=16, block=64):
        q, k, v = (
            jax.ShapeDtypeStruct((1, T, H, d), jnp.float32) for T, d in ((Tq, K), (Tk, K), (Tk, V))
        )
        pos, doc = jnp.arange(Tk, dtype=jnp.int32), jnp.zeros((1, Tk), jnp.int32)

        @jax.checkpoint
        def loss(q, k, v):
            o = blockwise_attention(q, k, v, pos[-Tq:], pos, doc[:, -Tq:], doc, 0.3, block)
            return o.sum()

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    added_key_bytes = (8_192 - 1_024) * 2 * (8 + 16) * 4
    assert temporaries(8_192) - temporaries(1_024) < added_key_bytes / 4


@pytest.fixture(scope="module")
def batch():
    """8 packed sequences [8, 65] with documents across slice edges, a mask, parameters."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(EOT + 1, HYBRID.vocab_size, (8, HYBRID.seq_len + 1))
    tokens[0, [7, 15, 31]] = EOT  # documents start at 8, 16, 32: slice starts for S = 8, 4, 2
    tokens[1, [40, 41, 42]] = EOT  # one-token documents back to back
    tokens[2, 20] = EOT  # a document across the slice edges after it
    mask = rng.random((8, HYBRID.seq_len)) < 0.3
    params = init_params(HYBRID, jax.random.key(0))
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask), params


def test_the_hybrid_is_its_gla_and_attention_layers_in_order(batch):
    """The hybrid's logits equal its embedding times sqrt(D), then pure Laplace's layer (its
    output projection's weights times 0.1: the GLA branch's multiplier, s13.5) and the attention
    baseline's layer applied by hand in the order gla, attention, gla, attention; and differ
    from pure Laplace's."""
    tokens, _, params = batch
    tokens = tokens[:2, :-1]
    reset = reset_after_eot(tokens, EOT)
    logits, _ = LaplaceLM(HYBRID).apply({"params": params}, tokens, reset=reset)

    kinds = {"gla": TINY4, "attention": TINY4.replace(token_mixer="attention")}
    x = params["embed"]["embedding"][tokens] * TINY4.d_model**0.5  # a hybrid's sqrt(D) (s13.5)
    state = init_state(TINY4, 2)
    for i, kind in enumerate(["gla", "attention", "gla", "attention"]):
        layer, p = DecoderLayer(kinds[kind]), params[f"layer_{i}"]
        if kind == "gla":  # x += 0.1 W_out(y) is x += (0.1 W_out)(y)
            p = {**p, "out": {"kernel": 0.1 * p["out"]["kernel"]}}
        x, _ = layer.apply({"params": p}, x, state[f"layer_{i}"], reset=reset)
    by_hand = LaplaceLM(HYBRID).apply({"params": params}, x, method=LaplaceLM.logits)
    np.testing.assert_allclose(logits, by_hand, rtol=1e-6, atol=1e-6)
    pure, _ = LaplaceLM(TINY4).apply({"params": params}, tokens, reset=reset)
    assert float(jnp.abs(pure - logits).max()) > 1e-2


@pytest.mark.parametrize(
    "form,data,context,masked",
    [
        ("ring", 1, 1, False),
        ("ring", 1, 2, False),
        ("ring", 1, 4, True),
        ("ring", 1, 8, False),
        ("ring", 2, 2, True),
        ("gather", 1, 4, True),
    ],
    ids=[
        "fsdp8",
        "ring-context2",
        "ring-context4-masked",
        "ring-context8",
        "ring-2x2x2-masked",
        "gather-context4-masked",
    ],
)
def test_hybrid_block_scan_and_context_parallel_equal_the_single_device_model(
    batch, form, data, context, masked
):
    """FSDP's scan over blocks of (gla, attention), each layer its own remat checkpoint, on
    fsdp=8, on context=2, 4 and 8 and a 2 x 2 x 2 mesh with the ring (documents starting at a
    slice's first token for every S, one token long, across slice edges), and on context=4 with
    the gather form: the one-device loss (1e-6) and gradients."""
    assert_equals_the_single_device_model(HYBRID, batch, data, context, masked, form)


def test_the_branch_forms_on_a_ring_equal_the_single_device_model():
    """The GLA branch post-normed with a learned gain and the attention layer reading the
    embedding beside the stream (docs/design.md s13.5): parameters only one kind of layer has
    (FSDP stacks zeros for the other) and x_0 carried through the block scan, on context=4 with
    the ring: the one-device loss and gradients, the gains and norm scales made random."""
    cfg = HYBRID.replace(gla_branch="post_norm", attention_input="stream_and_embedding")
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, (8, cfg.seq_len + 1))
    mask = rng.random((8, cfg.seq_len)) < 0.3
    params = init_params(cfg, jax.random.key(0))
    for i, mixer in enumerate(cfg.layer_mixers):
        name = ("branch", "gain") if mixer == "gla" else ("ln_0", "scale")
        params[f"layer_{i}"][name[0]][name[1]] = jnp.asarray(rng.normal(0.5, 0.3, cfg.d_model))
    batch = jnp.asarray(tokens, jnp.int32), jnp.asarray(mask), params
    assert_equals_the_single_device_model(cfg, batch, 1, 4, True, "ring")


HYBRID_RUN = ["--config", "tiny", "attention_every=2", "--mesh", "data=2,fsdp=1,context=4"]


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory):
    """tiny with attention_every=2 (a GLA layer, then an attention layer, a ring over the 4
    devices of the context axis) on data=2,fsdp=1,context=4: 8 steps straight ("whole"), and 4
    steps then a rerun to 8 from the step-4 checkpoint ("split"), checkpoints every 4 steps.
    Returns (whole, split, the data folder)."""
    from train.shards import write_shard

    d = tmp_path_factory.mktemp("hybrid_runs")
    write_shard(d / "train_000000.bin", np.random.default_rng(0).integers(0, 256, 40_000))

    def run(run_dir, steps):
        argv = [*HYBRID_RUN, "--data", str(d / "train_*.bin"), "--run-dir", str(run_dir)]
        argv += ["--no-progress", "--steps", str(steps), "--ckpt-every", "4", "--log-every", "1"]
        argv += ["total_steps=8", "warmup_steps=2", "eval_every=0"]
        assert train_main.main(argv) == 0

    run(d / "whole", 8)
    run(d / "split", 4)
    run(d / "split", 8)
    return d / "whole", d / "split", d


def losses(run_dir) -> dict[int, float]:
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m["loss"] for m in map(json.loads, lines) if "loss" in m}


def test_a_ring_run_on_data_2_context_4_logs_the_one_device_losses_and_sample(tmp_path, capsys):
    """`train.main --mesh data=2,fsdp=1,context=4` of the tiny hybrid on the embedded corpus
    (its attention layers a ring over 4 devices) logs the losses of the same run on one device
    (1e-5: the reduction order differs) and ends with the same greedy sample."""
    from test_context_training import _sample, _train

    steps = ["attention_every=2", "--steps", "4", "--ckpt-every", "4", "eval_every=0"]
    capsys.readouterr()
    ring = _train(tmp_path / "ring", "--mesh", "data=2,fsdp=1,context=4", *steps)
    sample = _sample(capsys.readouterr().out)
    one = _train(tmp_path / "one", "--mesh", "fsdp=1", *steps)
    assert _sample(capsys.readouterr().out) == sample
    assert sorted(ring) == sorted(one) == [1, 2, 3, 4]
    np.testing.assert_allclose([ring[s] for s in ring], [one[s] for s in ring], rtol=1e-5)
    assert abs(ring[4] - ring[1]) > 1e-2  # it learned: the losses compared are not constant


def test_a_hybrid_train_main_run_resumes_bit_identically(hybrid_runs):
    whole, split, _ = hybrid_runs
    assert sorted(losses(split)) == list(range(1, 9)) and losses(split) == losses(whole)


def test_train_eval_scores_a_hybrid_checkpoint_over_a_context_axis(hybrid_runs, tmp_path):
    """`train.eval --task ppl --mesh fsdp=4,context=2` of the hybrid's step-8 checkpoint: the
    mean loss of the plain model on one device over the same windows."""
    import json

    import orbax.checkpoint as ocp

    from laplace_jax.loss import next_token_loss
    from laplace_jax.model import abstract_params
    from train import eval as train_eval
    from train.data import TokenWindows, eval_batches

    whole, _, data = hybrid_runs
    shard = str(data / "train_000000.bin")
    out = tmp_path / "out"
    args = ["--mesh", "fsdp=4,context=2", "--checkpoint", str(whole), "--task", "ppl"]
    args += ["--data", shard, "--batches", "2", "--batch-size", "8", "--out", str(out)]
    assert train_eval.main(args) == 0
    (report,) = out.glob("*.json")
    got = json.loads(report.read_text())["results"]["loss"]
    cfg = get_config("tiny", ["attention_every=2"])
    params = ocp.StandardCheckpointer().restore(
        whole / "checkpoints" / "8" / "params", abstract_params(cfg)
    )
    loss = jax.jit(lambda p, t: next_token_loss(LaplaceLM(cfg), p, t))
    want = np.mean([float(loss(params, b)) for b in eval_batches(TokenWindows([shard], 64), 8, 2)])
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("form", ["ring", "gather"])
def test_the_hybrid_programs_are_neuron_clean_on_a_context_axis(capsys, form):
    """`train.plan` of the tiny hybrid on fsdp=2,context=4: every device program passes the
    Neuron census (no lax.cond picks a mixer or a ring step's halves; the ring's and the key
    blocks' loops have static trip counts), the keys and values travel beside the GLA's
    exchange as the ring's collective-permutes (or the gather form's all-gathers), the modelled
    FLOPs count the share of the square each form scores, and the end-of-run sample is the
    recompute program (an attention layer has no decode step)."""
    import json

    from train import plan as train_plan

    argv = ["--config", "tiny", "attention_every=2", "global_batch_tokens=512"]
    argv += [f"attention_context={form}", "--mesh", "fsdp=2,context=4", "--json"]
    assert train_plan.main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["headline"]["neuron_census_violations"] == 0
    assert "generate_recompute" in plan["programs"] and "generate_decode" not in plan["programs"]
    step = plan["programs"]["train_step"]
    assert step["census"]["violations"] == 0
    assert step["collectives"]["context-exchange"] > 0 and step["collectives"]["all-gather"] > 0
    moved = step["collectives"].get("collective-permute", 0)
    assert (moved > 0) if form == "ring" else (moved == 0)
    assert plan["flops"]["attention_share_of_square"] == (9 / 16 if form == "ring" else 1.0)
