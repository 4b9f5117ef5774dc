"""`tracetrain data`: build the configured data exactly as training does, and show what the model will see.

    report = inspect_data(cfg, num_examples=3)        # the same tokenizer, template, truncation and packing
    report.stats                                      # counts, trained-token share, length histogram
    report.examples[0].text, .trained_text            # a rendered example and the tokens that carry loss

Statistics come from the built training and held-out rows (`build_datasets`, as `train` calls it): an
example there is one document within a row, so a text-corpus document cut at a row boundary counts once
per row. Shown examples are the first N of the data file in file order (`tokenize_rows`: the rendered
text, the ids and the per-token trained mask the packer receives), decoded with special tokens written
out (`<|im_start|>`, `<|eot_id|>`, ...) so that end-of-turn tokens show.

Rendering (`render_terminal`, `render_plain`, `examples_json`) is separate from computing. Without
colours (not a terminal), trained spans are wrapped in ⟦ ⟧.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tracetrain.config import Config
from tracetrain.data.loader import build_datasets, tokenize_rows
from tracetrain.data.packing import IGNORE_INDEX, PAD_DOCUMENT, DataStats, TokenizedExample
from tracetrain.data.tokenizer import Tokenizer, load_tokenizer
from tracetrain.progress import Progress, live_progress

TRAINED_OPEN, TRAINED_CLOSE = "⟦", "⟧"
NUM_BINS = 10
BAR_WIDTH = 40


@dataclass(frozen=True)
class ExampleView:
    """One example: the text it was tokenised from, its tokens as runs of (text, trained), and the tokens
    that carry loss."""

    where: str  # "file:LINE", "file: row N", "synthetic: N"
    text: str  # the rendered example (template applied), as the data pipeline tokenised it
    pieces: list[tuple[str, bool]]  # its tokens decoded with special tokens written out, BOS/EOS included
    trained_text: str
    trained_spans: list[str]  # each contiguous run of trained tokens, decoded
    num_tokens: int
    num_trained: int


@dataclass(frozen=True)
class DataReport:
    stats: dict[str, Any]
    examples: list[ExampleView]


def _tokenizer(cfg: Config) -> Tokenizer:
    """The tokenizer training uses: data.tokenizer, resolved against model.init_from for 'auto'."""
    return load_tokenizer(cfg.data.tokenizer, cfg.model.init_from)


def _rows_of(ds: Any, progress: Progress | None) -> dict[str, torch.Tensor]:
    """All rows of a split as (num_rows, seq_len) tensors; on-the-fly rows are tokenised here, counted."""
    if hasattr(ds, "rows"):
        return ds.rows
    rows: list[dict[str, torch.Tensor]] = []
    for i in range(len(ds)):
        rows.append(ds[i])
        if progress and (i + 1) % 256 == 0:
            progress("tokenizing rows", i + 1, len(ds))
    keys = ("input_ids", "labels", "position_ids", "document_ids")
    if not rows:
        return {k: torch.zeros((0, ds.seq_len), dtype=torch.int64) for k in keys}
    return {k: torch.stack([r[k] for r in rows]) for k in keys}


def _segments(rows: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, trained tokens) of every example (document within a row), in row order."""
    doc = rows["document_ids"].numpy()  # (rows, seq)
    num_rows, seq_len = doc.shape
    valid = doc != PAD_DOCUMENT
    # Row-major order visits each row's documents in turn, so equal keys are contiguous: one pass, O(tokens).
    key = (np.arange(num_rows, dtype=np.int64)[:, None] * seq_len + doc)[valid]
    if not len(key):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.concatenate([[0], np.flatnonzero(np.diff(key)) + 1])
    lengths = np.diff(np.append(starts, len(key)))
    trained = (rows["labels"].numpy() != IGNORE_INDEX)[valid].astype(np.int64)
    return lengths, np.add.reduceat(trained, starts)


def length_histogram(lengths: np.ndarray, num_bins: int = NUM_BINS) -> list[dict[str, int]]:
    """Equal-width bins from the shortest to the longest example: [{lo, hi, count}], both ends inclusive."""
    if not len(lengths):
        return []
    lo, hi = int(lengths.min()), int(lengths.max())
    edges = np.unique(np.linspace(lo - 1, hi, num_bins + 1).round().astype(np.int64))  # bins (e0, e1], ...
    counts = np.histogram(lengths, bins=edges + 0.5)[0]
    return [{"lo": int(edges[i] + 1), "hi": int(edges[i + 1]), "count": int(counts[i])} for i in range(len(counts))]


