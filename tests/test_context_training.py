"""The training loss and gradients with sequences split over a `context` mesh axis
(laplace_jax/fsdp.py with laplace_jax/context_parallel.py) against the plain model.

The truth is `jax.value_and_grad` of the model's own loss on one device, whole sequences through
its own layer loop. On 8 simulated devices, `context` = 2, 4 and 8 (fsdp = 4, 2, 1) and a
2 x 2 x 2 data x fsdp x context mesh must give the same loss (fp32: 1e-6 relative) and every
gradient leaf (GRAD_TOL of its largest entry), with packed documents that cross slice boundaries,
start exactly at a slice's first token (for every S used) and run back to back one token long,
slices of one chunk (S = 4: 16 tokens, the chunk size) and of half a chunk (S = 8), and a masked
task (the mean over the scored targets only, one sequence scoring none).
"""

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laplace_jax.fsdp import make_loss, make_loss_and_grad
from laplace_jax.loss import blocked_cross_entropy, next_token_losses
from laplace_jax.model import LaplaceLM, init_params
from laplace_jax.sharding import make_mesh, param_shardings, param_specs
from laplace_spec.config import get_config

TINY = get_config("tiny")  # seq_len 64, chunk 16, conv width 4, 2 layers
EOT = 3


@pytest.fixture(scope="module")
def batch():
    """8 packed sequences [8, 65], their answer mask [8, 64], fp32 parameters (host arrays)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(EOT + 1, TINY.vocab_size, (8, TINY.seq_len + 1))
    tokens[0, [7, 15, 31]] = EOT  # documents start at 8, 16, 32: a slice start for S = 8, 4, 2
    tokens[1, [40, 41, 42]] = EOT  # one-token documents back to back
    tokens[2, 20] = EOT  # a document running across the slice boundaries after it
    tokens[3, 62] = EOT  # a document of the last target only
    mask = rng.random((8, TINY.seq_len)) < 0.3
    mask[5] = False  # a sequence that scores nothing
    params = init_params(TINY, jax.random.key(0))
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask), params


def plain_value_and_grad(cfg, params, tokens, mask=None):
    """The truth: one device, whole sequences, the model's own layer loop."""

    def loss(p):
        ce = next_token_losses(LaplaceLM(cfg), p, tokens, EOT)
        return ce.mean() if mask is None else (ce * mask).sum() / mask.sum()

    return jax.jit(jax.value_and_grad(loss))(params)


def context_value_and_grad(
    cfg, params, tokens, mask, data, context, remat="layer", attention_context="ring"
):
    mesh = make_mesh(8, data=data, context=context)
    model = LaplaceLM(cfg, attention_context=attention_context)
    fn = make_loss_and_grad(model, mesh, param_specs(cfg, mesh), remat, eot_id=EOT)
    placed = jax.device_put(params, param_shardings(cfg, mesh))
    return jax.jit(fn)(placed, tokens, mask), mesh


# fp32 reduction order: on a Xeon with AVX-512 the FSDP step *without* a context axis already
# differs from the plain model by 1.4e-5 / 2.6e-5 (unmasked / masked, layer_1/aug_balance, a
# leaf of small entries; context=2 against that FSDP step: 1.3e-6); 1e-5 passed on AMD EPYC
# machines. A conv window not handed across slices (planted) errs by 0.80.
GRAD_TOL = 5e-5


def max_rel(a, b):
    """Largest |a - b| / max|b| over the leaves of two gradient trees."""
    rel = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y))), a, b)
    return max(jax.tree.leaves(rel))


def assert_equals_the_single_device_model(
    cfg, batch, data, context, masked, attention_context="ring"
):
    """The sharded loss (1e-6) and gradients (GRAD_TOL) of `cfg` on a data x fsdp x context mesh
    (a hybrid's attention layers in the form `attention_context`) against the plain model's on
    one device; returns (gradients, mesh)."""
    tokens, mask, params = batch
    mask = mask if masked else None
    ref_loss, ref_grads = plain_value_and_grad(cfg, params, tokens, mask)
    (loss, grads), mesh = context_value_and_grad(
        cfg, params, tokens, mask, data, context, attention_context=attention_context
    )
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
    assert max_rel(grads, ref_grads) < GRAD_TOL
    return grads, mesh


