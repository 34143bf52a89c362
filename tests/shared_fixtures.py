"""Session fixtures that several test files share (tests/conftest.py imports them): the exported
tiny model, vLLM's offline engine on it, and the 2-replica OpenAI server.

Each is built once per test run, because each costs tens of seconds on this project's CPU (a
vLLM engine or server start) and one configuration serves every test that needs it. A test that
needs an engine of another configuration builds its own and says why in one line.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from laplace_export_helpers import adapter_server, export_tiny, free_port

REPO = Path(__file__).resolve().parents[1]
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of state pages per engine
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with a function (state pages)
}
SERVER_MAX_LEN = 128  # --max-model-len of the shared server


def set_vllm_env() -> None:
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """(cfg, params, folder): the tiny model with random weights, exported with its tokenizer
    (serving length 1,024): the model every vLLM and lm-eval test serves."""
    return export_tiny(tmp_path_factory.mktemp("tiny_export"), seed=1)


@pytest.fixture(scope="session")
def vllm_engine(tiny_export):
    """vLLM's offline engine on the export with the adapter's defaults (eager, fp32, no prefix
    caching), max_num_seqs 8."""
    set_vllm_env()
    from serve.vllm_adapter import make_llm

    engine = make_llm(str(tiny_export[2]), max_num_seqs=8)
    yield engine
    del engine


@dataclasses.dataclass
class Server:
    base: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log_path: Path
    bind: str  # each replica's cores, '|'-separated


def descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@pytest.fixture(scope="session")
def replica_server(tiny_export):
    """`python -m serve.vllm_adapter` as a user starts it, 2 replicas of 1 core each
    (`--data-parallel-size 2 --cpu-cores-per-replica 1`), max-model-len 128, 4 sequences per
    replica: the server tests (tests/test_vllm.py) and the replica tests
    (tests/test_vllm_replicas.py) ask it."""
    from serve.replicas import BIND_ENV, replica_binding

    out = tiny_export[2]
    port = free_port()
    bind = replica_binding(2, cores_per_replica=1)  # the first two usable cores
    env = {**os.environ, **VLLM_ENV}
    env.pop(BIND_ENV, None)
    cmd = [
        sys.executable,
        "-m",
        "serve.vllm_adapter",
        "--model",
        str(out),
        "--port",
        str(port),
        "--max-model-len",
        str(SERVER_MAX_LEN),
        "--served-model-name",
        "laplace-tiny",
        "--max-num-seqs",
        "4",
        "--data-parallel-size",
        "2",
        "--cpu-cores-per-replica",
        "1",
    ]
    log_path = out.parent / "replica_server.log"
    t0 = time.monotonic()
    with adapter_server(cmd, port, log_path, env, REPO) as (base, proc):
        print(f"2-replica server up in {time.monotonic() - t0:.1f} s")
        children = descendants(proc.pid)
        yield Server(base, proc, log_path, bind)
    for pid in children:  # engine processes it started, should any outlive it
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
