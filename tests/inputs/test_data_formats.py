"""`data.format`: Alpaca, Dolly and prompt/completion rows without field mapping; drops for length explained."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tracetrain.config import DataSection, load_config
from tracetrain.data import build_datasets, format_prompt, load_tokenizer, tokenize_rows
from tracetrain.data.inspect import inspect_data, render_plain
from tracetrain.errors import DataError

TOK = load_tokenizer("byte", "")


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def data(**kw: object) -> DataSection:
    return load_config(None, ["--data.kind=instruction", *(f"--data.{k}={json.dumps(v)}" for k, v in kw.items())]).data


ALPACA = [
    {"instruction": "Name a colour.", "input": "", "output": "Red."},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
]


def test_alpaca_rows_train_without_field_mapping(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "alpaca.jsonl", ALPACA)
    cfg = data(path=path, seq_len=512, eval_fraction=0.0)
    _, _, stats = build_datasets(cfg, TOK)
    assert stats.format == "alpaca (auto: instruction/input/output)"
    assert stats.train_examples == 2 and stats.examples_dropped == 0
    shown = list(tokenize_rows(cfg, TOK))
    # The standard Alpaca prompt without an input, then with one; the loss only on the response and EOS.
    assert shown[0].text == format_prompt("alpaca", "Name a colour.") + "Red."
    assert "### Input:\n2 and 3\n\n### Response:\n5" in shown[1].text
    assert "paired with an input" in shown[1].text and "paired with an input" not in shown[0].text
    for ex in shown:
        trained = bytes(i for i, t in zip(ex.ids, ex.is_target) if t and i < 256).decode()
        assert trained == ex.text[ex.text.index("### Response:\n") + len("### Response:\n") :]


@pytest.mark.parametrize(
    ("rows", "kw", "expected"),
    [
        ([{"instruction": "q", "context": "c", "response": "r"}], {}, "dolly (auto: instruction/context/response)"),
        ([{"prompt": "q", "completion": "r"}], {}, "prompt_completion (auto: prompt/completion)"),
        ([{"question": "q", "answer": "r"}], {"instruction_field": "question", "response_field": "answer"}, "fields"),
        ([{"instruction": "q", "input": "", "output": "r"}], {"format": "alpaca"}, "alpaca (instruction/input/output)"),
    ],
)
def test_formats_are_detected_or_named(tmp_path: Path, rows: list[dict], kw: dict, expected: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", rows * 4)
    _, _, stats = build_datasets(data(path=path, seq_len=512, **kw), TOK)
    assert stats.format.startswith(expected)
    assert stats.examples_read == 4


def test_named_format_that_does_not_match_says_which_field_is_missing(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ALPACA)
    with pytest.raises(DataError, match=r"d\.jsonl:1: missing field 'response' \(fields present: 'instruction'"):
        build_datasets(data(path=path, format="dolly"), TOK)


@pytest.mark.parametrize(
    ("row", "hint"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "it looks like chat data: set data.kind = 'chat'"),
        ({"text": "a document"}, "it looks like plain text: set data.kind = 'text'"),
        ({"q": "x", "a": "y"}, "name the fields with data.instruction_field / data.response_field"),
    ],
)
def test_unrecognised_rows_are_one_line_with_a_hint(tmp_path: Path, row: dict, hint: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(DataError) as e:
        build_datasets(data(path=path), TOK)
    assert str(e.value).startswith(f"{path}:1: data.format = 'auto' recognises no instruction format")
    assert hint in str(e.value) and "\n" not in str(e.value)


def long_alpaca(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "instruction": "Reverse the word " + "x" * int(rng.integers(1, 120)),
            "input": "",
            "output": "y" * int(rng.integers(1, 20)),
        }
        for _ in range(n)
    ]


def whole_lengths(rows: list[dict]) -> list[int]:
    """[BOS] + Alpaca prompt + response + EOS, in byte tokens."""
    return [2 + len(format_prompt("alpaca", r["instruction"]).encode()) + len(r["output"].encode()) for r in rows]


def test_alpaca_at_the_default_seq_len_says_the_prompt_is_longer(tmp_path: Path) -> None:
    rows = long_alpaca(60)
    path = write_jsonl(tmp_path / "alpaca.jsonl", rows)
    with pytest.raises(DataError) as e:
        build_datasets(data(path=path), TOK)  # data.seq_len = 128: the Alpaca preamble alone is 100+ bytes
    lengths = whole_lengths(rows)
    p50, p90, p95 = (int(np.ceil(np.percentile(lengths, q))) for q in (50, 90, 95))
    assert str(e.value) == (
        f"{path}: no usable training examples (60 read, every training example dropped; 60 with a prompt that "
        f"alone fills data.seq_len = 128 (their lengths: p50 {p50}, p90 {p90}, max {max(lengths)} tokens; "
        f"data.seq_len = {p95} would keep 95% of examples whole))"
    )


def test_partial_drops_are_counted_with_their_lengths(tmp_path: Path) -> None:
    rows = long_alpaca(80, seed=1)
    path = write_jsonl(tmp_path / "alpaca.jsonl", rows)
    seq_len = 220
    cfg = data(path=path, seq_len=seq_len, eval_fraction=0.0)
    _, _, stats = build_datasets(cfg, TOK)
    lengths = whole_lengths(rows)
    prompt_fills = [n for n, r in zip(lengths, rows) if n - len(r["output"]) - 1 >= seq_len]
    assert 0 < len(prompt_fills) < len(rows)
    assert stats.dropped_too_long == stats.examples_dropped == len(prompt_fills)
    assert stats.dropped_length_max == max(prompt_fills)
    assert stats.dropped_length_p50 == int(np.ceil(np.percentile(prompt_fills, 50)))
    assert stats.seq_len_keeps_95 == int(np.ceil(np.percentile(lengths, 95)))
    assert f"{len(prompt_fills)} dropped ({len(prompt_fills)} with a prompt that alone fills" in stats.summary()
    text = render_plain(
        inspect_data(
            load_config(
                None,
                [
                    f"--data.{k}={v}"
                    for k, v in (("kind", "instruction"), ("path", path), ("seq_len", seq_len), ("eval_fraction", 0.0))
                ],
            ),
            0,
        )
    )
    assert f"95% fit whole in  data.seq_len = {stats.seq_len_keeps_95}" in text
    assert "format            alpaca (auto: instruction/input/output)" in text


def test_generation_prompt_rows_read_the_alpaca_input() -> None:
    """A prompts file in the training data's format is templated as training templated it."""
    from tracetrain.data.prompts import prompt_record

    row = {"instruction": "Add the numbers.", "input": "2 and 3"}
    assert prompt_record(row, data(path="x.jsonl"))["text"] == format_prompt("alpaca", "Add the numbers.", "2 and 3")
    dolly = {"instruction": "Summarise.", "context": "A long text."}
    assert prompt_record(dolly, data(path="x.jsonl"))["text"] == format_prompt("alpaca", "Summarise.", "A long text.")
    named = data(path="x.jsonl", instruction_field="question", context_field="")
    assert prompt_record({"question": "Why?", "input": "x"}, named)["text"] == format_prompt("alpaca", "Why?")
