"""`python -m train.eval` (train/eval.py): MQAR / passkey accuracy and perplexity of a checkpoint
written by a short real `train.main --task mqar` run, checked against independent computations
(a handcrafted checkpoint whose greedy answer is known, LaplaceLM.apply on the same batches,
laplace_jax.loss.next_token_loss); JSON and PNG written; bad inputs exit 2 naming the problem."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from laplace_jax.loss import next_token_loss
from laplace_jax.model import LaplaceLM, abstract_params, init_params
from laplace_jax.sharding import make_mesh
from laplace_spec.config import get_config
from train import eval as train_eval
from train import main as train_main
from train import tasks
from train.checkpoint import Checkpointer
from train.data import TokenWindows, eval_batches
from train.shards import write_shard

REPO = Path(__file__).resolve().parent.parent
TINY = get_config("tiny")  # vocab 320, seq_len 64, chunk_size 16
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real tiny MQAR run: 4 steps, one checkpoint at step 4."""
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    args = [
        "--config",
        "tiny",
        "--task",
        "mqar:num_pairs=4",
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--steps",
        "4",
        "global_batch_tokens=512",
        "--mesh",
        "fsdp=1",
    ]
    assert train_main.main(args) == 0
    return run_dir


CONSTANT = 7  # the token the handcrafted model always predicts


@pytest.fixture(scope="module")
def constant_ckpt(tmp_path_factory):
    """A handcrafted checkpoint whose greedy prediction is CONSTANT at every position: the
    layers add nothing (zero output projections), every embedding is e = (1, -1, 0, ...), and
    the LM head maps LayerNorm(e) onto CONSTANT's logit only."""
    params = jax.device_get(jax.jit(lambda k: init_params(TINY, k))(jax.random.key(0)))
    params = jax.tree.map(np.array, params)
    e = np.zeros(TINY.d_model, np.float32)
    e[:2] = 1.0, -1.0
    params["embed"]["embedding"][:] = e
    for i in range(TINY.n_layers):
        params[f"layer_{i}"]["out"]["kernel"][:] = 0
        params[f"layer_{i}"]["w3"]["kernel"][:] = 0
    params["lm_head"]["kernel"][:] = 0
    params["lm_head"]["kernel"][:, CONSTANT] = e
    d = tmp_path_factory.mktemp("const") / "checkpoints"
    ckpt = Checkpointer(d, async_save=False)
    ckpt.save(1, params, {"unused": np.zeros(1, np.float32)}, {}, {"model": TINY.to_dict()})
    ckpt.close()
    return d


def _eval(tmp_path, *args):
    out = tmp_path / "out"
    assert train_eval.main([*args, "--out", str(out)]) == 0
    (json_path,) = out.glob("*.json")
    (png,) = out.glob("*.png")
    assert png.read_bytes()[:8] == PNG
    return json.loads(json_path.read_text())


def test_score_counts_answers_and_whole_sequences():
    tokens = np.array([[0, 5, 6, 7], [0, 5, 6, 7]])  # targets [5, 6, 7]
    mask = np.array([[False, True, True], [True, True, False]])
    preds = np.array([[9, 6, 7], [5, 0, 7]])  # row 0: both answers right; row 1: one of two
    assert train_eval.score(preds, tokens, mask) == {
        "answers": 4,
        "correct": 3,
        "sequences": 2,
        "sequences_correct": 1,
    }


def test_mqar_accuracy_of_a_known_model_and_beyond_the_training_length(constant_ckpt, tmp_path):
    """The constant model answers right exactly where the value is CONSTANT: count it on the
    generated batches (seeds as documented in train/eval.py). 128 > the training seq_len 64."""
    rep = _eval(
        tmp_path,
        "--checkpoint",
        str(constant_ckpt),
        "--task",
        "mqar",
        "--seq-lens",
        "64,128",
        "--pairs",
        "1,4",
        "--vocab",
        "12",
        "--n",
        "48",
        "--batch-size",
        "16",
        "--seed",
        "3",
    )
    assert rep["task"] == "mqar" and rep["step"] == 1
    assert rep["settings"]["vocab_size"] == 12 and rep["settings"]["sequences_per_cell"] == 48
    assert [(r["seq_len"], r["num_pairs"]) for r in rep["results"]] == [
        (64, 1),
        (64, 4),
        (128, 1),
        (128, 4),
    ]
    assert rep["skipped"] == []
    for r in rep["results"]:
        T, P = r["seq_len"], r["num_pairs"]
        prefix = train_eval.cell_seed(3, "mqar", T, P)
        right = answers = seqs = 0
        for i in range(3):
            tokens, mask = tasks.mqar(16, T, P, 12, seed=(*prefix, i))
            targets = tokens[:, 1:]
            right += int(((targets == CONSTANT) & mask).sum())
            answers += int(mask.sum())
            seqs += int(((targets == CONSTANT) | ~mask).all(1).sum())
        assert (r["correct"], r["answers"], r["sequences_correct"]) == (right, answers, seqs)
        assert r["accuracy"] == pytest.approx(right / answers)
        assert r["sequence_accuracy"] == pytest.approx(seqs / 48)
        assert r["beyond_training_length"] == (T > 64)
    # not a degenerate check: values are drawn from [6, 12), so about 1 in 6 answers is right
    assert 0.05 < np.mean([r["accuracy"] for r in rep["results"]]) < 0.35


