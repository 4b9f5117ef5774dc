"""Instruction, chat and synthetic data -> rows in the token cache (memory-mapped), as text corpora are.

A builder (`instruction_documents`, `chat_documents`, `synthetic_documents`) reads and tokenises the
examples into `Documents`: both splits as compact int32 documents, the training ones already in packing
order (a seeded shuffle), plus the held-out prompt/response pairs for exact-match evaluation and the
counts. `build_record_datasets` packs them a million token slots at a time into an entry of the token
cache (token_cache.py) and maps it. The entry's key covers the data files' bytes, the tokenizer, the chat
template's text and every data setting that shapes rows, so a second run on the same data reuses the
rows without reading the file again, and a run's rows stay out of its resident memory (and are shared by
the DataLoader's workers and the ranks of a job through the page cache).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tracetrain.config import DataSection
from tracetrain.data.files import data_digest, require_data_path
from tracetrain.data.packing import IGNORE_INDEX, PAD_DOCUMENT, DataStats, Documents, PackedDataset, iter_packed_rows
from tracetrain.data.token_cache import entry_key, open_or_build, row_writers, write_rows
from tracetrain.data.tokenizer import Tokenizer
from tracetrain.progress import Progress

DocumentsBuilder = Callable[[DataSection, Tokenizer], Documents]

# Data settings that do not change the rows: the loader's, and the files (which enter as digests).
_NOT_IN_KEY = frozenset({"path", "eval_path", "sources", "tokenizer", "num_workers", "pin_memory", "prefetch_factor"})


def _entry_key(data: DataSection, tok: Tokenizer, progress: Progress | None) -> str:
    from tracetrain.data.chat import resolve_chat_template  # chat.py imports packing, as this module does

    parts: dict[str, Any] = {k: v for k, v in dataclasses.asdict(data).items() if k not in _NOT_IN_KEY}
    for key, path, split in (("path", data.path, data.split), ("eval_path", data.eval_path, data.eval_split)):
        used = path and data.kind != "synthetic"
        parts[key] = [Path(path).suffix.lower(), data_digest(path, f"data.{key}", split, progress)] if used else ""
    parts["sources"] = [
        [
            {k: v for k, v in dataclasses.asdict(s).items() if k != "path"},
            Path(s.path).suffix.lower(),
            data_digest(s.path, f"data.sources[{i}].path", s.split or data.split, progress),
        ]
        for i, s in enumerate(data.sources)
    ]
    parts["tokenizer"] = tok.fingerprint()
    chat = data.kind in ("chat", "preference") or any(s.kind == "chat" for s in data.sources)
    parts["chat_template_text"] = resolve_chat_template(data, tok) if chat else ""
    return entry_key(parts)


def build_record_datasets(
    data: DataSection,
    tok: Tokenizer,
    builder: DocumentsBuilder,
    cache_dir: str | Path | None = None,
    progress: Progress | None = None,
) -> tuple[PackedDataset, PackedDataset, DataStats]:
    """(train, eval, stats) of `data` through `builder`, rows memory-mapped from an entry of `cache_dir`
    (reused while the data, tokenizer and settings are unchanged), or from temporary files deleted once
    mapped when `cache_dir` is None."""
    named = [("data.path", data.path), ("data.eval_path", data.eval_path)]
    named += [(f"data.sources[{i}].path", s.path) for i, s in enumerate(data.sources)]
    for name, path in named:
        if path and data.kind != "synthetic":
            require_data_path(path, name)  # before hashing it: one line, as reading it would say
    key = _entry_key(data, tok, progress) if cache_dir is not None else ""

    def build(folder: Path) -> dict[str, Any]:
        return _write_entry(builder(data, tok), data, tok.pad_id, folder, progress)

    splits, meta, _ = open_or_build(cache_dir, key, build, kind=data.kind)
    examples = [(prompt, response) for prompt, response in meta["eval_examples"]]
    train = PackedDataset(splits["train"], name="train")
    return train, PackedDataset(splits["eval"], examples=examples, name="eval"), DataStats(**meta["stats"])


def _write_entry(
    docs: Documents, data: DataSection, pad_id: int, folder: Path, progress: Progress | None
) -> dict[str, Any]:
    """Pack both splits into `folder`'s row files, chunk by chunk; the entry's meta."""
    stats, rows = docs.stats, {}
    for split, split_docs in (("train", docs.train), ("eval", docs.eval)):
        written = 0
        with row_writers(folder, split) as out:
            # Preference documents come in pairs (chosen, rejected) that must share a row.
            group = 2 if data.kind == "preference" else 1
            for chunk in iter_packed_rows(split_docs, data.seq_len, pad_id, data.pack, group=group):
                write_rows(out, chunk)
                written += len(chunk["input_ids"])
                if split == "train":
                    stats.train_tokens += int((chunk["document_ids"] != PAD_DOCUMENT).sum())
                    stats.train_target_tokens += int((chunk["labels"] != IGNORE_INDEX).sum())
                if progress:
                    progress(f"packing {split} rows", written, None, "rows")
        rows[split] = written
    stats.train_sequences, stats.eval_sequences, stats.seq_len = rows["train"], rows["eval"], data.seq_len
    return {"rows": rows, "seq_len": data.seq_len, "stats": stats.as_dict(), "eval_examples": docs.eval_examples}
