"""The agents' state store (`--state-dir`, serve/state_store/): a conversation's state on disk.

Three real servers on one folder (tests/shared_fixtures.py, all started early): the store server
(one engine) serves a conversation's first 4 turns and is stopped with SIGTERM; the replica
server (2 engines) goes on with it, turn 5 on replica 0 (the states of a stopped server), turn 6
on replica 1 (a state replica 0 wrote); another store server is killed with SIGKILL right after
a reply and the replica server goes on from its files. Each turn's greedy tokens are the PyTorch
model's, and
`usage.prompt_tokens_details.cached_tokens` is exactly the history up to its last block boundary.
Then a corrupted and a truncated file: the request computes its prefix instead (from the state
before), gives the same tokens, the file is removed with one warning line. The file format, a
kill during a write, two writers of one file, a full disk and the start-up errors are checked
on real files and processes without an engine.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from shared_fixtures import START_ENV, VLLM_ENV

from serve.state_store import files
from serve.vllm_adapter import PREFIX_BLOCK_SIZE as BLOCK

MESSAGE, REPLY = 40, 24  # a reply crosses block boundaries (BLOCK) while it decodes


def boundary(total: int) -> int:
    """The state a finished request leaves: its last block boundary before its last token (the
    last token is sampled, never computed through)."""
    return (total - 1) // BLOCK * BLOCK


def state_files(root: Path) -> set[Path]:
    return set(root.rglob(f"*{files.SUFFIX}"))


def files_of_a_turn(prompt: int, total: int) -> int:
    """How many files a turn leaves: the state at its prompt's last block boundary and the one
    at its prompt and reply's (one file when they are the same boundary)."""
    return len({boundary(prompt), boundary(total)})


def wait_for_new_files(root: Path, before: set[Path], count: int, timeout: float = 20) -> set:
    """The `count` state files written since `before` (the writer thread runs after the
    reply)."""
    deadline = time.monotonic() + timeout
    while len(new := state_files(root) - before) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(new) == count, new
    return new


@pytest.fixture(scope="module")
def torch_model(tiny_export):
    from serve.modeling_laplace import LaplaceForCausalLM

    return LaplaceForCausalLM.from_exported(tiny_export[2])


def turn(base: str, history: list[int], rng, rank: int | None = None):
    """Send history + a new message (greedy, REPLY tokens): (prompt, reply, cached tokens)."""
    import urllib.request

    prompt = history + rng.integers(3, 300, MESSAGE).tolist()
    body = {
        "model": "laplace-tiny",
        "prompt": prompt,
        "max_tokens": REPLY,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    headers = {"Content-Type": "application/json"}
    if rank is not None:  # vLLM's header: the replica that serves the request
        headers["X-data-parallel-rank"] = str(rank)
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), headers=headers
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    return prompt, out["choices"][0]["token_ids"], cached


def test_a_conversation_resumes_from_disk_after_a_stop_and_on_another_replica(
    store_server, replica_server, state_dir, torch_model
):
    from serve.generation import greedy_generate

    def reference(prompt):
        return greedy_generate(torch_model, [prompt], REPLY)[0]

    rng = np.random.default_rng(5)
    base_a = f"http://127.0.0.1:{store_server.port}"
    # turns 1-4 on the store server; each finished turn leaves its prompt's and its newest
    history, histories, files_of_turn, totals = [], [], [], []
    for k in range(4):
        before = state_files(state_dir)
        prompt, reply, cached = turn(base_a, history, rng)
        assert reply == reference(prompt), k
        assert cached == (boundary(totals[-1]) if totals else 0), k  # the engine's own cache
        history = prompt + reply
        histories.append(history)
        totals.append(len(history))
        count = files_of_a_turn(len(prompt), len(history))
        if k < 3:
            files_of_turn.append(wait_for_new_files(state_dir, before, count))
    # stopped right after turn 4's reply: the writes in flight are finished before it exits
    store_server.proc.send_signal(signal.SIGTERM)
    assert store_server.proc.wait(timeout=60) == 0
    files_of_turn.append(wait_for_new_files(state_dir, before, count, timeout=0))
    assert not list(state_dir.rglob("*.tmp"))
    roots = {p.parent.parent for turn_files in files_of_turn for p in turn_files}
    assert len(roots) == 1  # state_dir/<store fingerprint>/, its owner's only
    assert roots.pop().stat().st_mode & 0o077 == 0

    # turn 5 on replica 0 of another server: from turn 4's state on disk
    base_b = replica_server.base
    before = state_files(state_dir)
    prompt, reply, cached = turn(base_b, history, rng, rank=0)
    assert reply == reference(prompt)
    assert cached == boundary(totals[-1]) > 0
    history = prompt + reply
    totals.append(len(history))
    wait_for_new_files(state_dir, before, files_of_a_turn(len(prompt), len(history)))

    # turn 6 on replica 1, which never saw the conversation: from the state replica 0 wrote
    prompt, reply, cached = turn(base_b, history, rng, rank=1)
    assert reply == reference(prompt)
    assert cached == boundary(totals[-1])

    # corrupted files (turn 3's): each removed with one warning, the prefix computed from turn
    # 2's state instead, the same tokens
    for path in files_of_turn[2]:
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    prompt, reply, cached = turn(base_b, histories[2], rng, rank=0)
    assert reply == reference(prompt)
    assert cached == boundary(totals[1])
    assert not any(path.exists() for path in files_of_turn[2])
    # truncated files (turn 2's): the same, from turn 1's state
    for path in files_of_turn[1]:
        path.write_bytes(path.read_bytes()[:-1000])
    prompt, reply, cached = turn(base_b, histories[1], rng, rank=1)
    assert reply == reference(prompt)
    assert cached == boundary(totals[0])
    assert not any(path.exists() for path in files_of_turn[1])
    log = replica_server.log_path.read_text()
    warned = [line for line in log.splitlines() if "state store: removed" in line]
    corrupted, truncated = len(files_of_turn[2]), len(files_of_turn[1])
    assert len(warned) == corrupted + truncated, warned
    assert all("checksum mismatch" in line for line in warned[:corrupted]), warned
    assert all("truncated payload" in line for line in warned[corrupted:]), warned


