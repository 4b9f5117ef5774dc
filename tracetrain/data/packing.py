"""Turn tokenised documents into fixed-length rows, and hold the rows as a `PackedDataset`.

Every row has four aligned int64 tensors of length `seq_len`:

    input_ids     the tokens
    labels        the *next* token of the same document (already shifted), or -100 for no loss
    position_ids  0, 1, 2, ... restarting at every document start (and at every row start)
    document_ids  0, 1, 2, ... one per document within the row; padding gets -1

Labels are shifted here, once, so that the trainer does a plain
`cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)` and so that a document's last
token never learns to predict the first token of the next, unrelated document.

Two ways to fill rows:
- `pack_documents`: whole documents (instruction examples), greedily packed or one per row; a document
  never straddles two rows, so every example is seen with its full prompt.
- `stream_rows`: a contiguous token stream (a text corpus, memory-mapped) cut every `seq_len` tokens; a
  document may continue into the next row, and its label at the cut still points at its true next token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from tracetrain.labels import IGNORE_INDEX

PAD_DOCUMENT = -1

# A tokenised document: (token ids, shifted labels), both of the same length; lists, or int32 arrays
# (`compact_document`: 8 bytes a token where two lists of Python ints take ~70).
Document = tuple[Sequence[int] | np.ndarray, Sequence[int] | np.ndarray]
PACK_CHUNK_TOKENS = 1 << 20  # token slots packed at a time when writing rows out (`iter_packed_rows`): ~60 MB


@dataclass(frozen=True)
class TokenizedExample:
    """One example as the model sees it, before packing: for inspection (`tokenize_rows`) and packing."""

    where: str  # its location for messages: "file:LINE", "file: row N", "synthetic: N"
    text: str  # the text it was tokenised from (template applied; a BOS id may precede it)
    ids: list[int]
    is_target: list[bool]  # per token: does predicting this token carry a loss


@dataclass
class DataStats:
    """What building the datasets did, for the trainer to print and the run directory to keep."""

    examples_read: int = 0
    bad_lines_skipped: int = 0
    examples_truncated: int = 0
    examples_dropped: int = 0
    train_examples: int = 0
    eval_examples: int = 0
    train_sequences: int = 0
    eval_sequences: int = 0
    train_tokens: int = 0  # real (non-padding) tokens in the training rows
    train_target_tokens: int = 0  # tokens that carry a loss (labels != -100)
    seq_len: int = 0
    format: str = ""  # instruction data: the row format read, e.g. "alpaca (auto: instruction/input/output)"
    # Examples dropped because the prompt alone fills seq_len (counted in examples_dropped too), their
    # whole lengths in tokens, and the seq_len that would fit 95% of all examples whole (0: not measured).
    dropped_too_long: int = 0
    dropped_length_p50: int = 0
    dropped_length_p90: int = 0
    dropped_length_max: int = 0
    seq_len_keeps_95: int = 0
    sources: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # data.sources: one dict each

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def record_lengths(self, lengths: Sequence[int], dropped_lengths: Sequence[int]) -> None:
        """Whole lengths (tokens) of every example read, and of those dropped for length -> the length fields."""
        if len(lengths):
            self.seq_len_keeps_95 = int(np.ceil(np.percentile(lengths, 95)))
        if len(dropped_lengths):
            self.dropped_too_long += len(dropped_lengths)
            p50, p90 = np.percentile(dropped_lengths, [50, 90])
            self.dropped_length_p50, self.dropped_length_p90 = int(np.ceil(p50)), int(np.ceil(p90))
            self.dropped_length_max = int(max(dropped_lengths))

    def too_long_note(self, seq_len: int) -> str:
        """'N longer than data.seq_len = S (lengths p50 / p90 / max ...; data.seq_len = W keeps 95% whole)'."""
        keeps = self.seq_len_keeps_95  # 0: not known (a mixture with a chat source)
        return (
            f"{self.dropped_too_long} with a prompt that alone fills data.seq_len = {seq_len} (their lengths: "
            f"p50 {self.dropped_length_p50}, p90 {self.dropped_length_p90}, max {self.dropped_length_max} "
            f"tokens{f'; data.seq_len = {keeps} would keep 95% of examples whole' if keeps else ''})"
        )

    def summary(self) -> str:
        """One line for the console."""
        fill = self.train_tokens / max(1, self.train_sequences * self.seq_len)
        parts = [
            f"{self.examples_read} examples read",
            f"{self.train_examples} train / {self.eval_examples} eval",
            f"{self.train_sequences} train rows ({fill:.0%} filled)",
            f"{self.train_tokens} tokens, {self.train_target_tokens} with loss",
        ]
        for count, what in (
            (self.bad_lines_skipped, "bad lines skipped"),
            (self.examples_truncated, "truncated"),
            (self.examples_dropped, "dropped"),
        ):
            if count:
                parts.append(f"{count} {what}")
        if self.dropped_too_long:
            parts[-1] += f" ({self.too_long_note(self.seq_len)})"
        if self.format:
            parts.insert(0, f"format {self.format}")
        for row in self.sources:
            parts.append(
                f"{row['path']}: {row['share_examples']:.0%} of examples (weight {row['share_wanted']:.0%}, "
                f"x{row['repeats']:g}), {row['share_tokens']:.0%} of tokens"
            )
        return "data: " + ", ".join(parts)


@dataclass
class Documents:
    """Both splits of instruction, chat or synthetic data, tokenised and waiting to be packed (record_rows.py)."""

    train: list[Document]  # in packing order (shuffled with data.seed)
    eval: list[Document]
    eval_examples: list[tuple[str, str]]  # held-out (prompt, response) pairs for exact-match evaluation
    stats: DataStats  # counts so far; the row counts are added when the rows are written


class PackedDataset(Dataset):
    """Fixed-length rows as stacked int32 tensors (memory-mapped row files, token_cache.py, or in memory);
    `ds[i]` is one row as a dict.

    `examples` holds the held-out (prompt_text, response_text) pairs for exact-match evaluation
    (instruction and synthetic data; empty for text). `name` says which split it is, for messages.
    """

    def __init__(
        self, rows: dict[str, torch.Tensor], examples: list[tuple[str, str]] | None = None, name: str = "train"
    ) -> None:
        lengths = {t.shape for t in rows.values()}
        assert len(lengths) == 1, f"row tensors disagree in shape: {lengths}"
        # Stored as int32 to halve host memory for large corpora; rows are widened on the way out.
        self.rows = {k: v.to(torch.int32) for k, v in rows.items()}  # each (num_rows, seq_len)
        self.examples = list(examples or [])
        self.name = name

    @property
    def seq_len(self) -> int:
        return self.rows["input_ids"].shape[1]

    def __len__(self) -> int:
        return self.rows["input_ids"].shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i].long() for k, v in self.rows.items()}  # each (seq_len,)

    def batch(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Rows start..stop-1 as one batch, without per-row collation."""
        return {k: v[start:stop].long() for k, v in self.rows.items()}  # each (rows, seq_len)


