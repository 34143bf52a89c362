"""The documents of a corpus, in the formats corpora come in, each read by the library made for it.

    format                        read by                                        a document is
    .txt .md .py .rst .text       Python's UTF-8 decoder                         the whole file
    .jsonl .json (JSON lines)     pyarrow.json's streaming reader                a row's text field
    .parquet                      pyarrow.parquet, a row group's batches         a row's text field
    .arrow (IPC file or stream)   pyarrow.ipc                                    a row's text field
    a `save_to_disk` folder       datasets.load_from_disk (its split)            a row's text field

Text and JSON-lines files may be gzip- or zstd-compressed (`.gz`, `.zst`): pyarrow decompresses
them as it streams (`pyarrow.input_stream`). Everything is streamed in bounded blocks (a saved
dataset is memory-mapped), so memory does not grow with the corpus. A file that cannot be read
(not its format, damaged, not UTF-8, no text field, text that is not a string) raises
`CorpusError` naming it; it is never tokenised as bytes. Only the text field of a row is parsed:
other fields may have any type.

`datasets` reads the folders it writes; its streaming reader is not used for the rest because it
imports PyTorch into the process where PyTorch is installed (its IterableDataset shares an epoch
counter with torch's data-loader workers), about 220 MB of resident memory for a process that only
reads JSON (docs/design.md s14.4).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".text")
ROW_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}  # text and JSON lines only
SAVED_DATASET_FILES = ("dataset_info.json", "dataset_dict.json")  # what save_to_disk writes
BATCH_ROWS = 1_024  # rows read at a time from Parquet, Arrow and saved datasets
JSON_BLOCK_BYTES = 1 << 20  # pyarrow.json's block: a row longer than it takes a larger one
JSON_MAX_BLOCK_BYTES = 1 << 30


class CorpusError(ValueError):
    """An input of the corpus cannot be read; the message names it."""


def file_format(path: str) -> str:
    """ "text", "json", "parquet", "arrow" or "saved" (a save_to_disk folder); CorpusError for
    anything else."""
    p = Path(path)
    if p.is_dir():
        if any((p / name).is_file() for name in SAVED_DATASET_FILES):
            return "saved"
        raise CorpusError(f"{path}: a folder, but not one `datasets.save_to_disk` wrote")
    stem, compression = _compression(p.name.lower())
    suffix = "." + stem.rsplit(".", 1)[-1] if "." in stem else ""
    if suffix in TEXT_SUFFIXES:
        return "text"
    if suffix in ROW_SUFFIXES and (compression is None or ROW_SUFFIXES[suffix] == "json"):
        return ROW_SUFFIXES[suffix]
    raise CorpusError(
        f"{path}: unknown corpus format (read: {', '.join(TEXT_SUFFIXES)}, .jsonl, .json, either "
        "also .gz or .zst; .parquet, .arrow, a datasets.save_to_disk folder)"
    )


def _compression(name: str) -> tuple[str, str | None]:
    """(the name without its compression suffix, pyarrow's codec name or None)."""
    for suffix, codec in COMPRESSION.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], codec
    return name, None


def file_format_or_none(path: str) -> str | None:
    try:
        return file_format(path)
    except CorpusError:
        return None


def expand_inputs(items: Iterable[str]) -> list[str]:
    """Files, folders (searched recursively for the formats above but bare `.json`, which must be
    named; a saved dataset is one input) and globs, sorted."""
    out: list[str] = []
    for item in items:
        if os.path.isdir(item) and file_format_or_none(item) != "saved":
            for root, dirs, files in os.walk(item):
                saved = [d for d in dirs if file_format_or_none(os.path.join(root, d)) == "saved"]
                out.extend(os.path.join(root, d) for d in saved)
                dirs[:] = [d for d in dirs if d not in saved]
                out.extend(
                    os.path.join(root, f)
                    for f in files  # a bare .json in a folder is more often a settings file
                    if file_format_or_none(os.path.join(root, f)) and not f.endswith(".json")
                )
        elif os.path.exists(item):
            out.append(item)
        else:
            matched = glob.glob(item, recursive=True)
            if not matched:
                raise FileNotFoundError(f"no input files match {item!r}")
            out.extend(matched)
    return sorted(set(out))


