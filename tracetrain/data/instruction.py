"""Instruction data: rows of a data file (see files.py) -> prompt/response pairs -> tokenised, loss-masked documents.

One document per example:

    BOS  prompt tokens  response tokens  EOS
         (no loss)      (loss)           (loss)      <- unless data.train_on_prompt

(BOS only when the tokenizer adds one, `tok.add_bos`.)

The prompt and the response are tokenised separately, so the boundary between "no loss" and "loss"
is exact even for BPE tokenizers (a merge across the boundary would otherwise blur it).

An example longer than `seq_len` keeps its whole prompt and as much of the response as fits (no EOS:
the answer did not end there); if not even one response token fits, it is dropped. Both are counted.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from tracetrain.config import DataSection

# open_data_file is re-exported: models/generate.py imports it from here.
from tracetrain.data.files import open_data_file, read_rows  # noqa: F401
from tracetrain.data.formats import RowFields, resolve_fields
from tracetrain.data.packing import DataStats, Document, Documents, compact_document
from tracetrain.data.tokenizer import Tokenizer
from tracetrain.errors import DataError

T = TypeVar("T")  # an example, a document or a preference pair: what a data kind reads

# (prompt_text, response_text): the prompt already has its template applied.
Example = tuple[str, str]

# Stanford Alpaca's two prompt preambles, with and without an input.
_ALPACA_INTRO = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request."
)
_ALPACA_INTRO_CONTEXT = (
    "Below is an instruction that describes a task, paired with an input that provides "
    "further context. Write a response that appropriately completes the request."
)


def format_prompt(template: str, instruction: str, context: str = "") -> str:
    """The prompt text for one example; the response follows it directly."""
    if template == "alpaca":
        if context:
            return (
                f"{_ALPACA_INTRO_CONTEXT}\n\n### Instruction:\n{instruction}\n\n"
                f"### Input:\n{context}\n\n### Response:\n"
            )
        return f"{_ALPACA_INTRO}\n\n### Instruction:\n{instruction}\n\n### Response:\n"
    if template == "plain":
        return f"{instruction}\n{context}\n" if context else f"{instruction}\n"
    if template == "chatml":
        user = f"{instruction}\n\n{context}" if context else instruction
        return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    raise ValueError(f"unknown template {template!r}")  # config validation rules this out


def string_fields(row: dict[str, Any], required: list[str], optional: list[str]) -> dict[str, str]:
    """The named string fields of one row; DataError with the reason (the caller adds the location).

    An optional field that is absent or null reads as ''.
    """
    out = {}
    for name in required + optional:
        value = row.get(name)
        if value is None and name in optional:
            value = ""
        if name not in row and name in required:
            present = ", ".join(map(repr, row)) or "none"
            raise DataError(f"missing field {name!r} (fields present: {present})")
        if not isinstance(value, str):
            raise DataError(f"field {name!r} is {type(value).__name__}, expected a string")
        out[name] = value
    return out


def read_instruction_file(
    path: str, key: str, data: DataSection, split: str = "train"
) -> tuple[list[Example], int, RowFields]:
    """A data file -> (templated examples, bad rows skipped, the row format read), fields by `data.format`."""
    examples, bad, fields = read_located_examples(path, key, data, split)
    return [ex for _, ex in examples], bad, fields


def read_located_examples(
    path: str, key: str, data: DataSection, split: str = "train"
) -> tuple[list[tuple[str, Example]], int, RowFields]:
    """As `read_instruction_file`, each example with its location ("file:LINE" / "file: row N")."""
    resolved: list[RowFields] = []  # decided once, from the first readable row

    def parse(row: dict[str, Any]) -> Example:
        if not resolved:
            resolved.append(resolve_fields(data, row, key))
        f = resolved[0]
        r = string_fields(row, [f.instruction, f.response], [f.context] if f.context else [])
        return format_prompt(data.template, r[f.instruction], r.get(f.context, "")), r[f.response]

    examples, bad = read_rows(path, key, parse, data.skip_bad_lines, split)
    return examples, bad, resolved[0]  # read_rows raises when no row was usable


def tokenize_example(example: Example, tok: Tokenizer, train_on_prompt: bool) -> tuple[list[int], list[bool]]:
    """(ids, is_target) of one whole example: [BOS] prompt response EOS, loss on response + EOS."""
    p, r = tok.encode(example[0]), tok.encode(example[1])
    bos = [tok.bos_id] if tok.add_bos else []
    return bos + p + r + [tok.eos_id], [False] * len(bos) + [train_on_prompt] * len(p) + [True] * (len(r) + 1)


def held_out_split(num_examples: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, eval indices): `fraction` of the examples, at least one when fraction > 0."""
    num_eval = round(num_examples * fraction)
    if fraction > 0 and num_examples >= 2:
        num_eval = min(max(num_eval, 1), num_examples - 1)
    order = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed)).tolist()
    return order[num_eval:], order[:num_eval]


def train_and_eval(
    data: DataSection, items: list[T], read_eval: Callable[[str, str, str], list[T]]
) -> tuple[list[T], list[T]]:
    """(train, eval) of the `items` read from data.path: all of them and `read_eval(data.eval_path,
    "data.eval_path", data.eval_split)` when data.eval_path is set, else data.eval_fraction of them held out
    (`held_out_split`, seeded by data.seed)."""
    if data.eval_path:
        return items, read_eval(data.eval_path, "data.eval_path", data.eval_split)
    train_idx, eval_idx = held_out_split(len(items), data.eval_fraction, data.seed)
    return [items[i] for i in train_idx], [items[i] for i in eval_idx]