def _split_stats(rows: dict[str, torch.Tensor]) -> dict[str, Any]:
    lengths, trained = _segments(rows)
    num_tokens, num_trained = int(lengths.sum()), int(trained.sum())
    return {
        "examples": len(lengths),
        "rows": int(rows["input_ids"].shape[0]),
        "tokens": num_tokens,
        "trained_tokens": num_trained,
        "trained_share": num_trained / num_tokens if num_tokens else 0.0,
        "length_min": int(lengths.min()) if len(lengths) else 0,
        "length_mean": float(lengths.mean()) if len(lengths) else 0.0,
        "length_max": int(lengths.max()) if len(lengths) else 0,
        "length_histogram": length_histogram(lengths),
    }


def _pieces(ids: list[int], is_trained: list[bool], decode: Callable[[list[int]], str]) -> list[tuple[str, bool]]:
    """Runs of equally-trained tokens, each decoded as one piece (so merged bytes decode whole)."""
    pieces: list[tuple[str, bool]] = []
    start = 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or is_trained[t] != is_trained[start]:
            pieces.append((decode(ids[start:t]), is_trained[start]))
            start = t
    return pieces


def example_view(ex: TokenizedExample, decode: Callable[[list[int]], str]) -> ExampleView:
    """One tokenised example -> its pieces and trained tokens (`is_target[t]`: token t carries a loss)."""
    trained_ids = [i for i, t in zip(ex.ids, ex.is_target) if t]
    pieces = _pieces(ex.ids, ex.is_target, decode)
    return ExampleView(
        where=ex.where,
        text=ex.text,
        pieces=pieces,
        trained_text=decode(trained_ids),
        trained_spans=[text for text, trained in pieces if trained],
        num_tokens=len(ex.ids),
        num_trained=len(trained_ids),
    )


def inspect_data(cfg: Config, num_examples: int = 0, progress: Progress | None = None) -> DataReport:
    """Build `cfg`'s data as `train` would and report its statistics (both splits) and the first
    `num_examples` examples of the data file, in file order."""
    tok = _tokenizer(cfg)
    if progress:
        progress("building data", 0, None)
    train_ds, eval_ds, data_stats = build_datasets(cfg.data, tok, progress=progress)
    train_rows, eval_rows = _rows_of(train_ds, progress), _rows_of(eval_ds, progress)
    seq_len = cfg.data.seq_len
    train, eval_ = _split_stats(train_rows), _split_stats(eval_rows)
    stats = {
        "kind": cfg.data.kind,
        "path": cfg.data.path or ", ".join(s.path for s in cfg.data.sources),
        "tokenizer": tok.name,
        "seq_len": seq_len,
        "pack": cfg.data.pack,
        "bad_rows_skipped": data_stats.bad_lines_skipped,
        "truncated": data_stats.examples_truncated,
        "dropped": data_stats.examples_dropped,
        "format": data_stats.format,
        "sources": data_stats.sources,
        "train": train,
        "eval": eval_,
        "data_stats": data_stats.as_dict(),
    }
    decode = tok.decode_with_specials
    views = [example_view(ex, decode) for ex in itertools.islice(tokenize_rows(cfg.data, tok), num_examples)]
    return DataReport(stats=stats, examples=views)


# ----------------------------------------------------------------------------------------------------
# Rendering


def example_json(view: ExampleView) -> dict[str, Any]:
    """One example as JSON: where, text, trained_text, trained_spans, num_tokens, num_trained."""
    return {
        "where": view.where,
        "text": view.text,
        "trained_text": view.trained_text,
        "trained_spans": view.trained_spans,
        "num_tokens": view.num_tokens,
        "num_trained": view.num_trained,
    }


def examples_json(report: DataReport) -> list[dict[str, Any]]:
    return [example_json(v) for v in report.examples]