def test_a_server_killed_with_sigkill_leaves_states_another_server_resumes(
    killed_store_server, replica_server, state_dir, torch_model
):
    """A server killed with SIGKILL (its engine process too: no shutdown of any kind) right
    after a reply, its files written or not: the next turn on another server resumes from the
    newest whole state on disk (that reply's, its prompt's, or the turn's before) and gives the
    PyTorch model's tokens; nothing half-written is read."""
    from shared_fixtures import descendants

    from serve.generation import greedy_generate

    rng = np.random.default_rng(11)
    base = f"http://127.0.0.1:{killed_store_server.port}"
    before = state_files(state_dir)
    prompt, reply, _ = turn(base, [], rng)
    first = prompt + reply
    wait_for_new_files(state_dir, before, files_of_a_turn(len(prompt), len(first)))
    prompt, reply, cached = turn(base, first, rng)
    assert cached == boundary(len(first))
    second = prompt + reply
    kept = (boundary(len(second)), boundary(len(prompt)), boundary(len(first)))
    for pid in [*descendants(killed_store_server.proc.pid), killed_store_server.proc.pid]:
        os.kill(pid, signal.SIGKILL)
    assert killed_store_server.proc.wait(timeout=30) == -signal.SIGKILL
    prompt, reply, cached = turn(replica_server.base, second, rng, rank=1)
    assert cached in kept, cached
    assert reply == greedy_generate(torch_model, [prompt], REPLY)[0]


# ---- the file format, writers and faults, on real files without an engine -------------------

FP, KEY = bytes(range(32)), bytes(range(100, 136))


def test_a_state_file_round_trips_and_every_damage_is_named(tmp_path):
    payload = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8)
    path, needs = files.state_path(tmp_path, KEY), bytes(range(72))  # two needed blocks
    assert files.write_state(path, FP, KEY, payload, needs) == path.stat().st_size
    out = np.zeros_like(payload)
    assert files.read_state(path, FP, KEY, out) == needs == files.read_needs(path, FP)
    np.testing.assert_array_equal(out, payload)
    good = path.read_bytes()

    def damaged(data: bytes, fp=FP, key=KEY, size=payload.size) -> str:
        path.write_bytes(data)
        with pytest.raises(files.StateFileError) as e:
            files.read_state(path, fp, key, np.zeros(size, np.uint8))
        return str(e.value)

    header = 64 + len(KEY) + len(needs)
    assert "bad magic" in damaged(b"x" + good[1:])
    assert "format version 7" in damaged(good[:8] + (7).to_bytes(4, "little") + good[12:])
    assert "another model" in damaged(good, fp=bytes(32))
    assert "its key" in damaged(good, key=bytes(36))
    assert "the engine's state is 4999" in damaged(good, size=4999)
    assert "truncated header" in damaged(good[:30])
    assert "truncated list of needed blocks" in damaged(good[: header - 8])
    assert "truncated payload" in damaged(good[:-1])
    assert "bytes after" in damaged(good + b"\0")
    flipped = bytearray(good)
    flipped[header + 17] ^= 1
    assert "checksum" in damaged(bytes(flipped))
    flipped = bytearray(good)
    flipped[header - 5] ^= 1  # a needed block's name: the checksum covers the list too
    assert "checksum" in damaged(bytes(flipped))


WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import numpy as np
    from serve.state_store import files
    root, key = Path(sys.argv[1]), bytes.fromhex(sys.argv[2])
    fill, n = int(sys.argv[3]), int(sys.argv[4])
    payload = np.full(1 << 24, fill, np.uint8)  # 16 MiB: a write takes a while
    print("writing", flush=True)
    for i in range(n):
        k = key if n < 0 or sys.argv[5] == "same" else key + i.to_bytes(4, "big")
        files.write_state(files.state_path(root, k), bytes(32), k, payload)
    """
)


def _writer(root, fill, n, mode):
    cmd = [sys.executable, "-c", WRITER, str(root), KEY.hex(), str(fill), str(n), mode]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])


def _read_all(root: Path) -> list[int]:
    """Each state file's fill value; every one must read whole."""
    fills = []
    for path in sorted(state_files(root)):
        out = np.zeros(1 << 24, np.uint8)
        files.read_state(path, bytes(32), bytes.fromhex(path.name.split(".")[0]), out)
        assert (out == out[0]).all()
        fills.append(int(out[0]))
    return fills


def test_a_writer_killed_mid_write_leaves_whole_files_only(tmp_path):
    proc = _writer(tmp_path, 7, 1000, "distinct")
    assert proc.stdout.readline() == "writing\n"
    time.sleep(0.4)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _read_all(tmp_path) == [7] * len(state_files(tmp_path))  # whole, or not there


def test_two_writers_of_one_state_leave_one_whole_file(tmp_path):
    procs = [_writer(tmp_path, fill, 12, "same") for fill in (1, 2)]
    for p in procs:
        assert p.wait(timeout=120) == 0
    assert _read_all(tmp_path) in ([1], [2])
    assert not list(tmp_path.rglob("*.tmp"))