ENCODE_BATCH = 4096  # examples tokenised at a time: token lists for a batch, compact arrays after


# (whole lengths of every example read, whole lengths of those dropped for length), in tokens
LengthLog = tuple[list[int], list[int]]


def tokenize_examples(
    examples: list[Example],
    tok: Tokenizer,
    seq_len: int,
    train_on_prompt: bool,
    stats: DataStats,
    lengths: LengthLog | None = None,
) -> tuple[list[Document], list[Example]]:
    """Examples -> (documents as int32 arrays, the examples kept); truncations and drops are counted in
    `stats`, and whole lengths appended to `lengths` (for `DataStats.record_lengths`)."""
    docs: list[Document] = []
    kept: list[Example] = []
    bos = [tok.bos_id] if tok.add_bos else []
    all_lengths, dropped_lengths = lengths if lengths is not None else ([], [])
    for start in range(0, len(examples), ENCODE_BATCH):
        batch = examples[start : start + ENCODE_BATCH]
        prompts = tok.encode_batch([p for p, _ in batch])
        responses = tok.encode_batch([r for _, r in batch])
        for example, p, r in zip(batch, prompts, responses):
            whole = len(bos) + len(p) + len(r) + 1  # [BOS] prompt response EOS
            all_lengths.append(whole)
            room = seq_len - len(bos) - len(p)  # tokens left for the response after [BOS] + prompt
            if not example[1].strip() or room <= 0:
                stats.examples_dropped += 1
                if room <= 0:
                    dropped_lengths.append(whole)
                continue
            target = r + [tok.eos_id]
            if len(target) > room:
                target = target[:room]
                stats.examples_truncated += 1
            ids = bos + p + target
            is_target = [False] * len(bos) + [train_on_prompt] * len(p) + [True] * len(target)
            docs.append(compact_document(ids, is_target))
            kept.append(example)
    return docs, kept


def examples_documents(
    train_examples: list[Example],
    eval_examples: list[Example],
    tok: Tokenizer,
    data: DataSection,
    stats: DataStats,
    source: str,
) -> Documents:
    """Tokenise both splits and shuffle (seeded) the training documents; `source` names the data in errors."""
    lengths: LengthLog = ([], [])
    train_docs, train_kept = tokenize_examples(train_examples, tok, data.seq_len, data.train_on_prompt, stats, lengths)
    eval_docs, eval_kept = tokenize_examples(eval_examples, tok, data.seq_len, data.train_on_prompt, stats, lengths)
    stats.record_lengths(*lengths)
    if not train_docs:
        empty = stats.examples_dropped - stats.dropped_too_long
        reasons = [stats.too_long_note(data.seq_len)] if stats.dropped_too_long else []
        reasons += [f"{empty} with an empty response"] if empty else []
        raise DataError(
            f"{source}: no usable training examples ({stats.examples_read} read, every training example "
            f"dropped; {'; '.join(reasons)})"
        )
    stats.train_examples, stats.eval_examples = len(train_kept), len(eval_kept)
    # Packing is greedy in order, so shuffle first: neighbouring file lines are often near-duplicates.
    order = torch.randperm(len(train_docs), generator=torch.Generator().manual_seed(data.seed)).tolist()
    return Documents([train_docs[i] for i in order], eval_docs, eval_kept, stats)


def instruction_splits(
    data: DataSection, stats: DataStats, key: str = "data.path"
) -> tuple[list[Example], list[Example]]:
    """`data.kind = "instruction"`: the (train, eval) examples of the data file(s); reading is counted in
    `stats`. `key` names data.path in messages (a source of data.sources passes its own)."""
    examples, stats.bad_lines_skipped, fields = read_instruction_file(data.path, key, data, data.split)
    stats.format = fields.describe()

    def read_eval(path: str, key: str, split: str) -> list[Example]:
        eval_examples, bad, _ = read_instruction_file(path, key, data, split)
        stats.bad_lines_skipped += bad
        return eval_examples

    train_examples, eval_examples = train_and_eval(data, examples, read_eval)
    stats.examples_read = len(train_examples) + len(eval_examples)
    return train_examples, eval_examples


def instruction_documents(data: DataSection, tok: Tokenizer, key: str = "data.path") -> Documents:
    """`data.kind = "instruction"`: data file(s) -> both splits' documents (`record_rows` packs them)."""
    stats = DataStats()
    train_examples, eval_examples = instruction_splits(data, stats, key)
    return examples_documents(train_examples, eval_examples, tok, data, stats, data.path)


def encode_prompt(tok: Tokenizer, prompt: str) -> list[int]:
    """The ids a model is given to generate a response: [BOS] + prompt, as in training."""
    return ([tok.bos_id] if tok.add_bos else []) + tok.encode(prompt)


_FINAL_NUMBER = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


def _final_number(text: str) -> float | None:
    match = _FINAL_NUMBER.search(text)
    return float(match.group(1).replace(",", "")) if match else None


def exact_match(prediction: str, reference: str, kind: str) -> bool:
    """Is a generated response right? GSM8K-style references (`#### <number>`) compare final numbers;
    everything else (the synthetic task included) compares stripped strings."""
    if kind != "synthetic" and "####" in reference:
        ref = _final_number(reference)
        if ref is not None:
            return _final_number(prediction) == ref
    return prediction.strip() == reference.strip()
