"""Synthetic retrieval tasks, generated on the fly and deterministic by seed (docs/design.md s9).

Every generator returns `(tokens, answer_mask)`:

- `tokens` [B, T + 1] int32: inputs are `tokens[:, :-1]`, targets `tokens[:, 1:]` (the trainer's
  layout, train/data.py);
- `answer_mask` [B, T] bool: True at the *target* positions that are scored (loss and accuracy);
  `answer_mask[b, t]` means "the model's prediction at input position t, of `tokens[b, t + 1]`,
  is an answer".

`seed` is an int or a sequence of ints (e.g. `(seed, step, process)`), fed to
`numpy.random.default_rng`: the same seed gives the same batch on every machine.

MQAR (multi-query associative recall, zoology's `multiquery_ar`, Arora et al. 2023), with
P = `num_pairs`, V = `vocab_size`, T = `seq_len`:

    token ids   0            filler (every position that is neither a pair nor a query)
                [1, V // 2)  keys
                [V // 2, V)  values
    tokens[b]   k1 v1 k2 v2 ... kP vP | query region of T + 1 - 2P tokens
                query j sits at 2P + 2 * g_j and is followed by its value at 2P + 2 * g_j + 1,
                where the gaps g_j are P distinct draws from {0, ..., (T - 2P) // 2 - 1} with
                P(g) proportional to (g + 1) ** (power_a - 1) (power law, zoology's alpha 0.01)
    answer_mask True exactly at t = 2P + 2 * g_j (the query key's position: its target is the
                value), P positions per row

Keys within a row are distinct, values are drawn independently (distinct too, as zoology does),
every key is queried exactly once, in a random order. Needs 4P <= T (zoology's condition) and
P < V // 2 keys and values to draw from.

Passkey retrieval, with T = `seq_len`, n = `num_digits`, V = `vocab_size`:

    token ids   1            KEY marker ("the pass key is")
                2            QUERY marker ("what is the pass key?")
                [3, 13)      digits 0..9 (digit d is token 3 + d)
                [13, V)      filler: uniform random tokens (a range the answer never uses)
                0            unused
    tokens[b]   filler ... KEY d1 .. dn filler ... QUERY d1 .. dn
                the needle KEY d1..dn (n + 1 tokens) starts at position
                round(depth * (T - 2n - 1)): depth 0 is the very start, depth 1 right before the
                query; the query QUERY d1..dn fills the last n + 1 tokens [T - n, T]
    answer_mask True exactly at t in [T - n, T - 1] (targets: the n answer digits)

    With `queries` = Q > 1 (a denser task: Q keys asked a sequence instead of one) the sequence
    is cut into Q segments [s_j, e_j], e_j = (j + 1) T // Q and s_j = e_{j-1} + 1 (s_0 = 0), each
    one passkey problem of its own: its own digits, its needle at
    s_j + round(depth_j * (e_j - s_j - 2n - 1)) (depth -1: a depth per segment), QUERY d1 .. dn
    in its last n + 1 tokens [e_j - n, e_j]; answer_mask is True at the n digits of every query.
    The state must recall the latest key over the earlier ones: Q answers a sequence, each from
    up to T / Q tokens back, with Q times the keys a step trains on (a tiny model trained from
    scratch on one key per long sequence sees too few keys to leave chance). Q = 1 is the layout
    above, drawn from the same random numbers.

Both validate their parameters and raise `TaskError` (a ValueError) naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# passkey token ids
PASSKEY_KEY = 1
PASSKEY_QUERY = 2
PASSKEY_DIGIT0 = 3
PASSKEY_FILLER0 = PASSKEY_DIGIT0 + 10

MQAR_FILLER = 0


class TaskError(ValueError):
    """Invalid task parameters; the message names the field."""


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TaskError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise TaskError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _rng(seed: int | Sequence[int]) -> np.random.Generator:
    seeds = [seed] if isinstance(seed, int | np.integer) else list(seed)
    if not seeds or any(isinstance(s, bool) or int(s) < 0 for s in seeds):
        raise TaskError(f"seed must be a non-negative int or a sequence of them, got {seed!r}")
    return np.random.default_rng([int(s) for s in seeds])


def mqar_gap_probs(space: int, power_a: float) -> np.ndarray:
    """P(gap = g) for g in [0, space): proportional to (g + 1) ** (power_a - 1)."""
    p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    return p / p.sum()


def mqar(
    batch_size: int,
    seq_len: int,
    num_pairs: int,
    vocab_size: int,
    seed: int | Sequence[int],
    power_a: float = 0.01,
) -> tuple[np.ndarray, np.ndarray]:
    """MQAR batch: (tokens [B, T + 1] int32, answer_mask [B, T] bool); layout in the module doc."""
    B = _check_int("batch_size", batch_size, 1)
    T = _check_int("seq_len", seq_len, 4)
    P = _check_int("num_pairs", num_pairs, 1)
    V = _check_int("vocab_size", vocab_size, 4)
    if 4 * P > T:
        raise TaskError(f"num_pairs must satisfy 4 * num_pairs <= seq_len ({T}), got {P}")
    n_keys = V // 2 - 1  # keys [1, V // 2), values [V // 2, V)
    if P > n_keys:
        raise TaskError(
            f"num_pairs ({P}) exceeds the {n_keys} keys of vocab_size {V}: vocab_size must be "
            f">= {2 * (P + 1)}"
        )
    if not (isinstance(power_a, int | float) and 0 < power_a <= 1):
        raise TaskError(f"power_a must lie in (0, 1], got {power_a!r}")
    rng = _rng(seed)
    space = (T - 2 * P) // 2  # query slots: positions 2P + 2g, g < space
    probs = mqar_gap_probs(space, float(power_a))
    tokens = np.full((B, T + 1), MQAR_FILLER, np.int32)
    mask = np.zeros((B, T), bool)
    for b in range(B):
        keys = rng.choice(np.arange(1, V // 2), size=P, replace=False)
        values = rng.choice(np.arange(V // 2, V), size=P, replace=False)
        tokens[b, 0 : 2 * P : 2] = keys
        tokens[b, 1 : 2 * P : 2] = values
        gaps = rng.choice(space, size=P, replace=False, p=probs)  # query j asks keys[j]
        pos = 2 * P + 2 * gaps
        tokens[b, pos] = keys
        tokens[b, pos + 1] = values
        mask[b, pos] = True
    return tokens, mask


def passkey(
    batch_size: int,
    seq_len: int,
    depth: float,
    vocab_size: int,
    seed: int | Sequence[int],
    num_digits: int = 5,
    queries: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Passkey batch: (tokens [B, T + 1] int32, answer_mask [B, T] bool); layout in the module
    doc. `depth` in [0, 1]: where the needle sits in the filler (0 start, 1 end); -1: every
    sequence (each segment) draws its own depth uniformly from [0, 1] (to train on all depths).
    `queries`: how many keys a sequence asks, one per segment, each at its segment's end."""
    B = _check_int("batch_size", batch_size, 1)
    T = _check_int("seq_len", seq_len, 2)
    n = _check_int("num_digits", num_digits, 1)
    Q = _check_int("queries", queries, 1)
    V = _check_int("vocab_size", vocab_size, PASSKEY_FILLER0 + 1)
    if (
        not (isinstance(depth, int | float) and not isinstance(depth, bool) and 0 <= depth <= 1)
        and depth != -1
    ):
        raise TaskError(f"depth must lie in [0, 1] (or be -1: random per sequence), got {depth!r}")
    ends = np.array([(j + 1) * T // Q for j in range(Q)])  # e_j: each query's last token
    starts = np.concatenate([[0], ends[:-1] + 1])  # s_j: each segment's first token
    if (ends - starts).min() < 2 * n + 1:
        raise TaskError(
            f"seq_len {T} with queries={Q} leaves segments of {(ends - starts).min() + 1} tokens; "
            f"each needs 2 * num_digits + 2 = {2 * n + 2} (its needle and its query)"
        )
    rng = _rng(seed)
    tokens = rng.integers(PASSKEY_FILLER0, V, size=(B, T + 1), dtype=np.int32)
    digits = rng.integers(0, 10, size=(B, Q, n)).astype(np.int32) + PASSKEY_DIGIT0
    depths = rng.uniform(0.0, 1.0, size=(B, Q)) if depth == -1 else np.full((B, Q), depth)
    room = ends - starts - 2 * n - 1  # [Q]: the needle's positions in a segment, less one
    needles = starts + np.rint(depths * room).astype(int)  # [B, Q]: each needle's KEY token
    rows = np.arange(B)[:, None, None]  # [B, 1, 1]
    key_and_digits = np.concatenate([np.full((B, Q, 1), PASSKEY_KEY, np.int32), digits], 2)
    tokens[rows, needles[..., None] + np.arange(n + 1)] = key_and_digits  # KEY d1 .. dn
    tokens[:, ends - n] = PASSKEY_QUERY  # QUERY d1 .. dn in [e_j - n, e_j]
    tokens[rows, (ends - n + 1)[:, None] + np.arange(n)] = digits
    mask = np.zeros((B, T), bool)  # the targets of [e_j - n, e_j - 1] are the digits
    mask[:, ((ends - n)[:, None] + np.arange(n)).ravel()] = True
    return tokens, mask


def passkey_position(seq_len: int, depth: float, num_digits: int = 5) -> int:
    """Where the needle's KEY token sits: round(depth * (seq_len - 2 * num_digits - 1))."""
    return int(round(depth * (seq_len - 2 * num_digits - 1)))


# ---- tasks as a data source of train.main ----------------------------------------------------

# name -> (generator, its parameters a `--task NAME:key=value,...` may set, with types)
TASKS = {
    "mqar": (mqar, {"num_pairs": int, "vocab_size": int, "power_a": float}),
    "passkey": (passkey, {"depth": float, "vocab_size": int, "num_digits": int, "queries": int}),
}
TASK_DEFAULTS = {"mqar": {"num_pairs": 4}, "passkey": {"depth": 0.5}}


def parse_task(spec: str, model_vocab: int) -> tuple[str, dict]:
    """`--task NAME[:key=value,...]` -> (name, parameters). seq_len is the model's; vocab_size
    defaults to the model's and may not exceed it."""
    name, _, rest = spec.partition(":")
    if name not in TASKS:
        raise TaskError(f"--task: unknown task {name!r} (known: {', '.join(TASKS)})")
    allowed = TASKS[name][1]
    params: dict = {**TASK_DEFAULTS[name], "vocab_size": model_vocab}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in allowed:
            raise TaskError(
                f"--task {name}: expected key=value with key in {', '.join(allowed)}, got {part!r}"
            )
        try:
            params[key] = allowed[key](value)
        except ValueError as e:
            raise TaskError(
                f"--task {name}: {key} must be {allowed[key].__name__}, got {value!r}"
            ) from e
    if params["vocab_size"] > model_vocab:
        raise TaskError(
            f"--task {name}: vocab_size {params['vocab_size']} exceeds the model's {model_vocab}"
        )
    return name, params


def generate(name: str, params: dict, batch_size: int, seq_len: int, seed) -> tuple:
    """One batch of task `name` (tokens, answer_mask)."""
    return TASKS[name][0](batch_size, seq_len, seed=seed, **params)


class TaskBatches:
    """Global-step batches of a task for this process: `next()` gives (tokens [A, m, T + 1],
    answer_mask [A, m, T]), freshly generated from seed (seed, step, process): a resumed run
    (`set_state`) continues the same sequence of batches."""

    def __init__(self, name, params, seq_len, local_batch, accum_steps, seed, process_index=0):
        self.name, self.params = name, dict(params)
        self.seq_len, self.local_batch, self.accum_steps = seq_len, local_batch, accum_steps
        self.seed, self.process_index = seed, process_index
        self.step = 0
        generate(name, self.params, 1, seq_len, 0)  # validate the parameters now

    def __iter__(self):
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        seed = (self.seed, self.step, self.process_index)
        tokens, mask = generate(self.name, self.params, self.local_batch, self.seq_len, seed)
        self.step += 1
        A = self.accum_steps
        return tokens.reshape(A, -1, tokens.shape[-1]), mask.reshape(A, -1, mask.shape[-1])

    def get_state(self) -> dict:
        return {"task": self.name, "params": self.params, "step": self.step}

    def set_state(self, state: dict) -> None:
        if state.get("task") != self.name or state.get("params") != self.params:
            raise TaskError(
                f"the checkpoint's data is {state.get('task', 'token shards')} "
                f"{state.get('params', '')}, not task {self.name} {self.params}"
            )
        self.step = int(state["step"])