@pytest.mark.parametrize(
    "data,context,masked",
    [(1, 2, False), (1, 4, True), (1, 8, False), (2, 2, True)],
    ids=["context2", "context4-masked", "context8", "2x2x2-masked"],
)
def test_context_parallel_loss_and_gradients_equal_the_single_device_model(
    batch, data, context, masked
):
    grads, mesh = assert_equals_the_single_device_model(TINY, batch, data, context, masked)
    # the gradients come back sharded like the parameters, over fsdp x context
    shardings = param_shardings(TINY, mesh)
    for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(shardings), strict=True):
        assert g.sharding.is_equivalent_to(s, g.ndim)
    w12 = shardings["layer_0"]["w12"]["kernel"]
    assert w12.shard_shape((TINY.d_model, 2 * TINY.ffn_dim))[0] == TINY.d_model * data // 8


def test_bf16_context_parallel_stays_as_close_to_the_plain_bf16_model_as_fsdp_does(batch):
    """bf16 compute, context = 4 against the plain bf16 model: the loss within 1e-4, every
    gradient leaf within 10% of its largest entry and no further than 1.25x the gap the same
    step without a context axis (fsdp = 8) has. bf16 rounds in different places (gathered
    weights, the layer scan; here the slices' correction adds in fp32 what the single-device
    scan carries); with these packed documents both gaps are about 7%, at `aug_balance`."""
    tokens, _, params = batch
    bf16 = TINY.replace(compute_dtype="bfloat16")
    ref_loss, ref_grads = plain_value_and_grad(bf16, params, tokens)
    gaps = {}
    for context in (1, 4):
        (loss, grads), _ = context_value_and_grad(bf16, params, tokens, None, 1, context)
        assert abs(float(loss) - float(ref_loss)) <= 1e-4 * float(ref_loss)
        gaps[context] = max_rel(grads, ref_grads)
    assert gaps[4] < 0.1 and gaps[4] <= 1.25 * gaps[1], gaps


def test_the_sharded_eval_loss_is_the_training_loss(batch):
    """make_loss (the eval step's forward) on a context mesh is the plain model's mean loss."""
    tokens, _, params = batch
    mesh = make_mesh(8, context=4)
    fn = make_loss(LaplaceLM(TINY), mesh, param_specs(TINY, mesh), eot_id=EOT)
    loss = jax.jit(fn)(jax.device_put(params, param_shardings(TINY, mesh)), tokens)
    ref, _ = plain_value_and_grad(TINY, params, tokens)
    assert abs(float(loss) - float(ref)) <= 1e-6 * float(ref)


def test_sequences_that_do_not_slice_are_refused(batch):
    tokens, _, params = batch
    mesh = make_mesh(8, context=8)
    fn = make_loss_and_grad(LaplaceLM(TINY), mesh, param_specs(TINY, mesh))
    for T, match in ((60, "cannot be cut into context=8 equal slices"), (24, "conv window")):
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(fn, params, tokens[:, : T + 1])


def test_blocked_cross_entropy_equals_whole_logits_and_holds_one_block():
    """ce and its gradients a block at a time equal whole logits' (blocks that do not divide the
    tokens included); the compiled gradient holds no f32 buffer of more than one block's logits."""
    rng = np.random.default_rng(0)
    B, T, D, V, block = 3, 40, 16, 512, 32
    x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((D, V)) * 0.3, jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)

    def logits(w, x):
        return x @ w

    def loss(w, x, block):
        return blocked_cross_entropy(logits, w, x, targets, block).mean()

    whole = jax.value_and_grad(loss, argnums=(0, 1))(w, x, B * T)
    blocked = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
    got = blocked(w, x, block)
    np.testing.assert_allclose(got[0], whole[0], rtol=1e-6)
    for g, e in zip(got[1], whole[1], strict=True):
        np.testing.assert_allclose(g, e, atol=1e-6 * float(jnp.abs(e).max()))
    text = blocked.lower(w, x, block).compile().as_text()
    sizes = [
        int(np.prod([int(d) for d in dims.split(",") if d]))
        for dims in re.findall(r"f32\[([\d,]*)\]", text)
    ]
    assert max(sizes) <= block * V < B * T * V


