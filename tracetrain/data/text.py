"""Plain-text corpora for pre-training style runs: every token carries a loss.

Input is a UTF-8 text file, or a data file of rows (JSONL, JSON array, Parquet, datasets folder) with the
document in `data.text_field` ("text"). A text file is one document
unless it contains separator lines `<|endoftext|>` (the GPT-2 convention), which split it into several.
Each document becomes [BOS] + tokens + EOS; the documents are concatenated into one stream and cut into
`seq_len` rows (`pack=True`), or each document is cut into its own rows (`pack=False`).

The held-out split is the *last* `eval_fraction` of the stream (no shuffle: neighbouring text is
correlated, so a random split would leak), unless `eval_path` names a separate file.

The corpus never has to fit in memory: documents are read a chunk at a time, tokenised a batch at a
time into a flat int32 token file, and cut into rows a block at a time into row files (`token_cache.py`),
which the dataset then reads through memory maps. Host memory stays about one batch of documents
(the text of the largest document, if larger: a Hugging Face tokenizer encodes a long one a piece at a
time, tokenizer.py) plus one block of rows, whatever the corpus size. Progress reports bytes read of the
file, tokens so far and their rate.
"""

from __future__ import annotations

import codecs
import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from tracetrain.config import DataSection
from tracetrain.data.files import (
    ReadPosition,
    data_digest,
    is_record_file,
    iter_rows,
    open_data_file,
    require_data_path,
)
from tracetrain.data.instruction import string_fields
from tracetrain.data.packing import IGNORE_INDEX, DataStats, PackedDataset, stream_row_spans, stream_rows
from tracetrain.data.token_cache import entry_key, open_or_build, row_writers
from tracetrain.data.tokenizer import Tokenizer
from tracetrain.errors import DataError
from tracetrain.progress import Progress, Rate, throttled

SEPARATOR = "<|endoftext|>"
_SEPARATOR_LINE = re.compile(r"^[ \t]*<\|endoftext\|>[ \t]*(?:\r?\n|$)", re.MULTILINE)
_READ_CHARS = 1 << 20  # text read per chunk
_BATCH_CHARS = 1 << 20  # text tokenised per call (a longer document: in pieces, tokenizer.PIECE_CHARS)
_BLOCK_TOKENS = 1 << 19  # tokens cut into rows per block (bounds the row-building temporaries)


def iter_documents(
    path: str,
    key: str,
    skip_bad_lines: bool,
    text_field: str = "text",
    position: ReadPosition | None = None,
    split: str = "train",
) -> Iterator[str]:
    """The documents of a corpus, one at a time, in file order; whitespace-only documents are left out.

    A data file of rows (JSONL, JSON, Parquet, datasets folder: see files.py) gives one document per
    row, from `text_field`; any other file is plain UTF-8 text. `position` follows the reading (and
    counts bad rows skipped).
    """
    position = position if position is not None else ReadPosition()
    if is_record_file(path):
        parse = lambda row: string_fields(row, [text_field], [])[text_field]  # noqa: E731
        docs: Iterator[str] = (doc for _, doc in iter_rows(path, key, parse, skip_bad_lines, position, split))
    else:
        docs = _text_file_documents(path, key, position)
    return (d for d in docs if d.strip())


def _text_file_documents(path: str, key: str, position: ReadPosition) -> Iterator[str]:
    """A text file split at `<|endoftext|>` lines, read a chunk at a time. Line ends are read as Python's
    text mode reads them (\\r\\n and \\r become \\n). Only whole lines are split, so a separator line never
    straddles two chunks."""
    with open_data_file(path, key) as f:
        position.total, position.unit = Path(path).stat().st_size, "bytes"
        carry, doc_parts = "", []  # carry: text after the last line end; doc_parts: the document so far
        while True:
            try:
                text = f.read(_READ_CHARS)
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not valid UTF-8 text ({e.reason} at byte {_first_bad_byte(path)})") from None
            position.done = f.buffer.tell()
            buffer = carry + text
            cut = len(buffer) if not text else buffer.rfind("\n") + 1
            pieces = _SEPARATOR_LINE.split(buffer[:cut])
            carry = buffer[cut:]
            doc_parts.append(pieces[0])
            for piece in pieces[1:]:
                yield "".join(doc_parts)
                doc_parts = [piece]
            if not text:
                yield "".join(doc_parts)
                return


