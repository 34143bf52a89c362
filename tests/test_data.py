"""Token shards, the grain pipeline and `train.prepare`."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from train import data, shards
from train.prepare import prepare
from train.tokenizer_source import TRAINED_EOT as EOT


def _shard(path, tokens):
    shards.write_shard(path, np.asarray(tokens))
    return str(path)


def test_shard_roundtrip_and_header(tmp_path):
    tokens = np.arange(1000) % 65_536
    path = _shard(tmp_path / "a.bin", tokens)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert header[:3].tolist() == [20240520, 1, 1000]
    assert (tmp_path / "a.bin").stat().st_size == 1024 + 2 * 1000
    np.testing.assert_array_equal(shards.load_tokens(path), tokens)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda h, b: (h.__setitem__(0, 1234), b)[1], "bad magic"),
        (lambda h, b: (h.__setitem__(1, 2), b)[1], "unsupported version"),
        (lambda h, b: b[:-2], "file has"),  # truncated: count disagrees with size
        (lambda h, b: b + b"\0\0", "file has"),  # trailing bytes
    ],
)
def test_shard_validation_names_file(tmp_path, corrupt, message):
    header = np.zeros(256, "<i4")
    header[:3] = [20240520, 1, 10]
    body = np.arange(10, dtype="<u2").tobytes()
    body = corrupt(header, body)
    path = tmp_path / "broken_shard.bin"
    path.write_bytes(header.tobytes() + body)
    with pytest.raises(shards.ShardError, match=message) as e:
        data.TokenWindows([str(path)], 4)
    assert "broken_shard.bin" in str(e.value)


def test_short_file_and_missing_glob(tmp_path):
    (tmp_path / "short.bin").write_bytes(b"\0" * 100)
    with pytest.raises(shards.ShardError, match="short.bin.*shorter than"):
        shards.read_header(tmp_path / "short.bin")
    with pytest.raises(shards.ShardError, match="no token shards match"):
        shards.expand_shards(str(tmp_path / "nothing_*.bin"))


def test_windows_follow_the_stream_and_stop_at_shard_ends(tmp_path):
    a = _shard(tmp_path / "a.bin", np.arange(0, 23))  # (23 - 1) // 5 = 4 windows
    b = _shard(tmp_path / "b.bin", np.arange(100, 111))  # 2 windows
    src = data.TokenWindows([a, b], seq_len=5)
    assert len(src) == 6
    np.testing.assert_array_equal(src[0], np.arange(0, 6))
    np.testing.assert_array_equal(src[3], np.arange(15, 21))
    np.testing.assert_array_equal(src[4], np.arange(100, 106))
    np.testing.assert_array_equal(src[5], np.arange(105, 111))
    assert src[0].dtype == np.int32


def test_shuffle_covers_each_epoch_and_splits_by_process(tmp_path):
    src = data.TokenWindows([_shard(tmp_path / "a.bin", np.arange(4 * 24 + 1))], seq_len=4)
    assert len(src) == 24
    first = lambda w: int(w[0]) // 4  # noqa: E731 - window index from its first token
    ds = data.train_dataset(src, batch_size=4, seed=1)
    epoch1 = sorted(first(w) for i in range(6) for w in ds[i])
    epoch2 = [first(w) for i in range(6, 12) for w in ds[i]]
    assert epoch1 == list(range(24))
    assert sorted(epoch2) == list(range(24))
    assert [first(w) for i in range(6) for w in ds[i]] != epoch2  # reshuffled
    assert ds[0].tolist() != data.train_dataset(src, 4, seed=2)[0].tolist()
    p0 = {first(w) for i in range(3) for w in data.train_dataset(src, 4, 7, 0, 2)[i]}
    p1 = {first(w) for i in range(3) for w in data.train_dataset(src, 4, 7, 1, 2)[i]}
    assert p0.isdisjoint(p1) and len(p0 | p1) == 24


def test_iterator_state_resumes_on_the_next_batch(tmp_path):
    src = data.TokenWindows([_shard(tmp_path / "a.bin", np.arange(1000))], seq_len=8)
    it = data.BatchIterator(data.train_dataset(src, 4, seed=0), accum_steps=2)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # survives the JSON checkpoint item
    expected = [next(it) for _ in range(3)]
    again = data.BatchIterator(data.train_dataset(src, 4, seed=0), accum_steps=2)
    again.set_state(state)
    for e in expected:
        got = next(again)
        assert got.shape == (2, 2, 9)
        np.testing.assert_array_equal(got, e)


def test_prepare_text_jsonl_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    docs = [f"def f{i}(x):\n    return x * {i}  # doc {i}\n" for i in range(30)]
    (tmp_path / "a.txt").write_text(docs[0])
    with open(tmp_path / "b.jsonl", "w") as f:
        for d in docs[1:20]:
            f.write(json.dumps({"text": d}) + "\n")
    pq.write_table(pa.table({"text": docs[20:]}), tmp_path / "c.parquet")
    inputs = [str(tmp_path / n) for n in ("a.txt", "b.jsonl", "c.parquet")]
    out = tmp_path / "out"
    meta = prepare(inputs, out, vocab_size=320, val_every=10, shard_tokens=200, progress=False)
    assert meta["train_docs"] == 27 and meta["val_docs"] == 3
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() <= 320
    train = np.concatenate([shards.load_tokens(p) for p in sorted(out.glob("train_*.bin"))])
    val = np.concatenate([shards.load_tokens(p) for p in sorted(out.glob("val_*.bin"))])
    assert len(list(out.glob("train_*.bin"))) > 1  # split into shards of 200 tokens
    eot = tok.token_to_id(EOT)
    assert meta["eot_id"] == eot

    # decoding the shards gives back the documents, each after an end-of-text token
    def split(toks):
        return [tok.decode(p.tolist()) for p in np.split(toks, np.where(toks == eot)[0])[1:]]

    val_idx = {9, 19, 29}
    assert split(train) == [d for i, d in enumerate(docs) if i not in val_idx]
    assert split(val) == [docs[i] for i in sorted(val_idx)]


def test_stdlib_corpus_is_tens_of_megabytes():
    import os

    from train.corpus import stdlib_files

    files = stdlib_files()
    assert len(files) > 500
    assert sum(os.path.getsize(f) for f in files) > 10e6


def test_prepare_keeps_long_documents_and_reports_their_lengths(tmp_path):
    """`--min-doc-tokens`: a document shorter than N tokens (its end-of-text not counted) is
    dropped; meta.json's length summary is that of the documents in the shards."""
    from tokenizers import Tokenizer

    from train.doc_context import length_summary

    docs = [" ".join(f"w{j % 7}" for j in range(n)) for n in (3, 40, 5, 120, 60, 2, 90, 200)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "out"
    meta = prepare(
        [str(tmp_path / "d.jsonl")], out, vocab_size=320, val_every=0, progress=False,
        min_doc_tokens=30,
    )  # fmt: skip
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    sizes = [len(tok.encode(d).ids) for d in docs]
    assert meta["dropped_docs"] == sum(n < 30 for n in sizes) > 0
    stream = np.concatenate([shards.load_tokens(p) for p in sorted(out.glob("train_*.bin"))])
    kept = [len(p) - 1 for p in np.split(stream, np.where(stream == meta["eot_id"])[0])[1:]]
    assert kept == [n for n in sizes if n >= 30]
    assert meta["doc_tokens"]["train"] == length_summary(kept)
    assert meta["doc_tokens"]["train"]["max"] == max(kept)
    with pytest.raises(ValueError, match="min_doc_tokens"):
        prepare([str(tmp_path / "d.jsonl")], tmp_path / "x", vocab_size=320, min_doc_tokens=-1)


def test_same_document_context_counts_the_tokens_since_the_last_reset():
    """Against a plain loop: the state is zeroed at the token after each end-of-text."""
    from train.doc_context import same_document_context

    rng = np.random.default_rng(0)
    window = rng.integers(0, 6, 301)  # end-of-text id 0, often back to back
    got = same_document_context(window, 0)
    want, n = [], 0
    for t in range(300):
        n = 1 if t > 0 and window[t - 1] == 0 else n + 1
        want.append(n)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(same_document_context(window, None), np.arange(1, 301))


def test_context_shares_and_the_short_document_warning(tmp_path):
    """Documents of 600, 1,500 and 20,000 tokens in windows of 4,096: the share of targets with
    >= 1k tokens of same-document context equals the count over every window (all sampled); with
    a context axis of 4 (slices of 1,024) the 600-token documents warn (no target has a slice's
    length of context), the others do not (32% and most)."""
    from train import doc_context

    eot = 1
    for doc_len, warns in ((600, True), (1500, False), (20_000, False)):
        doc = np.concatenate([[eot], np.full(doc_len, 5)])
        shards.write_shard(tmp_path / f"d{doc_len}.bin", np.tile(doc, 4 * 4097 // doc.size + 2))
        src = data.TokenWindows([str(tmp_path / f"d{doc_len}.bin")], 4096)
        assert len(src) <= 64  # every window is sampled
        shares = doc_context.context_shares(src, eot, context=4)
        ctx = np.concatenate(
            [doc_context.same_document_context(src[i], eot) for i in range(len(src))]
        )
        assert shares["share_ge_1k"] == round(float((ctx >= 1024).mean()), 4)
        assert shares["share_ge_8k"] == 0.0  # no window holds 8k tokens of a document
        warning = doc_context.short_documents_warning(shares)
        assert (warning is not None) == warns, (doc_len, shares)


# ---- token widths ---------------------------------------------------------------------------


def test_uint16_shards_are_the_nanogpt_format_bit_for_bit(tmp_path):
    """A shard written as nanoGPT / llm.c write GPT-2 shards (header, then uint16 tokens) loads
    as it is, and the writer writes exactly those bytes."""
    tokens = np.random.default_rng(0).integers(0, 65_536, 5_000)
    header = np.zeros(256, np.int32)
    header[:3] = [20240520, 1, tokens.size]
    theirs = tmp_path / "fineweb_train_000001.bin"
    theirs.write_bytes(header.tobytes() + tokens.astype(np.uint16).tobytes())
    np.testing.assert_array_equal(shards.load_tokens(theirs), tokens)
    assert shards.read_header(theirs).width is shards.UINT16
    shards.write_shard(tmp_path / "ours.bin", tokens)
    assert (tmp_path / "ours.bin").read_bytes() == theirs.read_bytes()


def test_uint32_shards_hold_ids_past_65535(tmp_path):
    """llm.c's Llama 3 format: magic 20240801, version 7, uint32 tokens."""
    tokens = np.array([0, 65_535, 65_536, 128_255, 151_645, 262_143])
    shards.write_shard(tmp_path / "wide.bin", tokens, shards.UINT32)
    header = np.fromfile(tmp_path / "wide.bin", dtype="<i4", count=256)
    assert header[:3].tolist() == [20240801, 7, tokens.size]
    assert (tmp_path / "wide.bin").stat().st_size == 1024 + 4 * tokens.size
    np.testing.assert_array_equal(shards.load_tokens(tmp_path / "wide.bin"), tokens)
    with pytest.raises(shards.ShardError, match="must lie in \\[0, 65535\\] to fit uint16"):
        shards.write_shard(tmp_path / "narrow.bin", tokens)
    src = data.TokenWindows([str(tmp_path / "wide.bin")], seq_len=5)
    np.testing.assert_array_equal(src[0], tokens)
    assert src.width is shards.UINT32


def test_a_set_that_mixes_widths_is_refused(tmp_path):
    narrow, wide = _shard(tmp_path / "a.bin", np.arange(50)), str(tmp_path / "b.bin")
    shards.write_shard(wide, np.arange(50), shards.UINT32)
    with pytest.raises(shards.ShardError, match="mix token widths") as e:
        data.TokenWindows([narrow, wide], 4)
    assert f"{narrow} is uint16" in str(e.value) and f"{wide} is uint32" in str(e.value)


def test_the_writer_streams_shards_of_the_given_size(tmp_path):
    writer = shards.ShardWriter(tmp_path, "train", 7, shards.UINT32)
    for n in (3, 10, 1, 0, 5):
        writer.add(np.arange(n) + 70_000)
    writer.close()
    counts = [shards.read_header(p).count for p in writer.paths]
    assert counts == [7, 7, 5] and writer.total == 19
    stream = np.concatenate([shards.load_tokens(p) for p in writer.paths])
    np.testing.assert_array_equal(
        stream, np.concatenate([np.arange(n) for n in (3, 10, 1, 5)]) + 70_000
    )
    assert not list(tmp_path.glob("*.tmp"))


# ---- the formats corpora come in ------------------------------------------------------------


def _decoded(out, tok, eot):
    """The documents of a prepared folder's train shards, decoded."""
    stream = np.concatenate([shards.load_tokens(p) for p in sorted(out.glob("train_*.bin"))])
    return [tok.decode(p[1:].tolist()) for p in np.split(stream, np.where(stream == eot)[0])[1:]]


def test_prepare_reads_compressed_json_lines_text_arrow_and_saved_datasets(tmp_path):
    """Each format's documents come back from the shards, in input order: gzip- and
    zstd-compressed JSON lines and text, an Arrow file, a saved Dataset and a saved DatasetDict's
    split; the compressed files made by gzip and the zstd command, as users make them. (A
    gzip-compressed JSON-lines file was tokenised as one document of its compressed bytes
    before.)"""
    import gzip

    import datasets
    import pyarrow as pa
    from tokenizers import Tokenizer

    docs = [f"def f{i}(x):\n    return x * {i}  # doc {i}\n" for i in range(60)]
    lines = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[:20]))
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[20:30]))
    subprocess.run(["zstd", "-q", "--rm", str(tmp_path / "b.jsonl")], check=True)  # b.jsonl.zst
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(docs[30].encode()))
    datasets.Dataset.from_dict({"text": docs[31:40]}).save_to_disk(tmp_path / "d")
    arrow = next((tmp_path / "d").glob("*.arrow"))
    arrow.rename(tmp_path / "d.arrow")  # an Arrow file on its own (the IPC stream format)
    table = pa.table({"n": list(range(5)), "text": docs[40:45]})
    with pa.ipc.new_file(tmp_path / "d2.arrow", table.schema) as writer:  # the IPC file format
        writer.write_table(table)
    datasets.Dataset.from_dict({"text": docs[45:50]}).save_to_disk(tmp_path / "e")
    splits = {"train": docs[50:], "test": ["not this split"]}
    datasets.DatasetDict(
        {k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}
    ).save_to_disk(tmp_path / "f")
    inputs = [
        str(tmp_path / n)
        for n in ("a.jsonl.gz", "b.jsonl.zst", "c.txt.gz", "d.arrow", "d2.arrow", "e", "f")
    ]
    out = tmp_path / "out"
    meta = prepare(inputs, out, vocab_size=320, val_every=0, shard_tokens=500, progress=False)
    assert meta["train_docs"] == 60 and meta["token_width"] == "uint16"
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert _decoded(out, tok, meta["eot_id"]) == docs


