"""`python -m bench.device --dry-run`: every part of the accelerator script, tiny shapes (issue 21).

The dry run is the command a GPU machine runs, at small shapes on whatever is there (on CPU, fla's
Triton kernel is a recorded skip and ours is checked against the fp32 reference instead). Its
headline values are null by design (tiny shapes are not 3B figures); each part's own figures
are checked here. No wall-clock time is asserted. The micro-batch search is checked against fake
compiles of known peak memory.
"""

import json

import pytest
from shared_fixtures import EARLY, start_device_dry_run

from bench.device import run
from bench.device.gla import TOLERANCE
from bench.device.train import SAFETY, next_size, search_micro_batch

HEADLINE = {
    "gla_over_fla_triton_T8192",
    "train_tokens_per_s_3b",
    "train_mfu_3b",
    "train_mfu_published_peak_3b",
    "decode_tokens_per_s_3b_1280",
}


@pytest.fixture(scope="module")
def device_dry_run(tmp_path_factory):
    """(device.json, stdout) of `python -m bench.device --dry-run`, started early
    (tests/shared_fixtures.py `start_early`: it runs beside the tests before this one)."""
    job = EARLY.pop("device_dry_run", None) or start_device_dry_run(
        tmp_path_factory.mktemp("device")
    )
    try:
        status = job.proc.wait(timeout=900)
    finally:
        job.proc.kill()
    output = job.log_path.read_text()
    assert status == 0, output[-8000:]
    return json.loads(job.out.read_text()), output


def test_the_dry_run_records_every_part(device_dry_run):
    d, stdout = device_dry_run
    assert d["dry_run"] is True
    assert set(d["headline"]) == HEADLINE
    assert all(v is None for v in d["headline"].values())  # dry-run figures are not 3B figures
    assert set(d["parts"]) == {"gla", "train", "decode"}
    for name, rec in d["parts"].items():
        assert rec["status"] == "ok", (name, rec.get("errors"))
        assert rec["errors"] == []
    env = d["environment"]
    assert env["versions"]["jax"] and env["jax"]["ok"] and env["torch"]["ok"]
    assert d["machine"]["versions"]["jax"] == env["versions"]["jax"]
    assert d["references"]["train_tokens_per_s_per_trn2_chip"] == 7_500
    assert d["references"]["decode_tokens_per_s_trn2_48xlarge_1280"] == 11_544
    assert "decode_tokens_per_s_3b_1280" in stdout  # the printed table


def test_skips_are_named_with_their_reasons(device_dry_run):
    d, stdout = device_dry_run
    for s in d["skips"]:
        assert s["part"] in d["parts"] and s["what"] and len(s["reason"]) > 10
    if not d["environment"]["torch"]["cuda"]:  # this machine: no GPU
        (triton,) = [s for s in d["skips"] if s["what"] == "fla_triton"]
        assert triton["part"] == "gla" and "CUDA" in triton["reason"]
        assert "skip fla_triton" in stdout


def test_gla_parity_is_checked_at_every_length(device_dry_run):
    gla = device_dry_run[0]["parts"]["gla"]
    assert [r["T"] for r in gla["rows"]] == gla["config"]["lengths"]
    assert gla["config"]["tolerance_rel_l2"] == TOLERANCE
    for row in gla["rows"]:
        checks = row["parity"]
        assert "ours_vs_reference" in checks
        if not device_dry_run[0]["environment"]["torch"]["cuda"]:
            assert row["reference"] == "fla_naive_chunk_simple_gla_fp32"
        for check in checks.values():
            for tensor in ("o", "dq", "dk", "dv"):
                assert check[tensor]["finite"]
                assert check[tensor]["rel_l2"] <= TOLERANCE
            assert check["passed"]
        assert row["seconds_per_call"]["ours"]["n"] == row["rounds"] >= 2
    assert gla["parity_passed"] is True


def test_train_runs_the_project_step(device_dry_run):
    t = device_dry_run[0]["parts"]["train"]
    c = t["config"]
    assert (c["preset"], c["compute_dtype"], c["remat"], c["devices"]) == (
        "tiny",
        "bfloat16",
        "layer",
        1,
    )
    assert c["eot_id"] is not None and c["doc_len"] > 0
    assert t["micro_batch"] == 2 and t["attempts"][0]["ran"]
    assert len(t["rounds"]) >= 2
    for r in t["rounds"]:
        assert r["tokens_per_s"] > 0 and r["bf16_matmul_flops_per_s"] > 0 and r["mfu"] > 0
        assert r["applied"] == 1.0 and r["loss"] == r["loss"]  # applied, not NaN
    assert t["headline"]["train_tokens_per_s_3b"] == t["figures"]["tokens_per_s"]["median"]


def test_decode_runs_compiled_and_eager(device_dry_run):
    dec = device_dry_run[0]["parts"]["decode"]
    assert dec["config"]["sequences"] == 2 and dec["state_dtypes"] == ["torch.float32"]
    assert dec["state_bytes_allocated"] == dec["config"]["state_bytes_computed"]
    for name in ("compiled", "eager"):
        assert dec["tokens_per_s"][name]["median"] > 0
    assert (
        dec["headline"]["decode_tokens_per_s_3b_1280"] == dec["tokens_per_s"]["compiled"]["median"]
    )


