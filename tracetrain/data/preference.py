"""Preference data (`data.kind = "preference"`): rows of prompt / chosen / rejected -> pairs of documents.

A row takes one of these forms (TRL's field names):

    {"prompt": "...", "chosen": "...", "rejected": "..."}                  strings, used as written
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}  chat, rendered with the chat template
    {"chosen": [messages], "rejected": [messages]}                        chat; the prompt is the leading
                                                                          messages both sides share

(with a message-list prompt, a string chosen / rejected is one assistant message). Each side becomes a
document `[BOS] prompt completion` whose loss is on the completion only:

- strings: the prompt and the completion are tokenised separately (the boundary is exact, as in TRL's
  DPOTrainer) and the completion ends with EOS;
- chat: the prompt is rendered with the generation prompt, the completion is what the whole
  conversation renders after it (end-of-turn tokens included); a template whose prompt rendering is not
  a prefix of the conversation's is a bad row.

The two documents of a pair are packed side by side into one row (packing.py `group`), so a pair is
never split across micro-batches or ranks, and the document mask keeps them from seeing each other.
Each side is therefore cut to `data.seq_len // 2` tokens: the prompt whole and the completion truncated
(counted in `examples_truncated`); a pair whose prompt alone fills half a row is dropped (counted).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tracetrain.config import DataSection
from tracetrain.data.chat import checked_messages, render_messages
from tracetrain.data.files import ReadPosition, iter_rows
from tracetrain.data.instruction import train_and_eval
from tracetrain.data.packing import DataStats, Document, Documents, TokenizedExample, compact_document
from tracetrain.data.tokenizer import Tokenizer
from tracetrain.errors import DataError

FIELDS = ("prompt", "chosen", "rejected")
# (prompt, chosen, rejected): three strings, or (prompt messages, chosen messages, rejected messages)
Pair = tuple[Any, Any, Any]


def parse_pair(row: dict[str, Any]) -> Pair:
    """A row -> (prompt, chosen, rejected) as strings or message lists; DataError with the reason."""
    missing = [f for f in ("chosen", "rejected") if f not in row]
    if missing:
        present = ", ".join(map(repr, row)) or "none"
        raise DataError(
            f"missing field {missing[0]!r} (fields present: {present}); preference rows need "
            "prompt / chosen / rejected (strings or chat messages)"
        )
    if "prompt" not in row:  # implicit prompt: whole conversations sharing their leading messages
        return _split_conversations(
            checked_messages(row["chosen"], "chosen"), checked_messages(row["rejected"], "rejected")
        )
    prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    if isinstance(prompt, str):
        for name, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, str):
                raise DataError(f"field {name!r} is {type(value).__name__}; with a string prompt it must be a string")
        if not chosen.strip() or not rejected.strip():
            raise DataError("field 'chosen' or 'rejected' is empty")
        return prompt, chosen, rejected
    return (
        checked_messages(prompt, "prompt"),
        _completion_messages(chosen, "chosen"),
        _completion_messages(rejected, "rejected"),
    )


def _completion_messages(value: Any, name: str) -> list[dict[str, Any]]:
    if isinstance(value, str):
        value = [{"role": "assistant", "content": value}]
    return checked_messages(value, name)


def _split_conversations(chosen: list[dict[str, Any]], rejected: list[dict[str, Any]]) -> Pair:
    """Whole conversations -> (their shared leading messages, chosen's rest, rejected's rest)."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise DataError("without a 'prompt' field, 'chosen' and 'rejected' must share their leading (prompt) messages")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _side_tokens(data: DataSection, tok: Tokenizer, prompt: Any, completion: Any) -> tuple[list[int], list[int], str]:
    """(prompt ids with BOS, completion ids, the side's text) of one side of a pair."""
    if isinstance(prompt, str):
        p_text, c_text = prompt, completion
        c_ids = tok.encode(completion) + [tok.eos_id]
    else:
        p_text = render_messages(data, tok, prompt, add_generation_prompt=True)
        full = render_messages(data, tok, prompt + completion)
        if not full.startswith(p_text) or len(full) == len(p_text):
            raise DataError(
                f"the chat template ({data.chat_template}) does not render the prompt as a prefix of the "
                "whole conversation, so the completion cannot be located"
            )
        c_text = full[len(p_text) :]
        c_ids = tok.encode(c_text)
    p_ids = tok.encode(p_text)
    bos_text = tok.bos_text
    if tok.add_bos and not (bos_text and p_text.startswith(bos_text)):
        p_ids = [tok.bos_id] + p_ids
    return p_ids, c_ids, p_text + c_text


def tokenize_pair(data: DataSection, tok: Tokenizer, pair: Pair, stats: DataStats) -> list[TokenizedExample] | None:
    """(chosen, rejected) as TokenizedExamples, each cut to `data.seq_len // 2`; None (counted) when a
    prompt alone fills that."""
    half = data.seq_len // 2
    sides = []
    for completion in pair[1:]:
        p_ids, c_ids, text = _side_tokens(data, tok, pair[0], completion)
        room = half - len(p_ids)
        if room <= 0 or not c_ids:
            stats.examples_dropped += 1
            return None
        if len(c_ids) > room:
            c_ids = c_ids[:room]
            stats.examples_truncated += 1
        mask = [data.train_on_prompt] * len(p_ids) + [True] * len(c_ids)
        sides.append(TokenizedExample("", text, p_ids + c_ids, mask))
    return sides


def iter_pairs(
    data: DataSection, tok: Tokenizer, path: str, key: str, stats: DataStats, split: str = "train"
) -> Iterator[tuple[str, list[TokenizedExample]]]:
    """(where, [chosen, rejected]) for every usable pair of `path`; a bad row raises DataError
    `<where>: <reason>`, or with `data.skip_bad_lines` is counted in `stats.bad_lines_skipped`."""
    position = ReadPosition()
    for where, pair in iter_rows(path, key, parse_pair, data.skip_bad_lines, position, split):
        try:
            sides = tokenize_pair(data, tok, pair, stats)
        except DataError as e:
            if not data.skip_bad_lines:
                raise DataError(f"{where}: {e}") from None
            stats.bad_lines_skipped += 1
            continue
        if sides is not None:
            yield where, [TokenizedExample(where, s.text, s.ids, s.is_target) for s in sides]
    stats.bad_lines_skipped += position.bad


def preference_documents(data: DataSection, tok: Tokenizer, key: str = "data.path") -> Documents:
    """`data.kind = "preference"`: pairs -> both splits' documents, chosen then rejected of each pair
    (`record_rows` packs them two by two)."""
    stats = DataStats()

    def pairs(path: str, key: str, split: str) -> list[tuple[Document, Document]]:
        out: list[tuple[Document, Document]] = []
        for _, (c, r) in iter_pairs(data, tok, path, key, stats, split):
            out.append((compact_document(c.ids, c.is_target), compact_document(r.ids, r.is_target)))
        return out

    read = pairs(data.path, key, data.split)
    train, eval_ = train_and_eval(data, read, pairs)
    if not train:
        raise DataError(
            f"{data.path}: no usable preference pairs ({stats.examples_dropped} with a prompt that fills "
            f"data.seq_len // 2 = {data.seq_len // 2} tokens; config key '{key}')"
        )
    stats.examples_read = len(read) + (len(eval_) if data.eval_path else 0)
    stats.train_examples, stats.eval_examples = len(train), len(eval_)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(data.seed)).tolist()
    flat = lambda ps: [doc for pair in ps for doc in pair]  # noqa: E731
    return Documents(flat([train[i] for i in order]), flat(eval_), [], stats)
