"""Replicas: vLLM's data parallel on CPU (`--data-parallel-size N`), each engine on its own cores.

The binding derivation and its errors are checked without an engine; the session's server with
2 replicas of 1 core each (tests/shared_fixtures.py) answers concurrent requests with the greedy
tokens of the PyTorch model, and both replicas serve (vLLM's per-engine counters in /metrics) on
the cores they were given (the engines' OpenMP binding log lines).
"""

from __future__ import annotations

import json
import os
import re
import runpy
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from laplace_export_helpers import post_json
from shared_fixtures import descendants

from serve import replicas, vllm_adapter
from serve.replicas import BIND_ENV, format_core_list, parse_core_list, replica_binding

N_NEW = 12
N_REQUESTS = 8


# ---- the binding, no engine ------------------------------------------------------------------


def test_replica_binding_derived_from_the_available_cores():
    assert replica_binding(2, available=[0, 1]) == "0|1"
    assert replica_binding(2, available=list(range(8))) == "0-3|4-7"
    assert replica_binding(2, cores_per_replica=3, available=list(range(8))) == "0-2|3-5"
    assert replica_binding(3, available=list(range(8))) == "0-1|2-3|4-5"  # 6, 7 left free
    assert replica_binding(2, available=[4, 5, 6, 7]) == "4-5|6-7"  # a restricted affinity
    assert replica_binding(1, available=[0, 1]) is None  # one engine: vLLM's own binding
    assert replica_binding(1, cores_per_replica=1, available=[0, 1]) == "0"
    # explicit lists are checked and passed on (normalised)
    assert replica_binding(2, bind="0|1", available=[0, 1]) == "0|1"
    assert replica_binding(2, bind="0,1,2-3|4-7", available=list(range(8))) == "0-3|4-7"
    assert parse_core_list("5,2-4") == [5, 2, 3, 4]
    assert format_core_list([8, 0, 1, 2, 3]) == "0-3,8"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(replicas=3), r"--data-parallel-size 3 needs at least 3 CPU cores"),
        (dict(replicas=2, cores_per_replica=2), r"--cpu-cores-per-replica 2 needs 4 CPU cores"),
        (dict(replicas=2, cores_per_replica=0), r"--cpu-cores-per-replica must be at least 1"),
        (dict(replicas=0), r"--data-parallel-size must be at least 1"),
        (dict(replicas=2, bind="0"), r"--bind='0' has 1 core list\(s\) .* one per replica"),
        (dict(replicas=2, bind="0|5"), r"--bind='0\|5' names cores \[5\]"),
        (dict(replicas=2, bind="0-1|1"), r"replicas 0 and 1 share cores \[1\]"),
        (dict(replicas=2, bind="a|1"), r"--bind='a\|1': cannot read core list 'a'"),
        (dict(replicas=2, bind="1-0|1"), r"cannot read core list '1-0'"),
        (dict(replicas=2, bind="0|1", cores_per_replica=1), r"--bind or --cpu-cores-per-replica"),
    ],
    ids=[
        "too-few-cores",
        "cores-per-replica",
        "zero-cores",
        "zero-replicas",
        "one-list",
        "foreign-core",
        "shared-core",
        "unreadable",
        "reversed-range",
        "both",
    ],
)
def test_replica_binding_errors_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        replica_binding(available=[0, 1], **kwargs)


@pytest.fixture(scope="module")
def exported(tiny_export):
    return tiny_export[0], tiny_export[2]


def _server_argv(monkeypatch, args) -> list[str]:
    """vllm_adapter.main(args) up to vLLM's server on a CPU: the argv it would start it with
    (the GPU's: tests/test_serving_platform.py)."""
    monkeypatch.setattr(vllm_adapter, "serving_platform", lambda: "cpu")
    seen = {}
    monkeypatch.setattr(runpy, "run_module", lambda *a, **k: seen.update(argv=list(sys.argv)))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert vllm_adapter.main(args) == 0
    return seen["argv"]