def _train(run_dir, *flags):
    """`python -m train.main` on the tiny preset and the embedded corpus, in this process, its
    end-of-run sample on (the default). The progress bar is off: it only draws on stderr."""
    from train import main as train_main

    args = ["--config", "tiny", "--run-dir", str(run_dir), "--no-progress"]
    assert train_main.main([*args, *flags]) == 0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m["loss"] for m in map(json.loads, lines) if "loss" in m}


def _sample(stdout: str) -> str:
    """The greedy sample a run printed at its end (what follows its heading)."""
    assert stdout.count("greedy sample (") == 1, stdout[-2000:]
    return stdout.split("greedy sample (", 1)[1].split("wall time")[0]


def test_train_main_with_context_4_logs_the_one_device_losses_and_restores_elsewhere(
    tmp_path, capsys
):
    """`train.main --mesh fsdp=2,context=4` logs the losses of the same run on one device
    (1e-5: the reduction order differs) and ends with its greedy sample, the one a run on one
    device prints from the same checkpoint; its step-2 checkpoint restored onto one device (no
    context axis: the `one` run's program, compiled already) continues the same loss curve."""
    steps = ["--steps", "4", "--ckpt-every", "2", "keep_checkpoints=2", "eval_every=0"]
    capsys.readouterr()
    cp = _train(tmp_path / "cp", "--mesh", "fsdp=2,context=4", *steps)
    sample = _sample(capsys.readouterr().out)
    _train(tmp_path / "cp", "--mesh", "fsdp=1", *steps)  # step 4 restored: no step, the sample
    assert _sample(capsys.readouterr().out) == sample
    one = _train(tmp_path / "one", "--mesh", "fsdp=1", *steps)
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "cp", moved)
    shutil.rmtree(moved / "checkpoints" / "4")  # resume from step 2, on another mesh
    elsewhere = _train(moved, "--mesh", "fsdp=1", *steps)
    assert sorted(cp) == sorted(one) == sorted(elsewhere) == [1, 2, 3, 4]
    np.testing.assert_allclose([cp[s] for s in cp], [one[s] for s in cp], rtol=1e-5)
    np.testing.assert_allclose([elsewhere[s] for s in (3, 4)], [cp[3], cp[4]], rtol=1e-5)
    assert abs(cp[4] - cp[1]) > 1e-3  # the run learned: the losses compared are not constant


