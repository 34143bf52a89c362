"""Synthetic retrieval tasks (train/tasks.py): exact layouts, determinism, answer masks; the
masked FSDP loss against the plain model's masked mean; `train.main --task` learning MQAR and
resuming on the same batches."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from laplace_jax.fsdp import make_loss_and_grad
from laplace_jax.model import LaplaceLM, init_params
from laplace_jax.sharding import logical_sharding, make_mesh, param_shardings, param_specs
from laplace_spec.config import get_config
from train import eval as train_eval
from train import tasks
from train.step import EVAL_BATCH_AXES
from train.tasks import TaskError, mqar, passkey

TINY = get_config("tiny")  # vocab 320, seq_len 64


# ---- MQAR ------------------------------------------------------------------------------------


def test_mqar_small_case_has_the_exact_layout():
    """seq 16, 2 pairs, vocab 10: keys in [1, 5), values in [5, 10), queries at 4 + 2g."""
    tokens, mask = mqar(2, 16, 2, 10, seed=0)
    assert tokens.shape == (2, 17) and tokens.dtype == np.int32
    assert mask.shape == (2, 16) and mask.dtype == bool
    for b in range(2):
        row = tokens[b]
        keys, values = row[0:4:2], row[1:4:2]
        assert set(keys) <= set(range(1, 5)) and set(values) <= set(range(5, 10))
        qpos = np.flatnonzero(mask[b])  # target position t scores tokens[t + 1]
        assert len(qpos) == 2 and all((p - 4) % 2 == 0 and p >= 4 for p in qpos)
        kv = dict(zip(keys, values, strict=True))
        for p in qpos:
            assert row[p] in kv and row[p + 1] == kv[row[p]]  # the query, then its value
        others = np.ones(17, bool)
        others[:4] = False
        others[qpos] = others[qpos + 1] = False
        assert (row[others] == tasks.MQAR_FILLER).all()
    # the hand-checked first row of seed 0
    np.testing.assert_array_equal(tokens[0], [3, 9, 4, 6, 3, 9, 0, 0, 0, 0, 4, 6, 0, 0, 0, 0, 0])
    assert np.flatnonzero(mask[0]).tolist() == [4, 10]


@pytest.mark.parametrize("T,P", [(64, 4), (128, 8), (256, 16), (64, 16)])
def test_mqar_keys_once_queries_ask_inserted_keys_and_the_mask_marks_the_answers(T, P):
    V = 8192 if T > 64 else 320
    tokens, mask = mqar(32, T, P, V, seed=(3, 7))
    assert (mask.sum(1) == P).all()
    for row, m in zip(tokens, mask, strict=True):
        keys, values = row[0 : 2 * P : 2], row[1 : 2 * P : 2]
        assert len(set(keys)) == P and ((1 <= keys) & (keys < V // 2)).all()
        assert ((V // 2 <= values) & (values < V)).all()
        kv = dict(zip(keys, values, strict=True))
        queries = row[:-1][m]
        assert sorted(queries) == sorted(keys)  # every inserted key asked once, nothing else
        np.testing.assert_array_equal(row[1:][m], [kv[q] for q in queries])  # targets = values
        rest = row[2 * P :]
        assert np.isin(rest[rest != 0], row[: 2 * P]).all()  # only queries and answers


def test_mqar_gaps_follow_the_power_law():
    """Short gaps dominate: with alpha 0.01, P(g) ~ 1/(g+1)."""
    _, mask = mqar(400, 256, 4, 8192, seed=1)
    gaps = (np.flatnonzero(mask.reshape(-1)) % 256 - 8) // 2
    assert (gaps < 8).mean() > 2 * (gaps >= 64).mean()


def test_generators_are_deterministic_by_seed():
    for gen, kw in ((mqar, {"num_pairs": 4}), (passkey, {"depth": 0.3})):
        a = gen(8, 64, vocab_size=320, seed=(5, 1), **kw)
        b = gen(8, 64, vocab_size=320, seed=(5, 1), **kw)
        c = gen(8, 64, vocab_size=320, seed=(5, 2), **kw)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])
        assert not np.array_equal(a[0], c[0])


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"num_pairs": 17}, "num_pairs"),  # 4P > T
        ({"num_pairs": 0}, "num_pairs"),
        ({"vocab_size": 8}, "num_pairs"),  # too few keys
        ({"seq_len": 2}, "seq_len"),
        ({"batch_size": 0}, "batch_size"),
        ({"power_a": 0.0}, "power_a"),
        ({"seed": -1}, "seed"),
    ],
)
def test_mqar_rejects_bad_parameters_naming_the_field(kwargs, field):
    args = {"batch_size": 2, "seq_len": 64, "num_pairs": 4, "vocab_size": 320, "seed": 0}
    with pytest.raises(TaskError, match=field):
        mqar(**{**args, **kwargs})


# ---- passkey ---------------------------------------------------------------------------------


def test_passkey_small_case_has_the_exact_layout():
    T, n = 15, 3
    tokens, mask = passkey(1, T, 0.5, 20, seed=1, num_digits=3)
    row = tokens[0]
    start = tasks.passkey_position(T, 0.5, n)
    assert start == 4  # round(0.5 * (15 - 7))
    digits = row[start + 1 : start + 1 + n]
    assert row[start] == tasks.PASSKEY_KEY and row[T - n] == tasks.PASSKEY_QUERY
    np.testing.assert_array_equal(row[T - n + 1 :], digits)
    assert ((3 <= digits) & (digits < 13)).all()
    filler = np.delete(row, [start, *range(start + 1, start + 1 + n), *range(T - n, T + 1)])
    assert ((13 <= filler) & (filler < 20)).all()
    assert np.flatnonzero(mask[0]).tolist() == [12, 13, 14]  # targets: the three answer digits


def test_passkey_with_several_queries_has_the_exact_layout():
    """queries=3 over T = 30: segments [0, 10], [11, 20], [21, 30], each its own problem: its
    needle at s + round(1.0 * (e - s - 5)) = 5, 15, 25 and QUERY d1 d2 at its end with its own
    digits; the one-query layout is the same random draw."""
    T, n = 30, 2
    tokens, mask = passkey(4, T, 1.0, 20, seed=4, num_digits=n, queries=3)
    for row, m in zip(tokens, mask, strict=True):
        assert np.flatnonzero(row == tasks.PASSKEY_KEY).tolist() == [5, 15, 25]
        assert np.flatnonzero(row == tasks.PASSKEY_QUERY).tolist() == [8, 18, 28]
        for needle, e in ((5, 10), (15, 20), (25, 30)):
            np.testing.assert_array_equal(row[e - n + 1 : e + 1], row[needle + 1 : needle + 1 + n])
        assert np.flatnonzero(m).tolist() == [8, 9, 18, 19, 28, 29]
    segments = tokens[:, [6, 16, 26]]  # each segment's first digit: drawn per segment
    assert (segments != segments[:, :1]).any()
    one, _ = passkey(2, T, 1.0, 20, seed=4, num_digits=n)  # queries=1: the one-query layout
    assert one[0, T - n] == tasks.PASSKEY_QUERY and (one[0] == tasks.PASSKEY_QUERY).sum() == 1
    with pytest.raises(TaskError, match="queries=7 leaves segments of 4 tokens"):
        passkey(1, T, 0.5, 20, seed=0, num_digits=n, queries=7)  # 2n + 2 = 6 needed


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_passkey_depth_places_the_needle(depth):
    T, n = 1024, 5
    tokens, mask = passkey(4, T, depth, 320, seed=2)
    start = int(round(depth * (T - 2 * n - 1)))
    assert (tokens[:, start] == tasks.PASSKEY_KEY).all()
    assert ((tokens == tasks.PASSKEY_KEY).sum(1) == 1).all()
    assert ((tokens == tasks.PASSKEY_QUERY).sum(1) == 1).all()
    np.testing.assert_array_equal(tokens[:, start + 1 : start + 1 + n], tokens[:, T - n + 1 :])
    assert (mask.sum(1) == n).all() and mask[:, T - n :].all()
    if depth == 1.0:  # the needle ends right before the query
        assert start + n == T - n - 1


def test_passkey_random_depth_draws_one_needle_per_row():
    """depth=-1: every row holds one needle at its own depth, the same digits at the query."""
    T, n = 256, 5
    tokens, mask = passkey(64, T, -1, 320, seed=3)
    starts = np.argmax(tokens == tasks.PASSKEY_KEY, axis=1)
    assert ((tokens == tasks.PASSKEY_KEY).sum(1) == 1).all()
    for row, start in zip(tokens, starts, strict=True):
        np.testing.assert_array_equal(row[start + 1 : start + 1 + n], row[T - n + 1 :])
    assert starts.min() < T // 4 and starts.max() > 3 * T // 4  # spread over the context
    assert starts.max() <= T - 2 * n - 1 and (mask.sum(1) == n).all()


@pytest.mark.parametrize(
    "kwargs,field",
    [({"depth": 1.5}, "depth"), ({"seq_len": 10}, "seq_len"), ({"vocab_size": 13}, "vocab_size")],
)
def test_passkey_rejects_bad_parameters_naming_the_field(kwargs, field):
    args = {"batch_size": 2, "seq_len": 64, "depth": 0.5, "vocab_size": 320, "seed": 0}
    with pytest.raises(TaskError, match=field):
        passkey(**{**args, **kwargs})


def test_task_flag_parsing():
    assert tasks.parse_task("mqar", 320) == ("mqar", {"num_pairs": 4, "vocab_size": 320})
    name, p = tasks.parse_task("passkey:depth=0.25,num_digits=3", 320)
    assert (name, p) == ("passkey", {"depth": 0.25, "vocab_size": 320, "num_digits": 3})
    bad_specs = (
        ("nope", "unknown task"),
        ("mqar:pairs=3", "pairs"),
        ("mqar:num_pairs=x", "num_pairs"),
        ("mqar:vocab_size=999", "vocab_size"),
    )
    for bad, field in bad_specs:
        with pytest.raises(TaskError, match=field):
            tasks.parse_task(bad, 320)


def test_task_batches_continue_after_set_state():
    a = tasks.TaskBatches("mqar", {"num_pairs": 4, "vocab_size": 320}, 64, 8, 2, seed=0)
    seq = [next(a) for _ in range(3)]
    assert seq[0][0].shape == (2, 4, 65) and seq[0][1].shape == (2, 4, 64)
    b = tasks.TaskBatches("mqar", {"num_pairs": 4, "vocab_size": 320}, 64, 8, 2, seed=0)
    b.set_state(json.loads(json.dumps({**a.get_state(), "step": 2})))
    np.testing.assert_array_equal(next(b)[0], seq[2][0])
    with pytest.raises(TaskError, match="not task"):
        b.set_state({"task": "passkey", "params": {}, "step": 1})


def test_shard_batches_refuse_a_task_checkpoints_data_state():
    """A run on token shards restoring a --task run's checkpoint: an error naming the task."""
    import grain

    from train.data import BatchIterator

    shards = BatchIterator(grain.MapDataset.source([np.zeros(65, np.int32)] * 4).batch(2), 1)
    with pytest.raises(ValueError, match="data is task mqar .* not token shards"):
        shards.set_state({"task": "mqar", "params": {"num_pairs": 4}, "step": 3})