def _first_bad_byte(path: str) -> int:
    """Offset of the first byte that is not valid UTF-8 (for the error message; the file is known bad)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            raw = f.read(_READ_CHARS)
            held = len(decoder.getstate()[0])  # bytes of a character begun in the previous chunk
            try:
                decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                return offset - held + e.start
            if not raw:
                return offset
            offset += len(raw)


class TokenFile:
    """A flat int32 token file read by slices (`tokens[a:b]`), with plain reads rather than a map, so that
    reading it through does not grow the process's resident memory."""

    def __init__(self, path: Path, num_tokens: int) -> None:
        self.path, self.num_tokens = path, num_tokens

    def __len__(self) -> int:
        return self.num_tokens

    def __getitem__(self, s: slice) -> np.ndarray:
        lo, hi, _ = s.indices(self.num_tokens)
        return np.fromfile(self.path, np.int32, count=max(0, hi - lo), offset=4 * lo)


@dataclass
class TokenStream:
    """A corpus tokenised into a flat int32 file: every document as [BOS] ids EOS, back to back."""

    tokens: TokenFile  # (num_tokens,) int32
    doc_ends: np.ndarray  # (num_docs,) int64: end offset of each document in `tokens`
    bad_rows: int


def tokenize_to_file(
    path: str, key: str, data: DataSection, tok: Tokenizer, out: Path, progress: Progress | None, split: str = "train"
) -> TokenStream:
    """Every document of `path`, tokenised a batch at a time, appended to `out`; documents that reach
    no batch limit are tokenised together (one call into the tokenizer per ~1 MB of text)."""
    position = ReadPosition()
    docs = iter_documents(path, key, data.skip_bad_lines, data.text_field, position, split)
    lengths = array("q")  # tokens per document, BOS and EOS included
    rate, name = Rate(), Path(path).name
    report = throttled(progress)
    with open(out, "wb") as f:
        batch: list[str] = []
        size = 0
        for doc in _then_none(docs):
            if doc is not None:
                batch.append(doc)
                size += len(doc)
            if batch and (doc is None or size >= _BATCH_CHARS):
                lengths.extend(_write_batch(f, batch, tok))
                batch, size = [], 0
                if report:
                    num_tokens = f.tell() // 4
                    what = f"tokenizing {name}: {num_tokens:,} tokens, {rate.per_s(num_tokens):,.0f} tok/s"
                    report(what, position.done, position.total, position.unit)
    if not lengths:
        raise DataError(f"{path}: no text to train on (config key '{key}')")
    doc_ends = np.cumsum(np.frombuffer(lengths, dtype=np.int64))
    return TokenStream(TokenFile(out, int(doc_ends[-1])), doc_ends, position.bad)


def _then_none(docs: Iterator[str]) -> Iterator[str | None]:
    """The documents, then None: the signal to tokenise the last batch."""
    yield from docs
    yield None


def _write_batch(f: Any, docs: list[str], tok: Tokenizer) -> list[int]:
    """Tokenise `docs` in one call and append them to `f` as [BOS] ids EOS; returns each one's length."""
    encoded = tok.encode_batch_arrays(docs)
    lengths = np.array([len(e) + 1 + tok.add_bos for e in encoded], dtype=np.int64)
    ids = np.empty(int(lengths.sum()), dtype=np.int32)
    ends = np.cumsum(lengths)
    for end, e in zip(ends, encoded):
        if tok.add_bos:
            ids[end - len(e) - 2] = tok.bos_id
        ids[end - len(e) - 1 : end - 1] = e
        ids[end - 1] = tok.eos_id
    f.write(ids.tobytes())
    return lengths.tolist()


def _row_spans(stream: TokenStream, lo: int, hi: int, data: DataSection) -> tuple[np.ndarray, np.ndarray]:
    """(first token, length) of every row of tokens lo..hi-1: pack=True cuts them as one stream every
    seq_len tokens; pack=False starts a new row at every document (its part in lo..hi)."""
    if hi <= lo:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if data.pack:
        return stream_row_spans(np.array([lo]), np.array([hi]), data.seq_len)
    first, last = np.searchsorted(stream.doc_ends, [lo, hi - 1], side="right")
    doc_starts = np.concatenate([[0], stream.doc_ends[:-1]])
    seg_starts = np.maximum(doc_starts[first : last + 1], lo)
    return stream_row_spans(seg_starts, np.minimum(stream.doc_ends[first : last + 1], hi), data.seq_len)