def _source_lines(stats: dict[str, Any]) -> list[tuple[str, str]]:
    """One line per source of data.sources: what it was asked for and what it gave."""
    return [
        (
            f"source {i}",
            f"{row['path']} ({row['kind']}): weight {row['share_wanted']:.0%} -> {row['examples_drawn']:,} of "
            f"{row['train_examples']:,} examples (x{row['repeats']:g}), {row['tokens']:,} tokens; realised "
            f"{row['share_examples']:.1%} of examples, {row['share_tokens']:.1%} of tokens",
        )
        for i, row in enumerate(stats["sources"])
    ]


def _dropped(stats: dict[str, Any]) -> str:
    ds = stats["data_stats"]
    note = DataStats(**ds).too_long_note(stats["seq_len"]) if ds["dropped_too_long"] else ""
    return f"{stats['dropped']:,}" + (f" ({note})" if note else "")


def _stat_lines(stats: dict[str, Any]) -> list[tuple[str, str]]:
    tr, ev = stats["train"], stats["eval"]
    keeps_95 = stats["data_stats"]["seq_len_keeps_95"]
    return [
        ("data", f"{stats['kind']}" + (f" ({stats['path']})" if stats["path"] else "")),
        *([("format", stats["format"])] if stats["format"] else []),
        *_source_lines(stats),
        ("tokenizer", str(stats["tokenizer"])),
        ("examples", f"{tr['examples']:,} train / {ev['examples']:,} eval"),
        (
            "rows",
            f"{tr['rows']:,} train / {ev['rows']:,} eval of {stats['seq_len']} tokens"
            f" ({'packed' if stats['pack'] else 'one example per row'})",
        ),
        ("tokens", f"{tr['tokens']:,} train, {tr['trained_tokens']:,} trained ({tr['trained_share']:.1%})"),
        ("length", f"min {tr['length_min']}, mean {tr['length_mean']:.1f}, max {tr['length_max']} tokens"),
        *([("95% fit whole in", f"data.seq_len = {keeps_95}")] if keeps_95 else []),
        ("truncated", f"{stats['truncated']:,}"),
        ("dropped", _dropped(stats)),
        ("bad rows skipped", f"{stats['bad_rows_skipped']:,}"),
    ]


def _bar(count: int, most: int, char: str) -> str:
    return char * max(1 if count else 0, round(BAR_WIDTH * count / most)) if most else ""


def render_plain(report: DataReport) -> str:
    """Statistics, the train length histogram and the examples as plain text (trained spans in ⟦ ⟧)."""
    lines = [f"{name:<17} {value}" for name, value in _stat_lines(report.stats)]
    hist = report.stats["train"]["length_histogram"]
    most = max((b["count"] for b in hist), default=0)
    lines += ["", "train example lengths (tokens)"]
    lines += [f"{b['lo']:>6}-{b['hi']:<6} {b['count']:>8,} {_bar(b['count'], most, '#')}" for b in hist]
    for view in report.examples:
        lines += ["", f"--- {view.where} ({view.num_tokens} tokens, {view.num_trained} trained) ---"]
        lines.append(
            "".join(f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}" if trained else text for text, trained in view.pieces)
        )
    return "\n".join(lines) + "\n"


def render_terminal(report: DataReport, console: Any) -> None:
    """The same on a rich console: a table, bars, and trained tokens highlighted."""
    from rich.table import Table
    from rich.text import Text

    table = Table(show_header=False, box=None)
    for name, value in _stat_lines(report.stats):
        table.add_row(Text(name, style="bold"), Text(value))
    console.print(table)
    hist = report.stats["train"]["length_histogram"]
    most = max((b["count"] for b in hist), default=0)
    console.print(Text("\ntrain example lengths (tokens)", style="bold"))
    for b in hist:
        console.print(
            Text(f"{b['lo']:>6}-{b['hi']:<6} {b['count']:>8,} ") + Text(_bar(b["count"], most, "█"), style="cyan")
        )
    for view in report.examples:
        console.rule(Text(f"{view.where} · {view.num_tokens} tokens, {view.num_trained} trained (highlighted)"))
        console.print(
            Text.assemble(*((text, "bold black on green" if trained else "dim") for text, trained in view.pieces))
        )


@contextlib.contextmanager
def console_progress(console: Any) -> Iterator[Progress | None]:
    """A bar with counts, elapsed time and time remaining on `console` while the data builds (nothing when
    it is not a terminal). Transient: it leaves no trace in the output."""
    with live_progress(console, True, "building data") as progress:
        yield progress