def test_cli_replicas_set_the_binding_and_vllm_flag(exported, monkeypatch, capsys):
    out = exported[1]
    monkeypatch.setattr(replicas, "available_cores", lambda: [0, 1, 2, 3])
    monkeypatch.setenv(BIND_ENV, "auto")  # restored after the test; main() sets it
    base = ["--model", str(out), "--port", "1"]
    argv = _server_argv(monkeypatch, [*base, "--data-parallel-size", "2"])
    assert argv[argv.index("--data-parallel-size") + 1] == "2"
    assert os.environ[BIND_ENV] == "0-1|2-3"
    # max_num_seqs is per replica: the single engine's default
    assert argv[argv.index("--max-num-seqs") + 1] == str(vllm_adapter.default_max_num_seqs(out))
    argv = _server_argv(monkeypatch, [*base, "-dp", "2", "--cpu-cores-per-replica", "1"])
    assert os.environ[BIND_ENV] == "0|1"
    # vLLM's own flag through --vllm-arg means the same (and is not passed twice)
    monkeypatch.setenv(BIND_ENV, "auto")
    argv = _server_argv(monkeypatch, [*base, "--vllm-arg=--data-parallel-size=2"])
    assert argv.count("--data-parallel-size") == 1 and os.environ[BIND_ENV] == "0-1|2-3"
    argv = _server_argv(monkeypatch, [*base, "-dp", "2", "--bind", "3|0"])
    assert os.environ[BIND_ENV] == "3|0"
    # an explicit binding in the environment is taken as --bind
    monkeypatch.setenv(BIND_ENV, "2|3")
    argv = _server_argv(monkeypatch, [*base, "-dp", "2"])
    assert os.environ[BIND_ENV] == "2|3"
    # one replica: no flag, the environment left alone
    monkeypatch.setenv(BIND_ENV, "auto")
    argv = _server_argv(monkeypatch, base)
    assert "--data-parallel-size" not in argv and os.environ[BIND_ENV] == "auto"
    capsys.readouterr()
    for bad, message in [
        (["-dp", "5"], "--data-parallel-size 5 needs at least 5 CPU cores"),
        (["-dp", "2", "--bind", "0"], "--bind='0' has 1 core list(s)"),
        (["-dp", "2", "--vllm-arg=--data-parallel-size=3"], "--data-parallel-size 2 and"),
        (["-dp", "2", "--prompt", "the"], "--data-parallel-size serves replicas in server mode"),
    ]:
        with pytest.raises(SystemExit) as e:
            vllm_adapter.main([*base, *bad])
        assert e.value.code == 2 and message in capsys.readouterr().err
    monkeypatch.setenv(BIND_ENV, "0|1|2")
    with pytest.raises(SystemExit):
        vllm_adapter.main([*base, "-dp", "2"])
    assert f"{BIND_ENV}='0|1|2' has 3 core list(s)" in capsys.readouterr().err


# ---- one server, 2 replicas of 1 core each (the session's: tests/shared_fixtures.py) ---------


def _per_engine(metrics: str, name: str) -> dict[str, float]:
    """The sum of a Prometheus counter per engine label."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            engine = re.search(r'engine="(\d+)"', line).group(1)
            out[engine] = out.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _counters(base: str) -> dict[str, dict[str, float]]:
    """Requests served and tokens generated so far, per engine."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    names = ("vllm:request_success_total", "vllm:generation_tokens_total")
    return {name: _per_engine(metrics, name) for name in names}


def _since(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {e: v - before.get(e, 0.0) for e, v in now.items()}


def test_two_replicas_answer_concurrent_requests(exported, replica_server):
    import psutil

    from serve.generation import greedy_generate
    from serve.modeling_laplace import LaplaceForCausalLM

    cfg, out = exported
    base, bind, log_path = replica_server.base, replica_server.bind, replica_server.log_path
    server_pid = replica_server.proc.pid
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (1, 5, 17, 40, 3, 64, 9, 30)]
    assert len(prompts) == N_REQUESTS
    want = greedy_generate(LaplaceForCausalLM.from_exported(out), prompts, N_NEW)

    def ask(p):
        body = {
            "model": "laplace-tiny",
            "prompt": p,
            "max_tokens": N_NEW,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        return post_json(base + "/v1/completions", body)

    before = _counters(base)  # the server is the session's: other tests asked it too
    with ThreadPoolExecutor(N_REQUESTS) as pool:
        replies = list(pool.map(ask, prompts))
    assert [s for s, _ in replies] == [200] * N_REQUESTS, replies
    got = [json.loads(text)["choices"][0]["token_ids"] for _, text in replies]
    assert got == want

    for _ in range(20):  # the counters are recorded as the engines' outputs arrive
        now = _counters(base)
        served = _since(now["vllm:request_success_total"], before["vllm:request_success_total"])
        if sum(served.values()) >= N_REQUESTS:
            break
        time.sleep(0.5)
    assert set(served) == {"0", "1"} and all(v > 0 for v in served.values()), served
    assert sum(served.values()) == N_REQUESTS
    generated = _since(now["vllm:generation_tokens_total"], before["vllm:generation_tokens_total"])
    assert sum(generated.values()) == N_REQUESTS * N_NEW and min(generated.values()) > 0

    # each replica's worker was bound to its own core list: vLLM's OpenMP binding log, and the
    # CPU affinity of the worker processes (libgomp pins them to GOMP_CPU_AFFINITY)
    log = log_path.read_text()
    assert f"{BIND_ENV}={bind!r}" in log
    affinities = set()
    for pid in descendants(server_pid):
        try:
            affinities.add(tuple(sorted(psutil.Process(pid).cpu_affinity())))
        except psutil.NoSuchProcess:
            pass
    for cores in bind.split("|"):
        assert f"local_rank=0, core ids={parse_core_list(cores)}" in log, log[-4000:]
        assert tuple(parse_core_list(cores)) in affinities, affinities
