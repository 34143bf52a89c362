"""vLLM engines on the tiny exports, each in a subprocess of its own, run by the background queue
(tests/background.py) while earlier tests run: vLLM's compile mode (tests/test_vllm_varlen.py,
tests/test_hybrid_vllm.py; building a compiled engine takes about a minute on the project's
2-core CPU: vLLM traces the model once with a symbolic token count, then inductor compiles it,
most of it on one core), or an eager engine where the spec says `compile: false` (the
wide-vocabulary run's, tests/wide_vocab.py).

    python tests/compiled_engines.py SPEC.json OUT.json

SPEC: the export folder, make_llm's settings, the calls (each a list of prompts, run in order on
the one engine) and the tokens per prompt. OUT: the engine's settings as vLLM resolved them and
each call's greedy tokens. The tests compare those tokens with the PyTorch model's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

N_NEW = 24  # greedy tokens per prompt
VARLEN_BUDGET = 64  # max_num_batched_tokens of the varlen engine: a 300-token prompt takes 5 steps


def varlen_calls(vocab_size: int) -> list[list[list[int]]]:
    """Prompts of 300, 1 (after a long one: a used page), 17, 150 and 90 tokens in one call;
    then the 1-token and the 300-token prompt alone (pages reused)."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, vocab_size, n).tolist() for n in (300, 1, 17, 150, 90)]
    return [prompts, [prompts[1]], [prompts[0]]]


def hybrid_calls(vocab_size: int) -> list[list[list[int]]]:
    """Prompts of 7 to 300 tokens in one call (each prefilled in one piece)."""
    rng = np.random.default_rng(0)
    return [[rng.integers(0, vocab_size, n).tolist() for n in (7, 19, 150, 300)]]


def spec(folder: Path, calls, **engine) -> dict:
    return {"folder": str(folder), "engine": engine, "calls": calls, "n_new": N_NEW}


def command(spec: dict, out: Path, env: dict) -> tuple[list[str], dict]:
    """The queue's command for `spec`, its result written to `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    spec_path = out.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    here = Path(__file__).resolve()
    path = [str(here.parents[1]), env.get("PYTHONPATH")]  # the repository's packages first
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    return [sys.executable, str(here), str(spec_path), str(out)], env


def main(spec_path: str, out_path: str) -> None:
    from serve.vllm_adapter import generate, make_llm

    spec = json.loads(Path(spec_path).read_text())
    llm = make_llm(spec["folder"], max_num_seqs=8, **{"compile": True, **spec["engine"]})
    config = llm.llm_engine.vllm_config
    result = {
        "enforce_eager": config.model_config.enforce_eager,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "enable_chunked_prefill": config.scheduler_config.enable_chunked_prefill,
        "calls": [
            [r["token_ids"] for r in generate(llm, prompts, spec["n_new"], ignore_eos=True)]
            for prompts in spec["calls"]
        ],
    }
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
