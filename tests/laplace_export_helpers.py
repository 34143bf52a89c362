"""Shared by the export / PyTorch / vLLM tests: a tiny model, its tokenizer, its checkpoint."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

# the tiny preset's vocabulary (320) holds a byte-level BPE (256 bytes + merges + EOS)
TINY_OVERRIDES: list[str] = []
EOS = "<|endoftext|>"


def tiny_config():
    from laplace_spec.config import get_config

    return get_config("tiny", TINY_OVERRIDES)


def random_params(cfg, seed: int = 0, noise: float = 0.1) -> dict:
    """The JAX initialisation plus noise on every tensor, so that no path is trivial
    (aug_balance starts at 0 and the head-norm scales at 1)."""
    import jax

    from laplace_jax.model import init_params

    params = init_params(cfg, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: np.asarray(x) + noise * rng.standard_normal(x.shape).astype(np.float32), params
    )


def corpus() -> str:
    words = "the quick brown fox jumps over a lazy dog while seven small birds sing".split()
    rng = np.random.default_rng(0)
    return "\n".join(" ".join(rng.choice(words, 12)) for _ in range(400))


def indented_corpus() -> str:
    """Code-like lines indented by 4, 8 and 12 spaces: a BPE trained on it merges runs of
    spaces into tokens of 2, 4 and 8."""
    words = "def return if else for while self value item".split()
    rng = np.random.default_rng(1)
    lines = [
        " " * (4 * int(rng.integers(1, 4))) + " ".join(rng.choice(words, 4)) for _ in range(400)
    ]
    return "\n".join(lines)


def write_tokenizer(out_dir: Path, vocab_size: int, text: str | None = None) -> Path:
    """A byte-level BPE trained on a generated text (`corpus()` unless given), saved as
    tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((text or corpus()).splitlines(), trainer)
    assert tok.get_vocab_size() <= vocab_size
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    return out_dir


def write_checkpoint(ckpt_dir: Path, params: dict | None, cfg, step: int = 3) -> Path:
    """An orbax checkpoint shaped like train/'s: items params, opt_state, meta (JSON)."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    items = {
        "opt_state": ocp.args.StandardSave({"count": jnp.zeros((), jnp.int32)}),
        "meta": ocp.args.JsonSave({"config": cfg.to_dict(), "tokenizer": "tokenizer.json"}),
    }
    if params is not None:
        items["params"] = ocp.args.StandardSave(params)
    mngr = ocp.CheckpointManager(ckpt_dir)
    mngr.save(step, args=ocp.args.Composite(**items))
    mngr.wait_until_finished()
    mngr.close()
    return ckpt_dir


def make_run(run_dir: Path, cfg, params) -> Path:
    """A training run directory: checkpoints/, config.json, tokenizer.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(run_dir, cfg.vocab_size)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
    write_checkpoint(run_dir / "checkpoints", params, cfg)
    return run_dir


def export_tiny(root: Path, seed: int, attention_every: int = 0):
    """(cfg, params, export folder): the tiny model with random weights, exported with its
    tokenizer under `root` (what the vLLM tests serve); attention_every=k: the tiny hybrid."""
    from export import exporter

    cfg = tiny_config().replace(attention_every=attention_every)
    params = random_params(cfg, seed=seed)
    tok = write_tokenizer(root / "tok", cfg.vocab_size)
    out = exporter.export_model(cfg, params, root / "model", tokenizer_dir=tok, max_len=1024)
    return cfg, params, out


def export_spaces(root: Path, seed: int = 2):
    """(cfg, params, export folder, the one-space token): the tiny model made to answer every
    prompt with runs of spaces, its tokenizer one that merges runs of spaces (`indented_corpus`):
    every embedding row the same large vector e and the LM head's column of the one-space token
    along e, so after the final norm that token's logit dominates whatever the layers (random, as
    `random_params`) add. 24 generated one-space tokens are text that encodes as 3 tokens of 8:
    a client's copy of the reply never gives back the model's tokens."""
    from tokenizers import Tokenizer

    from export import exporter

    cfg = tiny_config()
    tok_dir = write_tokenizer(root / "tok", cfg.vocab_size, indented_corpus())
    space = Tokenizer.from_file(str(tok_dir / "tokenizer.json")).token_to_id("\u0120")  # "Ġ"
    params = random_params(cfg, seed=seed)
    e = np.random.default_rng(seed).standard_normal(cfg.d_model).astype(np.float32)
    e *= 20.0 / np.linalg.norm(e)
    params["embed"]["embedding"] = np.tile(e, (cfg.vocab_size, 1))
    params["lm_head"]["kernel"][:, space] = 50.0 * e / np.linalg.norm(e)
    out = exporter.export_model(cfg, params, root / "model", tokenizer_dir=tok_dir, max_len=1024)
    return cfg, params, out, space


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a test server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(url, body, timeout=120) -> tuple[int, str]:
    """POST `body` as JSON: (HTTP status, response text), error statuses included."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def start_server(cmd, log_path: Path, env: dict, cwd) -> subprocess.Popen:
    """Start a server command with its output in `log_path` (not waiting for it)."""
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_for_server(proc: subprocess.Popen, port: int, log_path: Path, timeout: float = 300) -> str:
    """Wait until the server on `port` answers /v1/models: its base URL. A server that exits or
    does not come up fails the test with the end of its log."""
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail("server exited: " + log_path.read_text()[-4000:])
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return base
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            pytest.fail("server did not come up: " + log_path.read_text()[-4000:])
        time.sleep(1)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT (stopped by its own process id), killed after 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def adapter_server(cmd, port: int, log_path: Path, env: dict, cwd, timeout: float = 300):
    """Run a server command (`python -m serve.vllm_adapter ... --port PORT`) with its output in
    `log_path`; wait until /v1/models answers, yield (base URL, process); on exit stop it."""
    proc = start_server(cmd, log_path, env, cwd)
    try:
        yield wait_for_server(proc, port, log_path, timeout), proc
    finally:
        stop_server(proc)


def greedy_ids(llm, prompts, n: int, skip_cache: bool = False) -> list[tuple[list[int], int]]:
    """vLLM's greedy tokens (n each) and cached prompt tokens of each prompt (token ids);
    skip_cache: the requests do not read vLLM's prefix cache."""
    from vllm import SamplingParams

    sp = SamplingParams(
        max_tokens=n,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        skip_reading_prefix_cache=skip_cache,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens or 0) for o in outs]
