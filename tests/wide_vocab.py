"""A tokenizer of more than 65,536 ids, built here with `tokenizers` (no installed package ships
one, and tiktoken downloads its files), as a local Hugging Face tokenizer folder: a word-level
vocabulary of VOCAB ids whose real words and end-of-text token all sit past 65,535, so every token
of its text needs a uint32 shard. tests/test_data.py uses it, and runs it from end to end
(`commands`: the background queue's wide-vocabulary run).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

VOCAB = 150_000  # Qwen-sized; the model pads it to 150,016
EOS = "<|end_of_text|>"  # Llama 3's name: found through tokenizer_config.json's eos_token
WORDS = (
    "the a quick brown fox jumps over lazy dog while seven small birds sing in old green trees "
    "and one cat sleeps under warm sun"
).split()
FIRST_WORD_ID = 100_000  # the words' ids: 100,000 ...; the end-of-text token's: VOCAB - 1


def write(folder: Path) -> Path:
    """tokenizer.json and tokenizer_config.json (eos_token EOS) in `folder`; returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0}
    vocab.update({f"[filler{i}]": i for i in range(1, FIRST_WORD_ID)})
    vocab.update({w: FIRST_WORD_ID + i for i, w in enumerate(WORDS)})
    vocab.update({f"[filler{i}]": i for i in range(FIRST_WORD_ID + len(WORDS), VOCAB - 1)})
    vocab[EOS] = VOCAB - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([EOS])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert tok.get_vocab_size() == VOCAB
    return folder


def documents(n: int, seed: int = 0) -> list[str]:
    """`n` documents of 5 to 40 words."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(5, 41)))) for _ in range(n)]


# ---- the wide-vocabulary run: prepare -> train -> export -> vLLM ------------------------------

N_NEW = 24  # greedy tokens per prompt
STEPS = 2


def prompts() -> list[list[int]]:
    """Three prompts of this tokenizer's ids (all past 65,535), written without it."""
    ids = {w: FIRST_WORD_ID + i for i, w in enumerate(WORDS)}
    return [[ids[w] for w in d.split()] for d in documents(3, seed=7)]


def commands(root: Path, env: dict) -> list[tuple[list[str], dict]]:
    """The background queue's commands (tests/background.py): the tokenizer folder and a
    gzip-compressed JSON-lines corpus, `train.prepare` -> `train.main` (`tiny` at vocab_size
    150,016) -> `export.main` -> vLLM's greedy tokens (tests/compiled_engines.py, eager)."""
    import compiled_engines

    here = Path(__file__).resolve()
    py = sys.executable
    train = [
        py, "-m", "train.main", "--config", "tiny", "vocab_size=150016", "--data",
        str(root / "shards" / "train_*.bin"), "--run-dir", str(root / "run"), "--mesh", "fsdp=1",
        "--steps", str(STEPS), "--no-progress", "global_batch_tokens=256", f"ckpt_every={STEPS}",
        "eval_every=0", "sample_tokens=0",
    ]  # fmt: skip
    spec = compiled_engines.spec(root / "export", [prompts()], compile=False)
    return [
        ([py, str(here), str(root)], env),
        (
            [
                py,
                "-m",
                "train.prepare",
                str(root / "corpus.jsonl.gz"),
                "--out",
                str(root / "shards"),
                "--tokenizer",
                str(root / "tokenizer"),
            ],
            env,
        ),  # fmt: skip
        (train, env),
        (
            [
                py,
                "-m",
                "export.main",
                "--checkpoint",
                str(root / "run" / "checkpoints"),
                "--out",
                str(root / "export"),
            ],
            env,
        ),  # fmt: skip
        compiled_engines.command({**spec, "n_new": N_NEW}, root / "vllm.json", env),
    ]


def main(root: str) -> None:
    """ROOT/tokenizer/ and ROOT/corpus.jsonl.gz (300 documents)."""
    import gzip

    write(Path(root) / "tokenizer")
    rows = "".join(json.dumps({"text": d}) + "\n" for d in documents(300))
    (Path(root) / "corpus.jsonl.gz").write_bytes(gzip.compress(rows.encode()))


if __name__ == "__main__":
    main(sys.argv[1])
