"""The tokenizer a corpus is prepared with: a `tokenizer.json`, a local Hugging Face tokenizer
folder, or a byte-level BPE trained on the corpus; and the token its documents are separated by.

A folder must hold a `tokenizer.json` (every current Hugging Face tokenizer has one: Llama 3,
Qwen 2/3, Gemma, Mistral, GPT-2). Its companion files (`tokenizer_config.json`,
`special_tokens_map.json`, ...: laplace_spec/tokenizer_files.py) are copied beside the shards with
it, so the run and the export carry the tokenizer whole. The end-of-text token is found by the rule
the exporter uses (laplace_spec/tokenizer_files.py), unless named.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from laplace_spec.tokenizer_files import TOKENIZER_FILES, end_of_text, folder_config

TRAINED_EOT = "<|endoftext|>"  # the trained BPE's one special token (GPT-2's)


def train_bpe(documents: Iterable[str], vocab_size: int, show_progress: bool = True):
    """A byte-level BPE (GPT-2 style pre-tokenisation) with TRAINED_EOT as its only special
    token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size % 64 or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive multiple of 64: {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[TRAINED_EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return tok


def tokenizer_folder(path: str | Path) -> tuple[Path, Path]:
    """(the tokenizer.json, the folder of its companion files) of a `tokenizer.json` path or a
    tokenizer folder; ValueError naming what is missing."""
    path = Path(path)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            has = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
            raise ValueError(
                f"{path}: a tokenizer folder needs a tokenizer.json (it has: {has}); "
                "`AutoTokenizer.from_pretrained(path).save_pretrained(path)` writes one"
            )
        return path / "tokenizer.json", path
    if not path.is_file():
        raise ValueError(f"{path}: no such tokenizer file or folder")
    return path, path.parent


def load_tokenizer(path: str | Path):
    """The `tokenizers.Tokenizer` of a tokenizer.json path or a tokenizer folder."""
    from tokenizers import Tokenizer

    json_path, _ = tokenizer_folder(path)
    try:
        return Tokenizer.from_file(str(json_path))
    except Exception as e:  # tokenizers raises its own Exception for a malformed file
        raise ValueError(f"{json_path}: not a Hugging Face tokenizer.json: {e}") from e


def copy_companions(source: str | Path, out_dir: Path) -> None:
    """Copy the companion files (tokenizer_config.json, ...) of `source`'s folder (a
    tokenizer.json or a tokenizer folder) into `out_dir`, beside the tokenizer.json there."""
    json_path, folder = tokenizer_folder(source)
    if json_path.name != "tokenizer.json" or folder.resolve() == Path(out_dir).resolve():
        return  # a renamed file's folder is not its own; a folder is its own companion
    for name in TOKENIZER_FILES[1:]:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, Path(out_dir) / name)


def document_separator(tokenizer, source: str | Path | None, token: str | None) -> tuple[str, int]:
    """(token, id) every document is preceded by: `token` if named, else the end-of-text rule of
    laplace_spec/tokenizer_files.py on the tokenizer (and its folder's tokenizer_config.json)."""
    import json

    if token is not None:
        i = tokenizer.token_to_id(token)
        if i is None:
            raise ValueError(f"the tokenizer has no token {token!r} (--eot-token)")
        return token, i
    config = folder_config(tokenizer_folder(source)[1]) if source is not None else None
    found = end_of_text(json.loads(tokenizer.to_str()), config)
    if found is None:
        raise ValueError(
            "the tokenizer has no end-of-text token (tokenizer_config.json's eos_token, or one of "
            "<|endoftext|>, <|end_of_text|>, </s>, <eos>): name one with --eot-token"
        )
    return found