def test_init_from_goes_on_at_a_longer_length_with_context_and_refuses_another_model(
    tmp_path, capsys
):
    """`--init-from` a 64-token run: a run at 128 tokens, each sequence over context=2, starts
    from its parameters (its first loss is the trained model's, far below a fresh model's) with
    a fresh optimizer; a run of another model is refused, naming the field, changing nothing."""
    short = _train(tmp_path / "short", "--mesh", "fsdp=8", "--steps", "30", "eval_every=0")
    longer = ["seq_len=128", "--mesh", "fsdp=4,context=2", "--steps", "2", "eval_every=0"]
    capsys.readouterr()
    extended = _train(tmp_path / "long", "--init-from", str(tmp_path / "short"), *longer)
    out = capsys.readouterr().out
    assert f"initialised from the parameters of {tmp_path / 'short' / 'checkpoints' / '30'}" in out
    # a fresh model's first loss is short[1] (the same initialisation, ~ln V at any length)
    assert extended[1] < short[1] - 1.0 and abs(extended[1] - short[30]) < 0.5, (extended, short)
    from train import main as train_main

    args = ["--config", "tiny", "--run-dir", str(tmp_path / "other"), "--no-progress"]
    args += ["--init-from", str(tmp_path / "short"), "d_model=128", "d_v=32", "--steps", "1"]
    assert train_main.main(args) == 2
    err = capsys.readouterr().err
    assert "holds another model (only seq_len may differ)" in err and "d_model" in err
    assert not list((tmp_path / "other").rglob("[0-9]*"))  # no checkpoint step written
    assert not (tmp_path / "other" / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def sample_programs():
    """The collectives of the prefill and decode programs of the trainer's end-of-run sample
    (laplace_jax.generate.greedy_generate) when given these parameters."""
    from laplace_jax import hlo
    from laplace_jax.generate import decode, prefill
    from laplace_jax.model import init_state

    prompt = jnp.zeros((1, 5), jnp.int32)
    state = jax.eval_shape(lambda: init_state(TINY, 1))
    token = jax.ShapeDtypeStruct((1,), jnp.int32)

    def collectives(params):
        texts = [
            prefill.lower(TINY, params, prompt).compile().as_text(),
            decode.lower(TINY, params, token, state).compile().as_text(),
        ]
        return [c["kind"] for text in texts for c in hlo.collectives(text, 8)]

    return collectives


@pytest.mark.parametrize(
    "mesh_flag", ["data=2,fsdp=1,context=4", "fsdp=2,context=4", "data=2,fsdp=2,context=2"]
)
def test_the_end_of_run_sample_compiles_to_programs_without_collectives(
    batch, sample_programs, mesh_flag
):
    """The trainer's sample runs on the parameters `train.loop.sample_params` makes of the mesh's
    shards: on one device, so its programs carry no collective. On the sharded parameters
    themselves (what the sample used to run on) they are programs of the whole mesh, with
    collectives: the check can fail."""
    from train.cli import mesh_from_flag
    from train.loop import sample_params

    _, _, params = batch
    mesh = mesh_from_flag(mesh_flag)
    placed = jax.device_put(params, param_shardings(TINY, mesh))
    one = sample_params(placed)
    assert {leaf.sharding.device_set.pop() for leaf in jax.tree.leaves(one)} == {jax.devices()[0]}
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(one), jax.device_get(params))
    assert sample_programs(one) == []
    if mesh_flag == "fsdp=2,context=4":
        assert sample_programs(placed)


def test_a_failing_sample_is_one_warning_and_keeps_the_exit_status(tmp_path, capsys, monkeypatch):
    """The run has finished and saved when it samples: a sample that fails changes neither the
    exit status nor the files, and says so in one line."""
    from train import loop

    def broken(*args):
        raise RuntimeError("no sample today")

    monkeypatch.setattr(loop, "print_sample", broken)
    run = tmp_path / "run"
    capsys.readouterr()
    _train(run, "--steps", "2", "--ckpt-every", "2", "eval_every=0")
    err = capsys.readouterr().err
    warning = (
        "warning: the end-of-run sample failed (RuntimeError: no sample today); the run "
        "finished, its newest checkpoint is step 2"
    )
    assert warning in err and "Traceback" not in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]


def test_a_context_group_across_processes_is_refused():
    """Each process loads its own sequences: the devices sharing one must share a process."""
    from types import SimpleNamespace

    from laplace_spec.config import ConfigError
    from train.startup import check_context_groups

    def mesh(context, processes):  # a mesh's shape and its devices' process indices
        devices = np.array([SimpleNamespace(process_index=p) for p in processes], dtype=object)
        return SimpleNamespace(
            shape={"fsdp": len(processes) // context, "context": context},
            devices=devices.reshape(-1, context),
        )

    check_context_groups(mesh(2, [0, 0, 1, 1]))  # a group per process
    with pytest.raises(ConfigError, match="a context group of 4 devices spans processes"):
        check_context_groups(mesh(4, [0, 0, 1, 1]))