def test_passkey_hits_need_every_digit(constant_ckpt, tmp_path):
    """Two digits: a digit is right when it is CONSTANT - 3 (digit tokens start at 3), a hit
    needs both."""
    rep = _eval(
        tmp_path,
        "--checkpoint",
        str(constant_ckpt),
        "--task",
        "passkey",
        "--context-lens",
        "32,64",
        "--depths",
        "0,0.5,1",
        "--num-digits",
        "2",
        "--n",
        "96",
        "--batch-size",
        "32",
    )
    assert rep["settings"]["depths"] == [0.0, 0.5, 1.0] and len(rep["results"]) == 6
    for r in rep["results"]:
        prefix = train_eval.cell_seed(0, "passkey", r["seq_len"], r["depth"])
        hits = digit_hits = 0
        for i in range(3):
            tokens, _ = tasks.passkey(32, r["seq_len"], r["depth"], 320, (*prefix, i), 2)
            answer = tokens[:, -2:]
            hits += int((answer == CONSTANT).all(1).sum())
            digit_hits += int((answer == CONSTANT).sum())
        assert r["accuracy"] == pytest.approx(hits / 96)
        assert r["digit_accuracy"] == pytest.approx(digit_hits / (96 * 2))
    digit_acc = np.mean([r["digit_accuracy"] for r in rep["results"]])
    assert 0.05 < digit_acc < 0.2  # about 1 in 10
    assert np.mean([r["accuracy"] for r in rep["results"]]) < 0.5 * digit_acc


@pytest.mark.parametrize("mesh", [[], ["--mesh", "fsdp=2,context=4"]], ids=["fsdp8", "context4"])
def test_mqar_on_a_trained_checkpoint_matches_the_model_applied_directly(
    run, tmp_path, capsys, mesh
):
    """Scored through the sharded forward, on every device or with each sequence split into 4
    slices: the counts of the model applied directly on one device."""
    rep = _eval(
        tmp_path,
        *mesh,
        "--checkpoint",
        str(run),
        "--task",
        "mqar",
        "--seq-lens",
        "64",
        "--pairs",
        "4,8,20",
        "--n",
        "32",
        "--batch-size",
        "16",
    )
    printed = capsys.readouterr().out
    assert "seq_len \\ pairs" in printed and "wrote" in printed
    assert rep["checkpoint"] == str(run / "checkpoints" / "4")
    assert rep["trained_on"] == {
        "task": "mqar",
        "task_params": json.loads((run / "config.json").read_text())["data"]["task_params"],
    }
    assert rep["settings"]["vocab_size"] == 320 and rep["settings"]["power_a"] == 0.01
    assert [r["num_pairs"] for r in rep["results"]] == [4, 8]
    assert rep["skipped"][0]["num_pairs"] == 20 and "4 * num_pairs" in rep["skipped"][0]["reason"]
    # independently: the parameters read by orbax itself, the model applied to the same batches
    params = ocp.StandardCheckpointer().restore(
        run / "checkpoints" / "4" / "params", abstract_params(TINY)
    )
    apply = jax.jit(lambda p, x: LaplaceLM(TINY).apply({"params": p}, x)[0])
    for r in rep["results"]:
        prefix = train_eval.cell_seed(0, "mqar", 64, r["num_pairs"])
        right = answers = 0
        for i in range(2):
            tokens, mask = tasks.mqar(16, 64, r["num_pairs"], 320, seed=(*prefix, i))
            preds = np.asarray(jnp.argmax(apply(params, tokens[:, :-1]), -1))
            right += int(((preds == tokens[:, 1:]) & mask).sum())
            answers += int(mask.sum())
        assert (r["correct"], r["answers"]) == (right, answers)