def shift_labels(ids: list[int], is_target: list[bool]) -> list[int]:
    """labels[t] = ids[t+1] where token t+1 is a target, else -100; the last token gets -100."""
    labels = [tok if tgt else IGNORE_INDEX for tok, tgt in zip(ids[1:], is_target[1:])]
    return labels + [IGNORE_INDEX]


def compact_document(ids: list[int], is_target: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, shifted labels) as int32 arrays: how documents wait for packing."""
    return np.asarray(ids, dtype=np.int32), np.asarray(shift_labels(ids, is_target), dtype=np.int32)


def _finish_rows(ids: np.ndarray, labels: np.ndarray, doc: np.ndarray) -> dict[str, torch.Tensor]:
    """Rows of ids/labels plus a global document index per token (-1 = padding) -> the four tensors.

    Positions and per-row document ids are derived from where the global index changes, so a document
    cut at a row boundary restarts at position 0 in the next row (its earlier part is not visible).
    """
    num_rows, seq_len = ids.shape
    starts = np.ones_like(doc, dtype=bool)  # (rows, seq): True where a new segment begins
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    col = np.broadcast_to(np.arange(seq_len), (num_rows, seq_len))
    seg_start = np.maximum.accumulate(np.where(starts, col, 0), axis=1)
    positions = np.where(doc >= 0, col - seg_start, 0)
    local_doc = np.where(doc >= 0, np.cumsum(starts, axis=1) - 1, PAD_DOCUMENT)
    return {
        "input_ids": torch.from_numpy(ids.astype(np.int64)),
        "labels": torch.from_numpy(labels.astype(np.int64)),
        "position_ids": torch.from_numpy(positions.astype(np.int64)),
        "document_ids": torch.from_numpy(local_doc.astype(np.int64)),
    }


def _row_slots(lengths: list[int], seq_len: int, pack: bool) -> list[tuple[int, int]]:
    """(row, offset) for each document: greedy first-fit into the current row, in the given order."""
    slots, row, used = [], -1, seq_len
    for n in lengths:
        assert 0 < n <= seq_len, f"document of {n} tokens does not fit seq_len {seq_len}"
        if not pack or used + n > seq_len:
            row, used = row + 1, 0
        slots.append((row, used))
        used += n
    return slots


def _group_slots(lengths: list[int], seq_len: int, pack: bool, group: int) -> list[tuple[int, int]]:
    """(row, offset) for each document when every `group` consecutive ones form one unit."""
    assert len(lengths) % group == 0, f"{len(lengths)} documents are not whole groups of {group}"
    units = [sum(lengths[i : i + group]) for i in range(0, len(lengths), group)]
    slots = []
    for u, (row, offset) in enumerate(_row_slots(units, seq_len, pack)):
        for n in lengths[u * group : (u + 1) * group]:
            slots.append((row, offset))
            offset += n
    return slots


def pack_documents(docs: list[Document], seq_len: int, pad_id: int, pack: bool) -> dict[str, torch.Tensor]:
    """Whole documents into rows of exactly `seq_len`; the rest of each row is padding.

    pack=True: greedy in the given order (shuffle first), a new row whenever the next document does
    not fit. pack=False: one document per row, right-padded.
    """
    chunks = list(iter_packed_rows(docs, seq_len, pad_id, pack, chunk_rows=max(1, len(docs))))
    return chunks[0] if chunks else empty_rows(seq_len)


def iter_packed_rows(
    docs: list[Document], seq_len: int, pad_id: int, pack: bool, chunk_rows: int = 0, group: int = 1
) -> Iterator[dict[str, torch.Tensor]]:
    """`pack_documents`'s rows, `chunk_rows` at a time (default: PACK_CHUNK_TOKENS worth; the four tensors
    of consecutive rows each), so that writing them out never holds more than a chunk of rows.

    `group` > 1: every `group` consecutive documents are placed as one unit, side by side in one row (a
    preference pair: chosen, then rejected), still documents of their own; a row starts at a unit."""
    chunk_rows = chunk_rows or max(1, PACK_CHUNK_TOKENS // seq_len)
    slots = _group_slots([len(ids) for ids, _ in docs], seq_len, pack, group)
    num_rows = slots[-1][0] + 1 if slots else 0
    d = 0
    for first in range(0, num_rows, chunk_rows):
        rows = min(chunk_rows, num_rows - first)
        ids = np.full((rows, seq_len), pad_id, dtype=np.int64)
        labels = np.full((rows, seq_len), IGNORE_INDEX, dtype=np.int64)
        doc = np.full((rows, seq_len), PAD_DOCUMENT, dtype=np.int64)
        while d < len(docs) and slots[d][0] < first + rows:
            (doc_ids, doc_labels), (row, offset) = docs[d], slots[d]
            end = offset + len(doc_ids)
            ids[row - first, offset:end] = doc_ids
            labels[row - first, offset:end] = doc_labels
            doc[row - first, offset:end] = d
            d += 1
        yield _finish_rows(ids, labels, doc)


def stream_row_spans(seg_starts: np.ndarray, seg_ends: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(first token, length) of every row when segments [start, end) of a stream are each cut into
    `seq_len` rows, in order; the last row of a segment may be shorter (it is padded)."""
    lengths = seg_ends - seg_starts
    rows_per_seg = -(-lengths // seq_len)
    seg = np.repeat(np.arange(len(lengths)), rows_per_seg)
    first_row = np.cumsum(rows_per_seg) - rows_per_seg
    starts = seg_starts[seg] + (np.arange(len(seg)) - first_row[seg]) * seq_len
    return starts, np.minimum(seq_len, seg_ends[seg] - starts)


def stream_rows(
    tokens: Any,
    doc_ends: np.ndarray,
    hi: int,
    starts: np.ndarray,
    lengths: np.ndarray,
    seq_len: int,
    pad_id: int,
) -> dict[str, torch.Tensor]:
    """Rows (first token `starts`, `lengths`) of a token stream cut into `seq_len` rows, as the four tensors.

    `tokens` is the stream (an array, or a file sliced like one: only the rows' span is read), `doc_ends` the end offset of every
    document in it, `hi` the end of the part being cut (train or held-out): a token's label is the next
    token of its document, -100 at a document's end and at `hi`. So a label at a row cut keeps pointing
    at the document's next token (the first of the next row): the prediction is still made from this
    row's context. Rows must be consecutive in the stream; padding fills each row to `seq_len`.
    """
    lo, end = int(starts[0]), int(starts[-1] + lengths[-1])
    span = np.asarray(tokens[lo : min(end + 1, hi)], dtype=np.int64)  # one more token: the last label
    pos = np.arange(lo, end)
    doc = np.searchsorted(doc_ends, pos, side="right")  # global document index of each token
    nxt = np.append(span[1:], IGNORE_INDEX) if len(span) == end - lo else span[1:]
    labels = np.where(pos + 1 < np.minimum(doc_ends[doc], hi), nxt, IGNORE_INDEX)
    col = np.arange(seq_len)
    valid = col < lengths[:, None]  # (rows, seq)
    index = np.where(valid, starts[:, None] - lo + col, 0)
    return _finish_rows(
        np.where(valid, span[index], pad_id),
        np.where(valid, labels[index], IGNORE_INDEX),
        np.where(valid, doc[index], PAD_DOCUMENT),
    )


def empty_rows(seq_len: int) -> dict[str, torch.Tensor]:
    """Zero rows, for an absent held-out split."""
    shape = (0, seq_len)
    return {k: torch.zeros(shape, dtype=torch.int64) for k in ("input_ids", "labels", "position_ids", "document_ids")}