# ---- the masked loss -------------------------------------------------------------------------


@pytest.mark.parametrize("data", [1, 2])
def test_masked_fsdp_loss_equals_the_plain_masked_mean(data):
    """sum(ce * mask) / sum(mask) over the whole micro-batch, on 1 x 8 and 2 x 4 meshes, with
    different mask counts on different devices."""
    mesh = make_mesh(8, data=data)
    batch = logical_sharding(mesh, EVAL_BATCH_AXES)
    params = jax.device_put(init_params(TINY, jax.random.key(0)), param_shardings(TINY, mesh))
    tokens, mask = mqar(8, TINY.seq_len, 4, TINY.vocab_size, seed=4)
    mask[0, :10] = True  # uneven counts per device
    model = LaplaceLM(TINY)

    def ref(p, t, m):
        logits, _ = model.apply({"params": p}, t[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:])
        return (ce * m).sum() / m.sum()

    t, m = jax.device_put(jnp.asarray(tokens), batch), jax.device_put(jnp.asarray(mask), batch)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(ref))(params, t, m)
    fn = make_loss_and_grad(model, mesh, param_specs(TINY, mesh))
    loss, grads = jax.jit(fn)(params, t, m)
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
    rel = jax.tree.map(
        lambda x, y: float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y))), grads, ref_grads
    )
    assert max(jax.tree.leaves(rel)) < 1e-5
    # an all-true mask is the unmasked loss
    full, _ = jax.jit(fn)(params, t, jax.device_put(jnp.ones_like(m), batch))
    plain, _ = jax.jit(fn)(params, t)
    assert abs(float(full) - float(plain)) <= 1e-6 * float(plain)