def iter_documents(
    paths: Iterable[str],
    text_key: str = "text",
    split: str = "train",
    encoding_errors: str = "strict",
) -> Iterator[str]:
    """The documents of `paths`, in order: a text file is one document, a row-format file or
    saved dataset one per row (`text_key`; a row whose text is null or missing is skipped, a file
    where every row lacks it is an error). `split` picks the split of a saved DatasetDict;
    `encoding_errors` is how undecodable bytes of a text file are handled ("strict": an error
    naming the file)."""
    for path in paths:
        kind = file_format(path)
        rows = texts = 0
        try:
            if kind == "text":
                yield _text(path, encoding_errors)
                continue
            if kind == "saved":
                batches = _saved(path, text_key, split)
            else:
                batches = ROW_READERS[kind](path, text_key)
            for batch in batches:  # a batch: the text field's values, None where absent
                for text in batch:
                    rows += 1
                    if text is None:
                        continue
                    if not isinstance(text, str):
                        raise CorpusError(
                            f"{path}: row {rows}'s {text_key!r} is {type(text).__name__}, not text"
                        )
                    texts += 1
                    yield text
        except CorpusError:
            raise
        except Exception as e:  # the reader's own: ArrowInvalid, UnicodeDecodeError, EOFError...
            after = "" if kind == "text" else f" (after {rows:,} rows)"
            raise CorpusError(
                f"{path}: cannot be read as {kind}{after}: {type(e).__name__}: {e}"
            ) from e
        if rows and not texts:
            raise CorpusError(f"{path}: no row of its {rows:,} has a {text_key!r} field")


def _open(path: str):
    """A pyarrow input stream of the file, decompressed when its name says so."""
    import pyarrow as pa

    return pa.input_stream(path, compression=_compression(Path(path).name.lower())[1])


def _text(path: str, encoding_errors: str) -> str:
    """The file's text, decoded as UTF-8, with universal newlines (as Python's text mode)."""
    with _open(path) as f:
        text = f.read().decode("utf-8", errors=encoding_errors)
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _json_lines(path: str, text_key: str) -> Iterator[list]:
    """The text field of each row, a block at a time (pyarrow.json's streaming reader, only the
    text field parsed). A row longer than the block is read again with a block four times larger,
    from the start of the file, its rows before the failure skipped."""
    import pyarrow as pa
    import pyarrow.json as paj

    schema = pa.schema([(text_key, pa.string())])
    parse = paj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    block, done = JSON_BLOCK_BYTES, 0  # rows already yielded
    while True:
        seen = 0
        try:
            with _open(path) as stream:
                reader = paj.open_json(stream, paj.ReadOptions(block_size=block), parse)
                for batch in reader:
                    values = batch.column(0).to_pylist()
                    seen += len(values)
                    if seen > done:
                        yield values[len(values) - (seen - done) :]
                        done = seen
            return
        except pa.ArrowInvalid as e:
            if "straddl" not in str(e) or block >= JSON_MAX_BLOCK_BYTES:
                raise
            block *= 4


def _parquet(path: str, text_key: str) -> Iterator[list]:
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    _has_field(path, f.schema_arrow.names, text_key)
    for batch in f.iter_batches(columns=[text_key], batch_size=BATCH_ROWS):
        yield batch.column(0).to_pylist()


def _arrow(path: str, text_key: str) -> Iterator[list]:
    """An Arrow IPC file (random access) or stream (what `save_to_disk` writes), memory-mapped."""
    import pyarrow as pa

    source = pa.memory_map(path)
    try:
        reader = pa.ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:  # not the file format: the stream format
        source.seek(0)
        reader = pa.ipc.open_stream(source)
        batches = iter(reader)
    _has_field(path, reader.schema.names, text_key)
    for batch in batches:
        yield batch.column(text_key).to_pylist()


def _saved(path: str, text_key: str, split: str) -> Iterator[list]:
    import datasets

    rows = datasets.load_from_disk(path)
    if isinstance(rows, datasets.DatasetDict):
        if split not in rows:
            raise CorpusError(f"{path}: no split {split!r} (splits: {', '.join(rows)}); --split")
        rows = rows[split]
    _has_field(path, rows.column_names, text_key)
    for batch in rows.select_columns([text_key]).iter(batch_size=BATCH_ROWS):
        yield batch[text_key]


ROW_READERS = {"json": _json_lines, "parquet": _parquet, "arrow": _arrow}


def _has_field(path: str, names: list[str], text_key: str) -> None:
    if text_key not in names:
        raise CorpusError(f"{path}: no field {text_key!r} (fields: {', '.join(names)}); --text-key")