def test_a_folder_of_inputs_is_searched_for_every_format(tmp_path):
    from train.documents import expand_inputs

    (tmp_path / "sub").mkdir()
    for name in ("a.txt", "b.jsonl.gz", "sub/c.parquet", "sub/d.md.zst", "notes.json", "x.bin"):
        (tmp_path / name).write_bytes(b"")
    import datasets

    datasets.Dataset.from_dict({"text": ["a"]}).save_to_disk(tmp_path / "sub" / "saved")
    found = [Path(p).relative_to(tmp_path).as_posix() for p in expand_inputs([str(tmp_path)])]
    assert found == ["a.txt", "b.jsonl.gz", "sub/c.parquet", "sub/d.md.zst", "sub/saved"]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("gz_in_disguise.jsonl", "gzip", "cannot be read as json"),  # compressed, not named so
        ("binary.txt", "gzip", "cannot be read as text: UnicodeDecodeError"),
        ("truncated.jsonl.gz", "truncated", "cannot be read as json"),
        ("no_text.jsonl", '{"content": "x"}\n', "no row of its 1 has a 'text' field"),
        ("number.jsonl", '{"text": 5}\n', "changed from string to number"),
        ("table.csv", "a,b\n", "unknown corpus format"),
    ],
)
def test_an_unreadable_input_is_an_error_naming_it_and_leaves_no_shard(
    tmp_path, name, content, message
):
    import gzip

    rows = "".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(2_000)).encode()
    raw = {"gzip": gzip.compress(rows), "truncated": gzip.compress(rows)[:-100]}
    bad = tmp_path / name
    bad.write_bytes(raw.get(content) or content.encode())
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"good {i}"}) + "\n" for i in range(300)))
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=message) as e:
        prepare([str(good), str(bad)], out, vocab_size=320, shard_tokens=50, progress=False)
    assert str(bad) in str(e.value)
    assert not list(out.glob("*.bin*")) and not (out / "meta.json").exists()