def test_two_exports_of_one_config_never_share_a_store(tiny_export, tmp_path):
    """Different weights, same config: different fingerprints, so different folders; a file
    moved from one store to the other is refused as another model's."""
    from laplace_export_helpers import export_tiny

    from serve.state_store.fingerprint import model_fingerprint, store_fingerprint

    other = export_tiny(tmp_path / "other", seed=2)[2]
    one = model_fingerprint(tiny_export[2], "float32")
    assert json.loads((other / "config.json").read_text()) == json.loads(
        (tiny_export[2] / "config.json").read_text()
    )
    assert model_fingerprint(other, "float32") != one
    assert model_fingerprint(tiny_export[2], "bfloat16") != one
    layout = {"bytes_per_block": 8192}
    fp_one, fp_other = (
        store_fingerprint(m, layout) for m in (one, model_fingerprint(other, "float32"))
    )
    path = files.state_path(tmp_path, KEY)
    files.write_state(path, fp_one, KEY, b"s" * 64)
    with pytest.raises(files.StateFileError, match="another model"):
        files.read_state(path, fp_other, KEY, bytearray(64))


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 256 KiB tmpfs (a disk that fills): mounting needs root, as on this project's machines
    and CI (elsewhere the test is skipped, saying why)."""
    if os.geteuid() != 0:
        pytest.skip("a full disk is a tmpfs mounted for the test: that needs root")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    status = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)])
    assert status.returncode == 0, "mounting a tmpfs (root) failed"
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def _finish(tier, req: str, block_hash: bytes, chunk: int, end: int):
    """A request reached the state in `chunk` at token `end`, then finished."""
    from tier_helpers import key, store
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req)
    store(tier, ctx, [(key(block_hash, 0), end, chunk)], len(req))
    tier.on_request_finished(ctx)
    tier.drain_jobs()


def test_the_tier_keeps_a_requests_prompt_and_last_states_and_its_lru_capacity(tmp_path):
    """Of a request's states its prompt's last (its known keys end there when vLLM first asks)
    and its newest are written; a load fills the chunk and is a use; past the capacity the least
    recently used bundle goes."""
    from tier_helpers import key, load, make_tier, store
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    tier, host = make_tier(tmp_path, 3000, capacity=3 * 3200)
    hashes = [bytes([i]) * 32 for i in range(6)]
    ctx = ReqContext("a")
    ctx.set_offload_key_position(key(hashes[0], 0), 64)  # the prompt: two blocks
    for i, (h, end) in enumerate(zip(hashes[:4], (64, 32, 96, 128), strict=True)):
        host[i, :3000] = i + 1
        store(tier, ctx, [(key(h, 0), end, i)], i)  # 32: offered late, older than the rest
    tier.on_request_finished(ctx)
    tier.drain_jobs()
    hits = [tier.lookup(key(h, 0), ctx) == LookupResult.HIT for h in hashes[:4]]
    assert hits == [True, False, False, True]  # the prompt's (64) and the newest (128)
    host[:] = 0
    assert load(tier, [key(hashes[3], 0)], [3]).success
    assert (host[3, :3000] == 4).all() and (host[3, 3000:] == 0).all()
    # 3 bundles fit: a 4th written pushes out the least recently used
    time.sleep(0.02)
    _finish(tier, "d", hashes[4], 1, 32)
    time.sleep(0.02)
    assert load(tier, [key(hashes[0], 0)], [3]).success  # hashes[0]: a use
    _finish(tier, "e", hashes[5], 2, 32)
    hits = [tier.lookup(key(h, 0), ctx) == LookupResult.HIT for h in hashes]
    assert hits == [True, False, False, False, True, True]  # hashes[3], the oldest use, went
    tier.shutdown()


def test_a_full_disk_stops_storing_with_one_warning_and_loads_go_on(tiny_tmpfs, caplog):
    from tier_helpers import key, load, make_tier
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    tier, host = make_tier(tiny_tmpfs, 4000, capacity=1 << 30)
    host[:, :4000] = 5
    keys = [i.to_bytes(32, "big") for i in range(200)]
    caplog.set_level("WARNING", logger="vllm.laplace.state_store")
    for i, h in enumerate(keys):  # 256 KiB: full after a few dozen states
        _finish(tier, f"r{i}", h, i % 4, 32)
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "state store" in r.getMessage()
    ]  # (its start-up line is INFO, captured too once vLLM has set its loggers to INFO)
    assert len(warned) == 1 and "storing stopped" in warned[0], warned
    assert "No space left" in warned[0]
    stored = [k for k in keys if tier.lookup(key(k, 0), ReqContext("x")) == LookupResult.HIT]
    assert 0 < len(stored) < len(keys)
    assert not list(tiny_tmpfs.rglob("*.tmp"))
    host[:] = 0
    assert load(tier, [key(stored[-1], 0)], [0]).success and (host[0, :4000] == 5).all()
    tier.shutdown()


def test_a_state_dir_it_cannot_use_is_an_error_at_start_up(tiny_export, tmp_path, capsys):
    from serve import vllm_adapter

    def refused(*args) -> str:
        with pytest.raises(SystemExit) as stop:
            vllm_adapter.main(["--model", str(tiny_export[2]), *args])
        assert stop.value.code == 2
        return capsys.readouterr().err

    (tmp_path / "a_file").write_text("")
    assert "not a writable folder" in refused("--state-dir", str(tmp_path / "a_file" / "states"))
    if os.geteuid() == 0:  # a read-only file system (root writes anywhere else)
        ro = tmp_path / "ro"
        ro.mkdir()
        mount = ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)]
        assert subprocess.run(mount).returncode == 0
        try:
            assert "Read-only file system" in refused("--state-dir", str(ro / "states"))
        finally:
            subprocess.run(["umount", str(ro)], check=True)
    assert "give --state-dir too" in refused("--state-dir-bytes", "1G")
    assert "cannot read '12X'" in refused(
        "--state-dir", str(tmp_path / "s"), "--state-dir-bytes", "12X"
    )
    assert settings_parse_ok()


def settings_parse_ok() -> bool:
    from serve.state_store.settings import parse_bytes

    assert parse_bytes("16G") == 16 * 2**30 and parse_bytes("1.5GiB") == 3 * 2**29
    assert parse_bytes("512M") == 512 * 2**20 and parse_bytes("4096") == 4096
    return True


def test_the_offline_mode_stores_its_last_states_before_it_exits(
    replica_server, state_dir, tiny_export, torch_model
):
    """`--prompt-ids ... --state-dir`: the offline engine's request leaves its file before the
    command exits (serve/state_store/offline.py), and a server goes on from it."""
    from serve.generation import greedy_generate

    rng = np.random.default_rng(9)
    prompt = rng.integers(3, 300, 80).tolist()
    before = state_files(state_dir)
    cmd = [sys.executable, "-m", "serve.vllm_adapter", "--model", str(tiny_export[2])]
    cmd += ["--state-dir", str(state_dir), "--max-model-len", "512", "--json"]
    cmd += ["--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", str(REPLY)]
    cmd.append("--ignore-eos")  # REPLY tokens, as greedy_generate gives them
    env = {**START_ENV, **VLLM_ENV}  # a fresh command, not a child of a process that ran vLLM
    repo = Path(__file__).parents[1]
    run = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    row = json.loads([line for line in run.stdout.splitlines() if line.startswith("{")][0])
    assert row["token_ids"] == greedy_generate(torch_model, [prompt], REPLY)[0]
    count = files_of_a_turn(len(prompt), len(prompt) + REPLY)
    assert len(state_files(state_dir) - before) == count  # written before the command returned
    history = prompt + row["token_ids"]
    prompt2, reply, cached = turn(replica_server.base, history, rng, rank=0)
    assert cached == boundary(len(history))
    assert reply == greedy_generate(torch_model, [prompt2], REPLY)[0]