GIB = 2**30


def fake_compiles(true_fixed, per_seq, limit, recorded_fixed=None, oom_above=None):
    """attempt(m) of a step whose peak is true_fixed + m x per_seq; `recorded_fixed` is what the
    part knows of the fixed bytes (its arguments and one gradient, an underestimate)."""
    calls = []

    def attempt(m):
        calls.append(m)
        peak = true_fixed + m * per_seq
        rec = {"micro_batch": m, "ran": False, "peak": peak, "fixed": recorded_fixed or true_fixed}
        if peak > SAFETY * limit:
            rec["predicted_over"] = True
        elif oom_above is not None and m > oom_above:
            rec["error"] = "run: RESOURCE_EXHAUSTED"
        else:
            rec["ran"] = True
        return rec

    return attempt, calls


def search(attempt, first, limit, max_tries=4, multiple=2):
    return search_micro_batch(
        attempt,
        first,
        limit,
        max_size=128,
        multiple=multiple,
        max_tries=max_tries,
        time_ok=lambda done: True,
    )


def test_the_search_jumps_to_the_largest_size_that_fits():
    attempt, calls = fake_compiles(40 * GIB, 2 * GIB, 128 * GIB)
    best, attempts = search(attempt, 8, 128 * GIB)
    assert calls == [8, 36] and best == 36  # (0.9 x 128 - 40) / 2 = 37.6 -> 36 (multiple of 2)
    assert all(a["ran"] for a in attempts)


def test_the_search_refines_an_underestimated_fixed_part():
    attempt, calls = fake_compiles(50 * GIB, 2 * GIB, 128 * GIB, recorded_fixed=40 * GIB)
    best, _ = search(attempt, 8, 128 * GIB)
    assert best == 32 and calls == [8, 22, 30, 32]  # the true largest: (115.2 - 50) / 2 -> 32


def test_the_search_steps_down_after_an_out_of_memory():
    attempt, calls = fake_compiles(40 * GIB, 2 * GIB, 128 * GIB, oom_above=20)
    best, attempts = search(attempt, 8, 128 * GIB)
    assert calls == [8, 36, 26, 18] and best == 18
    assert [a["ran"] for a in attempts] == [True, False, False, True]


def test_the_search_after_a_size_predicted_over_the_limit():
    attempt, calls = fake_compiles(40 * GIB, 2 * GIB, 128 * GIB)
    best, _ = search(attempt, 64, 128 * GIB)
    assert calls == [64, 36] and best == 36


def test_the_search_without_a_memory_limit():
    attempt, calls = fake_compiles(0, 1, float("inf"))
    assert search(attempt, 2, None, multiple=1) == (
        2,
        [{"micro_batch": 2, "ran": True, "peak": 2, "fixed": 0}],
    )
    attempt, calls = fake_compiles(0, 1, 10, oom_above=1)  # without a limit: halve on failure
    best, _ = search(attempt, 4, None, multiple=1)
    assert calls == [4, 2, 1] and best == 1
    assert next_size(3, {"ran": True}, None, 3, max_size=8, multiple=1) is None


def test_the_search_stops_when_time_runs_out():
    attempt, calls = fake_compiles(40 * GIB, 2 * GIB, 128 * GIB)
    best, _ = search_micro_batch(
        attempt, 8, 128 * GIB, max_size=128, multiple=2, max_tries=4, time_ok=lambda d: False
    )
    assert calls == [8] and best == 8


def test_parts_needing_an_accelerator_are_skipped_with_reasons():
    cpu = {
        "found": {
            "jax": {"ok": True, "accelerator": False, "backend": "cpu"},
            "torch": {"ok": True, "cuda": False},
        }
    }
    skip = run.plan_parts(cpu, ["gla", "train", "decode"], dry_run=False)
    assert set(skip) == {"gla", "train", "decode"} and all("--dry-run" in r for r in skip.values())
    assert run.plan_parts(cpu, ["gla", "train", "decode"], dry_run=True) == {}
    broken = {"found": {"jax": {"ok": False, "error": "ImportError: x"}, "torch": {"ok": True}}}
    assert set(run.plan_parts(broken, ["gla", "decode"], dry_run=True)) == {"gla"}


def test_the_headline_is_null_where_nothing_was_measured():
    parts = {"gla": {"headline": {"gla_over_fla_triton_T8192": 1.5}}, "train": {"status": "error"}}
    assert run.headline_of(parts, dry_run=False) == {
        "gla_over_fla_triton_T8192": 1.5,
        "train_tokens_per_s_3b": None,
        "train_mfu_3b": None,
        "train_mfu_published_peak_3b": None,
        "decode_tokens_per_s_3b_1280": None,
    }
    assert set(run.headline_of(parts, dry_run=True).values()) == {None}
