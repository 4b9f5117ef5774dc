"""Plain-text corpora for pre-training style runs: every token carries a loss.

Input is a UTF-8 text file, or a data file of rows (JSONL, JSON array, Parquet, datasets folder) with the
document in `data.text_field` ("text"). A text file is one document
unless it contains separator lines `<|endoftext|>` (the GPT-2 convention), which split it into several.
Each document becomes [BOS] + tokens + EOS; the documents are concatenated into one stream and cut into
`seq_len` rows (`pack=True`), or each document is cut into its own rows (`pack=False`).

The held-out split is the *last* `eval_fraction` of the stream (no shuffle: neighbouring text is
correlated, so a random split would leak), unless `eval_path` names a separate file.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from tracetrain.config import DataSection
from tracetrain.data.files import is_record_file, open_data_file
from tracetrain.data.instruction import read_records
from tracetrain.data.packing import IGNORE_INDEX, DataStats, PackedDataset, chunk_stream, empty_rows, fill_row_stats
from tracetrain.data.tokenizer import Tokenizer
from tracetrain.errors import DataError

SEPARATOR = "<|endoftext|>"
_SEPARATOR_LINE = re.compile(r"^[ \t]*<\|endoftext\|>[ \t]*(?:\r?\n|$)", re.MULTILINE)


def read_documents(path: str, key: str, skip_bad_lines: bool, text_field: str = "text") -> tuple[list[str], int]:
    """(documents, bad rows skipped); whitespace-only documents are left out.

    A data file of rows (JSONL, JSON, Parquet, datasets folder: see files.py) gives one document per
    row, from `text_field`; any other file is plain UTF-8 text.
    """
    if is_record_file(path):
        records, bad = read_records(path, key, [text_field], [], skip_bad_lines)
        docs = [r[text_field] for _, r in records]
    else:
        with open_data_file(path, key) as f:
            try:
                text = f.read()
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not valid UTF-8 text ({e.reason} at byte {e.start})") from None
        docs, bad = _SEPARATOR_LINE.split(text), 0
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"{path}: no text to train on (config key '{key}')")
    return docs, bad


def token_stream(docs: list[str], tok: Tokenizer) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Documents -> (ids, shifted labels, document index), each of shape (total_tokens,).

    Every token but the first is a target, so labels[t] = ids[t+1] within a document; a document's EOS
    gets -100 (the next token belongs to another document). BOS starts a document where `tok.add_bos`.
    """
    encoded = tok.encode_batch(docs)
    lengths = np.array([len(e) + 1 + tok.add_bos for e in encoded], dtype=np.int64)
    ids = np.empty(int(lengths.sum()), dtype=np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    for start, end, e in zip(starts, ends, encoded):
        if tok.add_bos:
            ids[start] = tok.bos_id
        ids[end - len(e) - 1 : end - 1] = e
        ids[end - 1] = tok.eos_id
    labels = np.empty_like(ids)
    labels[:-1] = ids[1:]
    labels[ends - 1] = IGNORE_INDEX
    doc = np.repeat(np.arange(len(docs), dtype=np.int64), lengths)
    return ids, labels, doc


def _rows(
    ids: np.ndarray, labels: np.ndarray, doc: np.ndarray, data: DataSection, pad_id: int
) -> dict[str, torch.Tensor]:
    """A stream (or part of one) -> row tensors; with pack=False every document starts a new row."""
    if len(ids) == 0:
        return empty_rows(data.seq_len)
    labels = labels.copy()
    labels[-1] = IGNORE_INDEX  # a part's last token may not predict across the train/eval cut
    if data.pack:
        return chunk_stream(ids, labels, doc, data.seq_len, pad_id)
    cuts = np.flatnonzero(doc[1:] != doc[:-1]) + 1
    parts = [
        chunk_stream(i, lab, d, data.seq_len, pad_id)
        for i, lab, d in zip(np.split(ids, cuts), np.split(labels, cuts), np.split(doc, cuts))
    ]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def build_text_datasets(data: DataSection, tok: Tokenizer) -> tuple[PackedDataset, PackedDataset, DataStats]:
    """`data.kind = "text"`: a corpus -> train and eval datasets of `seq_len` rows plus stats."""
    stats = DataStats()
    docs, stats.bad_lines_skipped = read_documents(data.path, "data.path", data.skip_bad_lines, data.text_field)
    ids, labels, doc = token_stream(docs, tok)
    if data.eval_path:
        eval_docs, bad = read_documents(data.eval_path, "data.eval_path", data.skip_bad_lines, data.text_field)
        stats.bad_lines_skipped += bad
        eval_stream = token_stream(eval_docs, tok)
        stats.examples_read = len(docs) + len(eval_docs)
    else:
        cut = len(ids) - round(len(ids) * data.eval_fraction)
        eval_stream = ids[cut:], labels[cut:], doc[cut:]
        ids, labels, doc = ids[:cut], labels[:cut], doc[:cut]
        stats.examples_read = len(docs)
    train = PackedDataset(_rows(ids, labels, doc, data, tok.pad_id), name="train")
    eval_ = PackedDataset(_rows(*eval_stream, data, tok.pad_id), name="eval")
    # Documents that straddle the cut count on both sides.
    stats.train_examples = len(np.unique(doc))
    stats.eval_examples = len(np.unique(eval_stream[2]))
    fill_row_stats(stats, train, eval_)
    return train, eval_, stats
