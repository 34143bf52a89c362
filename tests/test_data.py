"""Token shards, the grain pipeline and `train.prepare`."""

import json

import numpy as np
import pytest

from train import data
from train.prepare import EOT, prepare


def _shard(path, tokens):
    data.write_shard(path, np.asarray(tokens))
    return str(path)


def test_shard_roundtrip_and_header(tmp_path):
    tokens = np.arange(1000) % 65_536
    path = _shard(tmp_path / "a.bin", tokens)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert header[:3].tolist() == [20240520, 1, 1000]
    assert (tmp_path / "a.bin").stat().st_size == 1024 + 2 * 1000
    np.testing.assert_array_equal(data.load_tokens(path), tokens)


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
    with pytest.raises(data.ShardError, match=message) as e:
        data.TokenWindows([str(path)], 4)
    assert "broken_shard.bin" in str(e.value)


def test_short_file_and_missing_glob(tmp_path):
    (tmp_path / "short.bin").write_bytes(b"\0" * 100)
    with pytest.raises(data.ShardError, match="short.bin.*shorter than"):
        data.read_header(tmp_path / "short.bin")
    with pytest.raises(data.ShardError, match="no token shards match"):
        data.expand_shards(str(tmp_path / "nothing_*.bin"))


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
    train = np.concatenate([data.load_tokens(p) for p in sorted(out.glob("train_*.bin"))])
    val = np.concatenate([data.load_tokens(p) for p in sorted(out.glob("val_*.bin"))])
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
    stream = np.concatenate([data.load_tokens(p) for p in sorted(out.glob("train_*.bin"))])
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
        data.write_shard(tmp_path / f"d{doc_len}.bin", np.tile(doc, 4 * 4097 // doc.size + 2))
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