def test_prepare_with_a_wide_tokenizer_folder(tmp_path):
    """A local Hugging Face tokenizer folder of 150,000 ids: uint32 shards holding ids past
    65,535, the end-of-text id from its tokenizer_config.json (the rule the exporter applies: the
    export names the same id), its files carried beside the shards. Before, prepare refused any
    tokenizer past 65,536 ids."""
    import wide_vocab

    from export.exporter import copy_tokenizer

    folder = wide_vocab.write(tmp_path / "tok")
    docs = wide_vocab.documents(40)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "out"
    meta = prepare([str(tmp_path / "d.jsonl")], out, str(folder), val_every=0, progress=False)
    assert meta["token_width"] == "uint32" and meta["vocab_size"] == wide_vocab.VOCAB
    assert (meta["eot_token"], meta["eot_id"]) == (wide_vocab.EOS, wide_vocab.VOCAB - 1)
    stream = np.concatenate([shards.load_tokens(p) for p in sorted(out.glob("train_*.bin"))])
    assert stream.min() >= 65_536 and stream.dtype == np.uint32
    assert (out / "tokenizer_config.json").read_text() == (
        folder / "tokenizer_config.json"
    ).read_text()
    export = tmp_path / "export"
    export.mkdir()
    assert copy_tokenizer(out, export)["eos_token_id"] == meta["eot_id"]


