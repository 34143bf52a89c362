"""The sizes of a `bench.serve` run and their command-line flags (one flag per size)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

PRESET = "small"
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
    repeats: int = 3  # best of, for every throughput figure
    cost_tokens: int = 24  # decode steps per timed window (cost per output token)
    cost_seqs: int = 4
    cost_repeats: int = 8
    budget_requests: int = 1280  # the shared state/KV budget run
    budget_prompt: int = 1024
    budget_new_tokens: int = 128
    budget_bytes: int = 2**30
    turns: int = 10  # the conversation
    turn_first: int = 256  # turn 1's prompt (the first message)
    turn_message: int = 256  # each later turn: + the reply + a new message of this many tokens
    turn_reply: int = 64
    turn_repeats: int = 3  # conversations (different tokens); best TTFT per turn
    compile_levels: tuple[int, ...] = (1, 64)  # vLLM compile mode, 128-token prompts
    exact_prompts: int = 8  # compile mode's greedy tokens vs eager's: prompts x exact_tokens
    exact_tokens: int = 32


FULL = Sizes()


QUICK = dataclasses.replace(
    FULL,
    new_tokens=16,
    p128_new_tokens=32,
    long_new_tokens=16,
    repeats=1,
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
)


def _show(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _ints(text: str) -> tuple[int, ...]:
    """'1,64' -> (1, 64); '' -> () (e.g. `--compile-levels ''`: no compile-mode phase)."""
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
