"""The tokenizer's files a model carries, and which of its tokens ends a document.

One rule for both sides: `train.prepare` writes the end-of-text id it separates documents with into
the shards' `meta.json` (so `doc_reset=auto` resets the state there), and the exporter writes the
same token as `eos_token` / `eos_token_id` (so generation stops there). The rule:

1. `tokenizer_config.json`'s `eos_token`, when the tokenizer has it (Llama 3: `<|end_of_text|>`;
   an instruction-tuned tokenizer names its end of turn here);
2. else the first of END_OF_TEXT_TOKENS that the tokenizer has: GPT-2's, Qwen's and the byte-level
   BPE `train.prepare` trains (`<|endoftext|>`), Llama 3's (`<|end_of_text|>`), Llama 2's and
   Mistral's (`</s>`), Gemma's (`<eos>`).

Plain JSON, no tokenizer library: any side can read it.
"""

from __future__ import annotations

import json
from pathlib import Path

# The files of a Hugging Face tokenizer folder that a run directory and an export carry along.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",  # transformers' and vLLM's chat template, beside the tokenizer
)
END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


def token_ids(tokenizer_json: dict) -> dict[str, int]:
    """Every token of a `tokenizer.json` with its id: the model's vocabulary and the added
    (special) tokens."""
    vocab = (tokenizer_json.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the position
        ids = {piece: i for i, (piece, _score) in enumerate(vocab)}
    else:  # BPE, WordPiece, WordLevel: {token: id}
        ids = dict(vocab)
    ids.update({t["content"]: t["id"] for t in tokenizer_json.get("added_tokens", [])})
    return ids


def configured_eos(tokenizer_config: dict | None) -> str | None:
    """`tokenizer_config.json`'s `eos_token` (a string, or an AddedToken dict), if any."""
    eos = (tokenizer_config or {}).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def end_of_text(tokenizer_json: dict, tokenizer_config: dict | None = None):
    """(token, id) that ends a document by the rule above, or None when the tokenizer has none
    of them."""
    ids = token_ids(tokenizer_json)
    eos = configured_eos(tokenizer_config)
    for token in ((eos,) if eos else ()) + END_OF_TEXT_TOKENS:
        if token in ids:
            return token, ids[token]
    return None


def folder_config(folder: str | Path) -> dict | None:
    """`folder`'s tokenizer_config.json, or None where it has none."""
    path = Path(folder) / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def folder_end_of_text(folder: str | Path):
    """`end_of_text` of the tokenizer files in `folder` (tokenizer.json, and tokenizer_config.json
    where present)."""
    tokenizer_json = json.loads((Path(folder) / "tokenizer.json").read_text())
    return end_of_text(tokenizer_json, folder_config(folder))