def test_checkpoint_is_read_sharded_over_every_device(run):
    """A 3B checkpoint cannot sit on one core: train.eval places the parameters as training does
    (the FSDP rules table), through train/checkpoint.py's reader, with the saved values."""
    cfg, params, meta = train_eval.load_checkpoint(run / "checkpoints", 4, make_mesh())
    assert cfg == TINY and meta["step"] == 4
    kernel = params["lm_head"]["kernel"]  # [D, V]: rows over fsdp
    assert len(kernel.sharding.device_set) == jax.device_count() == 8
    assert kernel.sharding.spec[0] == "fsdp"
    saved = ocp.StandardCheckpointer().restore(
        run / "checkpoints" / "4" / "params", abstract_params(TINY)
    )
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_ppl_is_exp_of_the_mean_loss_fn(run, tmp_path):
    """Scored with each sequence split over context=2 (fsdp=4): the plain loss on one device."""
    shard = tmp_path / "val_000000.bin"
    write_shard(shard, np.random.default_rng(0).integers(0, 320, 3000))
    rep = _eval(
        tmp_path,
        "--mesh",
        "fsdp=4,context=2",
        "--checkpoint",
        str(run),
        "--task",
        "ppl",
        "--data",
        str(shard),
        "--batches",
        "3",
        "--batch-size",
        "8",
    )
    res = rep["results"]
    assert (res["windows"], res["tokens"], res["seq_len"]) == (24, 24 * 64, 64)
    params = ocp.StandardCheckpointer().restore(
        run / "checkpoints" / "4" / "params", abstract_params(TINY)
    )
    batches = eval_batches(TokenWindows([str(shard)], 64), 8, 3)
    loss = jax.jit(lambda p, t: next_token_loss(LaplaceLM(TINY), p, t))
    losses = [float(loss(params, b)) for b in batches]
    assert res["loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(np.mean(losses)), rel=1e-5)
    assert len(res["loss_by_position"]) == 64


def _fails(capsys, *args) -> str:
    assert train_eval.main(list(args)) == 2
    return capsys.readouterr().err


def test_bad_inputs_exit_2_naming_the_problem(run, tmp_path, capsys):
    err = _fails(capsys, "--checkpoint", str(tmp_path / "nope"), "--task", "mqar")
    assert "nope: no such directory" in err
    err = _fails(capsys, "--checkpoint", str(tmp_path), "--task", "mqar")
    assert "no checkpoints in" in err
    err = _fails(capsys, "--checkpoint", str(run), "--task", "mqar", "--seq-lens", "64,72")
    assert "--seq-lens: 72 is not a positive multiple of the model's chunk_size (16)" in err
    err = _fails(capsys, "--checkpoint", str(run), "--task", "passkey", "--context-lens", "40")
    assert "--context-lens: 40" in err
    err = _fails(capsys, "--checkpoint", str(run), "--task", "mqar", "--step", "3")
    assert "no checkpoint step 3" in err
    err = _fails(capsys, "--checkpoint", str(run), "--task", "ppl")
    assert "pass --data" in err
    err = _fails(capsys, "--checkpoint", str(run), "--task", "mqar", "--pairs", "40")
    assert "no valid (length, num_pairs) cell" in err
    with pytest.raises(SystemExit) as e:  # argparse: an unknown task
        train_eval.main(["--checkpoint", str(run), "--task", "mmlu"])
    assert e.value.code == 2 and "invalid choice: 'mmlu'" in capsys.readouterr().err
    # corrupt: a parameter file cut short; the meta item gone
    for damage in ("truncate", "meta"):
        bad = tmp_path / damage
        shutil.copytree(run, bad)
        step = bad / "checkpoints" / "4"
        if damage == "meta":
            shutil.rmtree(step / "meta")
        else:
            files = [f for f in (step / "params").rglob("*") if f.is_file()]
            big = max(files, key=lambda f: f.stat().st_size)
            with open(big, "r+b") as f:
                f.truncate(big.stat().st_size // 2)
        err = _fails(capsys, "--checkpoint", str(bad), "--task", "mqar")
        assert f"checkpoint {step} is corrupt" in err
        assert ("its meta" if damage == "meta" else "its parameters") in err


def test_command_line_exits_2_with_the_message(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "train.eval", "--checkpoint", str(tmp_path / "x"), "--task", "mqar"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert (
        r.returncode == 2 and "error: --checkpoint" in r.stderr and "no such directory" in r.stderr
    )