def test_masked_accumulation_is_the_mean_over_every_scored_target():
    """2 micro-batches whose answer counts differ (4 x 4 answers vs 4 x 4 + 20) give the loss
    and update of the whole masked batch at once, not the mean of the two micro-batch means."""
    from laplace_jax.model import abstract_params
    from laplace_jax.sharding import abstract_with_shardings
    from train import config as train_config
    from train.step import make_train_step

    mesh = make_mesh(4)
    opt_cfg, _ = train_config.optimizer_config("tiny", {}, [], 10)
    ps = param_shardings(TINY, mesh)
    abstract = abstract_with_shardings(abstract_params(TINY), ps)
    tx, _, os_ = train_config.build_optimizer(opt_cfg, abstract, ps, mesh)
    step, _ = make_train_step(LaplaceLM(TINY), tx, mesh, ps, os_, grad_clip=0.0, masked=True)
    host = jax.device_get(init_params(TINY, jax.random.key(5)))
    tokens, mask = mqar(8, TINY.seq_len, 4, TINY.vocab_size, seed=6)
    mask[5, :20] = True  # the second micro-batch scores 20 more targets

    def run(accum):
        params = jax.device_put(host, ps)
        state = {
            "params": params,
            "opt_state": jax.jit(tx.init, out_shardings=os_)(params),
            "bad_streak": jnp.zeros((), jnp.int32),
        }
        shape = (accum, 8 // accum)
        return step(state, tokens.reshape(*shape, -1), mask.reshape(*shape, -1))

    (s1, m1), (s2, m2) = run(1), run(2)
    np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m2["grad_norm"]), float(m1["grad_norm"]), rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=5e-5),
        jax.device_get(s2["params"]),
        jax.device_get(s1["params"]),
    )