def _cut_rows(
    stream: TokenStream,
    hi: int,
    spans: tuple[np.ndarray, np.ndarray],
    data: DataSection,
    pad_id: int,
    out: dict[str, BinaryIO],
    progress: Progress | None,
) -> int:
    """The rows `spans` (all ending by `hi`) written into `out` a block at a time; returns the tokens
    with a loss."""
    starts, lengths = spans
    rows_per_block = max(1, _BLOCK_TOKENS // data.seq_len)
    num_targets = 0
    report = throttled(progress)
    for r in range(0, len(starts), rows_per_block):
        s = slice(r, r + rows_per_block)
        block = stream_rows(stream.tokens, stream.doc_ends, hi, starts[s], lengths[s], data.seq_len, pad_id)
        for key, rows in block.items():
            out[key].write(rows.numpy().astype(np.int32).tobytes())
        num_targets += int((block["labels"] != IGNORE_INDEX).sum())
        if report:
            report("cutting rows", min(r + rows_per_block, len(starts)), len(starts), "rows")
    return num_targets


def _num_docs_in(doc_ends: np.ndarray, lo: int, hi: int) -> int:
    """Documents with at least one token in lo..hi-1."""
    if hi <= lo:
        return 0
    first, last = np.searchsorted(doc_ends, [lo, hi - 1], side="right")
    return int(last - first + 1)


def _build_rows(data: DataSection, tok: Tokenizer, folder: Path, progress: Progress | None) -> dict[str, Any]:
    """Tokenise the corpus (and the held-out file) into `folder` and cut both splits into row arrays there."""
    stats = DataStats(seq_len=data.seq_len)
    stream = tokenize_to_file(data.path, "data.path", data, tok, folder / "tokens.i32", progress, data.split)
    num_tokens = len(stream.tokens)
    stats.bad_lines_skipped, stats.examples_read = stream.bad_rows, len(stream.doc_ends)
    if data.eval_path:
        eval_stream = tokenize_to_file(
            data.eval_path, "data.eval_path", data, tok, folder / "eval.i32", progress, data.eval_split
        )
        stats.bad_lines_skipped += eval_stream.bad_rows
        stats.examples_read += len(eval_stream.doc_ends)
        parts = {"train": (stream, 0, num_tokens), "eval": (eval_stream, 0, len(eval_stream.tokens))}
    else:
        cut = num_tokens - round(num_tokens * data.eval_fraction)
        parts = {"train": (stream, 0, cut), "eval": (stream, cut, num_tokens)}
    rows, targets = {}, {}
    for split, (part, lo, hi) in parts.items():
        spans = _row_spans(part, lo, hi, data)
        rows[split] = len(spans[0])
        with row_writers(folder, split) as out:
            targets[split] = _cut_rows(part, hi, spans, data, tok.pad_id, out, progress)
    # Documents that straddle the train/eval cut count on both sides.
    stats.train_examples = _num_docs_in(stream.doc_ends, *parts["train"][1:])
    stats.eval_examples = _num_docs_in(parts["eval"][0].doc_ends, *parts["eval"][1:])
    stats.train_sequences, stats.eval_sequences = rows["train"], rows["eval"]
    stats.train_tokens = parts["train"][2] - parts["train"][1]
    stats.train_target_tokens = targets["train"]
    for name in ("tokens.i32", "eval.i32"):
        (folder / name).unlink(missing_ok=True)  # the rows hold everything; the maps stay valid
    return {"rows": rows, "seq_len": data.seq_len, "stats": stats.as_dict()}


def _entry_key(data: DataSection, tok: Tokenizer, progress: Progress | None) -> str:
    """What the rows depend on: both files' bytes, the tokenizer, and the settings that shape rows."""
    return entry_key(
        {
            "kind": "text",
            "path": data_digest(data.path, "data.path", data.split, progress),
            "split": data.split,
            "records": is_record_file(data.path),  # the same bytes read as rows or as plain text
            "eval_path": data_digest(data.eval_path, "data.eval_path", data.eval_split, progress)
            if data.eval_path
            else "",
            "eval_split": data.eval_split,
            "eval_records": is_record_file(data.eval_path) if data.eval_path else False,
            "eval_fraction": data.eval_fraction,
            "text_field": data.text_field,
            "skip_bad_lines": data.skip_bad_lines,
            "seq_len": data.seq_len,
            "pack": data.pack,
            "tokenizer": tok.fingerprint(),
        }
    )


def build_text_datasets(
    data: DataSection, tok: Tokenizer, cache_dir: str | Path | None = None, progress: Progress | None = None
) -> tuple[PackedDataset, PackedDataset, DataStats]:
    """`data.kind = "text"`: a corpus -> train and eval datasets of `seq_len` rows plus stats.

    The rows live in memory-mapped files: an entry of `cache_dir` (reused when the data, tokenizer and
    settings are unchanged), or, without one, temporary files deleted once mapped.
    """
    for key, path in (("data.path", data.path), ("data.eval_path", data.eval_path)):
        if path:
            require_data_path(path, key)
    key = _entry_key(data, tok, progress) if cache_dir is not None else ""
    splits, meta, _ = open_or_build(cache_dir, key, lambda folder: _build_rows(data, tok, folder, progress))
    stats = DataStats(**meta["stats"])
    return PackedDataset(splits["train"], name="train"), PackedDataset(splits["eval"], name="eval"), stats