def test_prepare_in_worker_processes_writes_the_same_shards(tmp_path):
    """--workers 2 (at most two batches queued per worker) gives the shards one process gives."""
    docs = [f"document {i}: " + "word " * (i % 37) for i in range(1_300)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = tmp_path / "one" / "tokenizer.json"
    prepare([str(tmp_path / "d.jsonl")], tmp_path / "one", vocab_size=320, progress=False)
    prepare([str(tmp_path / "d.jsonl")], tmp_path / "two", str(tok), workers=2, progress=False)
    for name in ("train_000000.bin", "val_000000.bin"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()


def test_json_lines_parse_only_the_text_field_and_take_rows_longer_than_a_block():
    """A row of 3 MB (pyarrow.json's block is 1 MB: read again with a larger block, the rows
    before it not repeated), other fields of changing types (not parsed), a row without text
    (skipped)."""
    import tempfile

    from train.documents import iter_documents

    rows = [{"text": "a", "id": 1}, {"text": "b" * 3_000_000, "id": "two"}, {"id": [3]}]
    rows += [{"text": f"doc {i}", "meta": {"k": i} if i % 2 else None} for i in range(5)]
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
        f.flush()
        docs = list(iter_documents([f.name]))
    assert docs == [r["text"] for r in rows if "text" in r]


# ---- a vocabulary past 65,536 ids from end to end ---------------------------------------------


def test_a_150000_id_vocabulary_prepares_trains_exports_and_serves(wide_vocab_run):
    """A 150,000-id Hugging Face tokenizer folder built here (tests/wide_vocab.py), a
    gzip-compressed JSON-lines corpus, `train.prepare` -> `train.main` (`tiny` at vocab_size
    150,016) -> `export.main` -> vLLM, each the real command in a subprocess of the background
    queue. Before, prepare refused any tokenizer past 65,536 ids (uint16 shards), and a
    `.jsonl.gz` was tokenised as its compressed bytes."""
    import wide_vocab

    from serve.generation import greedy_generate
    from serve.modeling_laplace import LaplaceForCausalLM

    root = wide_vocab_run
    meta = json.loads((root / "shards" / "meta.json").read_text())
    assert (meta["vocab_size"], meta["token_width"]) == (wide_vocab.VOCAB, "uint32")
    assert meta["train_docs"] + meta["val_docs"] == 300  # the gzip file's rows, not one blob
    paths = sorted((root / "shards").glob("train_*.bin"))
    assert all(shards.read_header(p).width is shards.UINT32 for p in paths)
    tokens = shards.load_tokens(paths[0])
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