# ---- train.main --task -----------------------------------------------------------------------


def _metrics(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x]


def test_tiny_model_learns_mqar_and_resumes_on_the_same_batches(mqar_task_runs):
    """MQAR (seq 64, 4 pairs; tests/mqar_runs.py's `task_runs`, trained early in the session):
    the answer loss falls from ~ln(vocab) and train.eval's accuracy on fresh sequences is far
    above chance (1/16); a run stopped at a checkpoint and resumed logs the same losses as one
    run straight through."""
    run = mqar_task_runs / "run"
    m = _metrics(run)
    losses = [r["loss"] for r in m]
    assert abs(losses[0] - np.log(TINY.vocab_size)) < 0.5
    assert np.mean(losses[-3:]) < 1.0, losses  # measured: 5.8 -> 0.14 (0.09-0.25 over 3 seeds)
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["data"]["task"] == "mqar" and cfg["data"]["task_params"]["num_pairs"] == 4
    report, _ = train_eval.evaluate(
        train_eval.parse_args(["--checkpoint", str(run), "--task", "mqar", "--n", "128"])
    )
    (cell,) = report["results"]
    assert (cell["seq_len"], cell["num_pairs"]) == (64, 4)
    assert cell["accuracy"] > 8 / 16, cell  # 8x chance; measured: 95.1%

    got = {r["step"]: r["loss"] for r in _metrics(mqar_task_runs / "part")}  # 4, then to 6
    assert {4, 5, 6} <= set(got)
    straight = {r["step"]: r["loss"] for r in m}
    for step in (5, 6):  # the resumed steps, on the batches of the run straight through
        assert got[step] == pytest.approx(straight[step], rel=1e-6), step
