"""The sizes of a `bench.serve` run and their command-line flags (one flag per size)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

PRESET = "small"
# The mid-size row's models: about 300M parameters (Laplace: 298M) at the small preset's
# vocabulary, its other settings unchanged; the Llama has the same width, depth and FFN width.
MID_SHAPE = {
    "d_model": 1024,
    "n_layers": 22,
    "n_heads": 8,
    "d_k": 64,
    "d_v": 128,
    "ffn_dim": 2816,
    "n_tiers": 4,
}
COST_PROMPTS = (2048, 8192)  # cost_per_token_8k_over_2k


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every size of a run; each is a flag (`--turn-reply 32`). Defaults: the full run."""

    levels: tuple[int, ...] = (1, 8, 32, 64)  # concurrent sequences, both throughput tables
    new_tokens: int = 64  # per request, 64-token-prompt table (tokens_per_s_at_32)
    p128_new_tokens: int = 128  # per request, 128-token-prompt table
    long_seqs: int = 64  # sequences with `long_prompt`-token prompts
    long_prompt: int = 2048
    long_new_tokens: int = 128
    agent_levels: tuple[int, ...] = (1, 8)  # the agent row: sequences with a long history
    agent_prompt: int = 8192  # the history (prompt) of each, then `agent_new_tokens` new ones
    agent_new_tokens: int = 128
    rounds: int = 5  # alternating rounds of every throughput and prefill figure (median)
    cost_tokens: int = 24  # decode steps per timed window (cost per output token)
    cost_seqs: int = 4
    cost_repeats: int = 8  # rounds of cost windows (each: every engine at 2k and 8k)
    budget_requests: int = 1280  # the shared state/KV budget run
    budget_prompt: int = 1024
    budget_new_tokens: int = 128
    budget_bytes: int = 2**30
    turns: int = 10  # the conversation
    turn_first: int = 256  # turn 1's prompt (the first message)
    turn_message: int = 256  # each later turn: + the reply + a new message of this many tokens
    turn_reply: int = 64
    turn_repeats: int = 3  # conversations (different tokens); best TTFT per turn
    compiled: int = 1  # 1: both models in vLLM's compile mode too (128-token table, prefill)
    exact_prompts: int = 8  # compiled engines' greedy tokens vs eager's: prompts x exact_tokens
    exact_tokens: int = 32
    mid_seqs: int = 64  # the mid-size row (0: none): sequences, prompt, new tokens, one budget
    mid_prompt: int = 1024
    mid_new_tokens: int = 128
    mid_budget_bytes: int = 4 * 2**30  # state pages / KV cache of each mid-size engine
    mid_rounds: int = 2  # alternating rounds of the mid-size row (each ~4 minutes an engine)
    seed_levels: tuple[int, ...] = (1, 8)  # the seed row: mid-size, compiled over eager
    seed_prompt: int = 128
    seed_new_tokens: int = 128
    seed_budget_bytes: int = 2**30  # state pages / KV cache of each of its four engines
    hybrid_every: tuple[int, ...] = (2, 4)  # --hybrid: the hybrids' attention_every
    hybrid_contexts: tuple[int, ...] = (2048, 8192)  # --hybrid: bytes per sequence at these
    hybrid_budget_rounds: int = 2  # --hybrid: alternating rounds of the shared budget runs
    profile_layers: tuple[int, ...] = (2, 4, 8)  # --profile: depths of the decode-step fit
    profile_seqs: tuple[int, ...] = (1, 8)  # --profile: sequences decoding at once
    profile_rounds: int = 7  # --profile: alternating rounds of timed windows per depth
    resume_histories: tuple[int, ...] = (2048, 8192, 32768)  # --agent-resume: history lengths
    resume_message: int = 64  # --agent-resume: the new message of the turn after the restart
    resume_reply: int = 32  # --agent-resume: each turn's greedy reply
    resume_rounds: int = 3  # --agent-resume: restarts per history (store and cold each time)
    shared_n: int = 16  # --agent-resume, the hybrid: conversations sharing one system prompt
    shared_prompt: int = 4096  # --agent-resume, the hybrid: that prompt's tokens


FULL = Sizes()


QUICK = dataclasses.replace(
    FULL,
    new_tokens=16,
    p128_new_tokens=32,
    long_new_tokens=16,
    agent_prompt=1024,
    agent_new_tokens=16,
    rounds=2,
    cost_tokens=8,
    cost_seqs=2,
    cost_repeats=1,
    budget_requests=128,
    budget_prompt=256,
    budget_new_tokens=32,
    budget_bytes=2**27,
    turn_first=128,
    turn_message=128,
    turn_reply=16,
    turn_repeats=2,
    mid_seqs=4,
    mid_prompt=256,
    mid_new_tokens=16,
    mid_rounds=1,
    seed_new_tokens=16,
    hybrid_contexts=(512, 2048),
    hybrid_budget_rounds=1,
    resume_histories=(512, 2048),
    resume_rounds=2,
    shared_n=4,
    shared_prompt=512,
)


def _show(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _ints(text: str) -> tuple[int, ...]:
    """'1,64' -> (1, 64); '' -> ()."""
    return tuple(int(v) for v in text.split(",") if v.strip())


def parse_sizes(argv=None) -> tuple[argparse.Namespace, Sizes]:
    """`python -m bench.serve`'s command line: --quick, --skip-llama, --out and one flag per
    size (its default the full run's, or the quick run's with --quick)."""
    ap = argparse.ArgumentParser(
        prog="python -m bench.serve",
        description="Serving benchmark: Laplace vs a same-size Llama, through vLLM on this CPU.",
        epilog="Sizes: the `Sizes` class in bench/serving/sizes.py says what each one is.",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smaller sizes, a few minutes (written to serve_quick.json)",
    )
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="only the decode-step profile (bench/serving/profile.py) -> serve_profile.json",
    )
    ap.add_argument(
        "--hybrid",
        action="store_true",
        help="only the hybrid rows (bench/serving/hybrid.py) -> serve_hybrid.json",
    )
    ap.add_argument(
        "--agent-resume",
        action="store_true",
        help="only the state store's restart and replica rows (bench/serving/agent_resume.py) "
        "-> agent_resume.json",
    )
    ap.add_argument("--out", type=Path, default=None, help="result JSON (a PNG beside it)")
    for f in dataclasses.fields(Sizes):
        is_tuple = isinstance(f.default, tuple)
        ap.add_argument(
            "--" + f.name.replace("_", "-"),
            type=_ints if is_tuple else int,
            default=None,
            help=f"default {_show(f.default)} (quick {_show(getattr(QUICK, f.name))})",
        )
    args = ap.parse_args(argv)
    base = QUICK if args.quick else FULL
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Sizes)}
    return args, dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
