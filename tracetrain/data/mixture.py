"""`[[data.sources]]`: several instruction or chat sources mixed by weight into one training set.

    [data]
    kind = "instruction"            # the kind of sources that do not set their own
    [[data.sources]]
    path = "alpaca.jsonl"           # a data file, a datasets folder or hf:NAME
    weight = 3
    [[data.sources]]
    path = "chats.jsonl"
    kind = "chat"
    weight = 1

Each source is read and tokenised as it would be alone (its kind, format, split; `data.eval_fraction`
held out of it, seeded by `data.seed`). The mixture has as many training examples as the sources have
together, N = sum(n_i); source i contributes round(N * w_i / sum(w)) of them (largest remainders, so the
counts add up to N): its examples in its seeded order, repeated whole while it has fewer than its share,
and a seeded subset (a prefix of that order) when it has more. The drawn examples are shuffled together
with `data.seed` and packed like any other documents.

So the mixture is a pure function of the files, the settings and `data.seed`: the rows (and the token
cache entry that holds them) are the same on every run and every rank, and a resumed run finds the same
rows at the loader's saved position (the data fingerprint in the checkpoint checks it). What each source
gave — examples read and drawn, repeats, tokens and the realised shares — is in `DataStats.sources`,
printed by `tracetrain data` and kept in the run's data_stats.json.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from tracetrain.config import DataSection
from tracetrain.data.chat import chat_documents
from tracetrain.data.instruction import instruction_documents
from tracetrain.data.packing import IGNORE_INDEX, DataStats, Document, Documents
from tracetrain.data.tokenizer import Tokenizer

_SUMMED = ("examples_read", "bad_lines_skipped", "examples_truncated", "examples_dropped", "dropped_too_long")
# Length fields of the mixture: the largest of the sources' (a seq_len that keeps 95% of every source's
# examples whole keeps 95% of the mixture's), and no 95% length when a source did not measure its own.
_LARGEST = ("dropped_length_p50", "dropped_length_p90", "dropped_length_max", "seq_len_keeps_95")


def source_section(data: DataSection, i: int) -> DataSection:
    """The data config source i is read with: its path, kind, format and split in place of data's."""
    s = data.sources[i]
    return dataclasses.replace(
        data,
        sources=[],
        path=s.path,
        kind=s.kind or data.kind,
        format=s.format or data.format,
        split=s.split or data.split,
    )


def mix_counts(sizes: list[int], weights: list[float]) -> list[int]:
    """Examples drawn from each source: shares of sum(sizes) by weight, largest remainders first (ties: the
    earlier source), so that they add up to sum(sizes) exactly."""
    total, weight_sum = sum(sizes), sum(weights)
    exact = [total * w / weight_sum for w in weights]
    counts = [math.floor(e) for e in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _draw(docs: list[Document], count: int) -> list[Document]:
    """`count` documents: whole passes over `docs` (already in their seeded order), then a prefix of it."""
    passes, rest = divmod(count, len(docs))
    return docs * passes + docs[:rest]


def _source_row(data: DataSection, i: int, stats: DataStats, drawn: list[Document]) -> dict[str, Any]:
    s = data.sources[i]
    return {
        "path": s.path,
        "kind": s.kind or data.kind,
        "format": stats.format,
        "weight": s.weight,
        "examples_read": stats.examples_read,
        "train_examples": stats.train_examples,
        "eval_examples": stats.eval_examples,
        "examples_drawn": len(drawn),
        "repeats": round(len(drawn) / stats.train_examples, 3),
        "tokens": sum(len(ids) for ids, _ in drawn),
        "trained_tokens": sum(int(np.count_nonzero(np.asarray(labels) != IGNORE_INDEX)) for _, labels in drawn),
        "truncated": stats.examples_truncated,
        "dropped": stats.examples_dropped,
        "bad_rows_skipped": stats.bad_lines_skipped,
    }


def mixture_documents(data: DataSection, tok: Tokenizer) -> Documents:
    """`data.sources`: every source's documents, drawn by weight and shuffled together (`record_rows` packs them)."""
    parts: list[Documents] = []
    for i in range(len(data.sources)):
        sub = source_section(data, i)
        builder = chat_documents if sub.kind == "chat" else instruction_documents
        parts.append(builder(sub, tok, f"data.sources[{i}].path"))
    counts = mix_counts([len(p.train) for p in parts], [s.weight for s in data.sources])
    drawn = [_draw(p.train, n) for p, n in zip(parts, counts)]
    stats = DataStats()
    for p in parts:
        for name in _SUMMED:
            setattr(stats, name, getattr(stats, name) + getattr(p.stats, name))
        for name in _LARGEST:
            setattr(stats, name, max(getattr(stats, name), getattr(p.stats, name)))
    if any(p.stats.seq_len_keeps_95 == 0 for p in parts):
        # A source without it (chat data records no lengths) may hold the longest examples: the others'
        # largest would say 95% fit in a length that a chat source's share of the mixture exceeds.
        stats.seq_len_keeps_95 = 0
    stats.sources = [_source_row(data, i, p.stats, d) for i, (p, d) in enumerate(zip(parts, drawn))]
    total_examples = sum(counts)
    total_tokens = sum(row["tokens"] for row in stats.sources) or 1
    for row in stats.sources:
        row["share_wanted"] = row["weight"] / sum(s.weight for s in data.sources)
        row["share_examples"] = row["examples_drawn"] / total_examples
        row["share_tokens"] = row["tokens"] / total_tokens
    train = [doc for docs in drawn for doc in docs]
    eval_ = [doc for p in parts for doc in p.eval]
    stats.train_examples, stats.eval_examples = len(train), len(eval_)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(data.seed)).tolist()
    return Documents([train[i] for i in order], eval_, [ex for p in parts for ex in p.eval_examples], stats)
