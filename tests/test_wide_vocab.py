"""A vocabulary past 65,536 ids from end to end: a 150,000-id Hugging Face tokenizer folder built
here (tests/wide_vocab.py), a gzip-compressed JSON-lines corpus, `train.prepare` -> `train.main`
(`tiny` at vocab_size 150,016) -> `export.main` -> vLLM, each the real command in a subprocess of
the background queue. Before, prepare refused any tokenizer past 65,536 ids (uint16 shards), and a
`.jsonl.gz` was tokenised as its compressed bytes."""

from __future__ import annotations

import json

import wide_vocab

from train.shards import UINT32, load_tokens, read_header


def test_a_150000_id_vocabulary_prepares_trains_exports_and_serves(wide_vocab_run):
    from serve.generation import greedy_generate
    from serve.modeling_laplace import LaplaceForCausalLM

    root = wide_vocab_run
    meta = json.loads((root / "shards" / "meta.json").read_text())
    assert (meta["vocab_size"], meta["token_width"]) == (wide_vocab.VOCAB, "uint32")
    assert meta["train_docs"] + meta["val_docs"] == 300  # the gzip file's rows, not one blob
    shards = sorted((root / "shards").glob("train_*.bin"))
    assert all(read_header(p).width is UINT32 for p in shards)
    tokens = load_tokens(shards[0])
    assert tokens.min() >= 65_536  # every word and the end-of-text token sit past 65,535
    assert tokens[0] == meta["eot_id"] == wide_vocab.VOCAB - 1  # tokenizer_config's eos_token

    run = json.loads((root / "run" / "config.json").read_text())
    assert run["model"]["vocab_size"] == 150_016
    export = root / "export"
    config = json.loads((export / "config.json").read_text())
    assert (config["vocab_size"], config["eos_token_id"]) == (150_016, meta["eot_id"])

    model = LaplaceForCausalLM.from_exported(export)
    prompts = wide_vocab.prompts()
    want = [greedy_generate(model, [p], wide_vocab.N_NEW)[0] for p in prompts]
    got = json.loads((root / "vllm.json").read_text())
    assert got["enforce_eager"] is True
    assert got["calls"][0] == want
    assert max(max(w) for w in want) >= 65_536  # the head's wide rows are what it predicts
