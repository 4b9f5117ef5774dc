"""Data pipeline: packing, loss masks, bad-data errors, splits, the synthetic task, text corpora and the
resumable loader. Expected values are worked out by hand or from the raw text, never from the code."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tracetrain.config import DataSection
from tracetrain.data import (
    ByteTokenizer,
    PackedDataset,
    build_datasets,
    build_loader,
    exact_match,
    format_prompt,
    generate_examples,
    iter_batches,
    load_tokenizer,
)
from tracetrain.data.packing import pack_documents, shift_labels
from tracetrain.errors import DataError

TOK = ByteTokenizer()
BOS, EOS, PAD = 256, 257, 258


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def qa(n: int, prefix: str = "q") -> list[dict]:
    return [{"instruction": f"{prefix}{i}", "context": "", "response": f"answer {i}"} for i in range(n)]


def data_cfg(**kw) -> DataSection:
    kw.setdefault("kind", "instruction")
    kw.setdefault("template", "plain")
    kw.setdefault("seq_len", 64)
    return DataSection(**kw)


def segments(row: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    """[start, end) of each non-padding document in a row, from document_ids."""
    doc = row["document_ids"].tolist()
    out, start = [], 0
    for i in range(1, len(doc) + 1):
        if i == len(doc) or doc[i] != doc[start]:
            if doc[start] != -1:
                out.append((start, i))
            start = i
    return out


# ---------------------------------------------------------------------------------------------------
# Packing

def test_pack_documents_hand_worked() -> None:
    # Three documents of 3, 4, 2 tokens into rows of 6: the second does not fit after the first, so
    # row 0 = doc0 + 3 pads, row 1 = doc1 + doc2 (exactly full).
    docs = [([1, 2, 3], [2, 3, -100]), ([4, 5, 6, 7], [-100, 6, 7, -100]), ([8, 9], [9, -100])]
    rows = pack_documents(docs, seq_len=6, pad_id=0, pack=True)
    assert rows["input_ids"].tolist() == [[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 9]]
    assert rows["labels"].tolist() == [[2, 3, -100, -100, -100, -100], [-100, 6, 7, -100, 9, -100]]
    assert rows["position_ids"].tolist() == [[0, 1, 2, 0, 0, 0], [0, 1, 2, 3, 0, 1]]
    assert rows["document_ids"].tolist() == [[0, 0, 0, -1, -1, -1], [0, 0, 0, 0, 1, 1]]
    assert all(t.dtype == torch.int64 for t in rows.values())
    unpacked = pack_documents(docs, seq_len=6, pad_id=0, pack=False)
    assert unpacked["input_ids"].tolist() == [[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 0, 0], [8, 9, 0, 0, 0, 0]]


def test_shift_labels() -> None:
    assert shift_labels([10, 11, 12, 13], [False, False, True, True]) == [-100, 12, 13, -100]
    assert shift_labels([10, 11, 12], [False, True, True]) == [11, 12, -100]


def test_instruction_rows_structure_and_response_only_loss(tmp_path: Path) -> None:
    records = [{"instruction": f"task {i}", "context": "ctx" if i % 2 else "", "response": "r" * (i % 7 + 1)}
               for i in range(40)]
    cfg = data_cfg(path=write_jsonl(tmp_path / "d.jsonl", records), eval_fraction=0.0, seq_len=48)
    train, eval_, stats = build_datasets(cfg, TOK)
    assert len(eval_) == 0 and stats.train_examples == 40
    assert train.rows["input_ids"].shape == (len(train), 48)
    wanted = {("task %d\n" % i + ("ctx\n" if i % 2 else ""), r["response"]) for i, r in enumerate(records)}
    seen = set()
    for i in range(len(train)):
        row = train[i]
        ids, labels, pos = row["input_ids"].tolist(), row["labels"].tolist(), row["position_ids"].tolist()
        segs = segments(row)
        assert len(segs) >= 1
        for k, (s, e) in enumerate(segs):
            assert row["document_ids"][s:e].eq(k).all()  # numbered 0, 1, ... within the row
            assert pos[s:e] == list(range(e - s))
            assert ids[s] == BOS and ids[e - 1] == EOS  # whole example in this row: never split
            assert labels[e - 1] == -100
            targets = [ids[t + 1] for t in range(s, e - 1) if labels[t] != -100]
            assert [labels[t] for t in range(s, e - 1) if labels[t] != -100] == targets
            text = TOK.decode(ids[s:e])
            response = TOK.decode(targets)
            assert targets[-1] == EOS
            seen.add((text[: len(text) - len(response)], response))
        pad_start = segs[-1][1]
        assert ids[pad_start:] == [PAD] * (48 - pad_start)
        assert set(labels[pad_start:]) <= {-100} and set(row["document_ids"][pad_start:].tolist()) <= {-1}
    assert seen == wanted  # every example exactly once, loss exactly on its response (+ EOS)


def test_train_on_prompt_puts_loss_on_every_token_after_bos(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", qa(5))
    base = data_cfg(path=path, eval_fraction=0.0, pack=False)
    masked, _, s1 = build_datasets(base, TOK)
    full, _, s2 = build_datasets(data_cfg(path=path, eval_fraction=0.0, pack=False, train_on_prompt=True), TOK)
    for i in range(len(full)):
        ids, labels = full[i]["input_ids"].tolist(), full[i]["labels"].tolist()
        n = ids.index(EOS) + 1
        assert labels[: n - 1] == ids[1:n] and labels[n - 1] == -100
    # "q3\n" is 3 prompt tokens per example that now also carry loss.
    assert s2.train_target_tokens - s1.train_target_tokens == 5 * len("q0\n")


def test_templates_in_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "Add.", "context": "2 and 3", "response": "5"}])
    for template, must_have in (("alpaca", "### Input:\n2 and 3\n\n### Response:\n5"),
                                ("chatml", "<|im_start|>user\nAdd.\n\n2 and 3<|im_end|>\n<|im_start|>assistant\n5"),
                                ("plain", "Add.\n2 and 3\n5")):
        train, _, _ = build_datasets(data_cfg(path=path, template=template, seq_len=256, eval_fraction=0), TOK)
        assert must_have in TOK.decode(train[0]["input_ids"].tolist())


def test_alpaca_template_is_stanford_alpacas_wording() -> None:
    assert format_prompt("alpaca", "Add.") == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\nAdd.\n\n### Response:\n")
    assert format_prompt("alpaca", "Add.", "2 and 3") == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n### Instruction:\nAdd.\n\n"
        "### Input:\n2 and 3\n\n### Response:\n")


# ---------------------------------------------------------------------------------------------------
# Truncation and bad data

def test_truncation_and_drops_are_counted(tmp_path: Path) -> None:
    records = [{"instruction": "hi", "response": "x" * 100},  # truncated: keeps BOS + "hi\n" + 12 x's
               {"instruction": "p" * 30, "response": "y"},  # prompt alone fills the row: dropped
               {"instruction": "ok", "response": "  "},  # empty response: dropped
               {"instruction": "ok", "response": "fine"}]
    cfg = data_cfg(path=write_jsonl(tmp_path / "d.jsonl", records), context_field="", seq_len=16,
                   eval_fraction=0.0, pack=False)
    train, _, stats = build_datasets(cfg, TOK)
    assert (stats.examples_read, stats.examples_truncated, stats.examples_dropped) == (4, 1, 2)
    rows = [TOK.decode(train[i]["input_ids"].tolist()) for i in range(len(train))]
    assert sorted(rows) == sorted(["hi\n" + "x" * 12, "ok\nfine"])
    long_row = next(train[i] for i in range(len(train)) if "x" in rows[i])
    assert EOS not in long_row["input_ids"].tolist()  # the answer did not end: no EOS to learn


def test_missing_file_names_path_and_key(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nothere\.jsonl.*data\.path"):
        build_datasets(data_cfg(path=str(tmp_path / "nothere.jsonl")), TOK)
    train = write_jsonl(tmp_path / "t.jsonl", qa(3))
    with pytest.raises(DataError, match=r"evalmissing\.jsonl.*data\.eval_path"):
        build_datasets(data_cfg(path=train, eval_path=str(tmp_path / "evalmissing.jsonl")), TOK)


def test_malformed_json_names_file_and_line(tmp_path: Path) -> None:
    # Line 2 is blank (ignored, but still counted), line 3 is cut short.
    lines = [*map(json.dumps, qa(1)), "", '{"instruction": "a",', *map(json.dumps, qa(2))]
    path = write_jsonl(tmp_path / "broken.jsonl", lines)
    with pytest.raises(DataError) as err:
        build_datasets(data_cfg(path=path), TOK)
    msg = str(err.value)
    assert "broken.jsonl:3:" in msg and "not valid JSON" in msg and "\n" not in msg


def test_missing_and_non_string_fields(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "f.jsonl", [*qa(2), {"instruction": "x", "answer": "y"}])
    expected = r"f\.jsonl:3: missing field 'response' \(fields present: 'instruction', 'answer'\)"
    with pytest.raises(DataError, match=expected):
        build_datasets(data_cfg(path=path), TOK)
    path = write_jsonl(tmp_path / "g.jsonl", [{"instruction": "x", "response": 7}])
    with pytest.raises(DataError, match=r"g\.jsonl:1: field 'response' is int"):
        build_datasets(data_cfg(path=path), TOK)
    path = write_jsonl(tmp_path / "h.jsonl", ["[1, 2]"])
    with pytest.raises(DataError, match=r"h\.jsonl:1: not a JSON object"):
        build_datasets(data_cfg(path=path), TOK)


def test_empty_file_and_all_bad(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl.*no usable examples"):
        build_datasets(data_cfg(path=str(path)), TOK)
    path = write_jsonl(tmp_path / "bad.jsonl", ["nope", "{}"])
    with pytest.raises(DataError, match=r"bad\.jsonl.*no usable examples"):
        build_datasets(data_cfg(path=path, skip_bad_lines=True), TOK)


def test_skip_bad_lines_counts(tmp_path: Path) -> None:
    lines = [*map(json.dumps, qa(6)), "{oops", json.dumps({"instruction": "only"}), json.dumps(["x"])]
    path = write_jsonl(tmp_path / "mixed.jsonl", lines)
    _, _, stats = build_datasets(data_cfg(path=path, skip_bad_lines=True, eval_fraction=0.0), TOK)
    assert (stats.bad_lines_skipped, stats.examples_read, stats.train_examples) == (3, 6, 6)


# ---------------------------------------------------------------------------------------------------
# Splits and determinism

def test_held_out_split(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", qa(100))
    train, eval_, stats = build_datasets(data_cfg(path=path, eval_fraction=0.1, seed=3), TOK)
    assert (stats.train_examples, stats.eval_examples) == (90, 10)
    held = {p for p, _ in eval_.examples}
    train_prompts = {TOK.decode(train[i]["input_ids"][s:e].tolist()).split("\n")[0] + "\n"
                     for i in range(len(train)) for s, e in segments(train[i])}
    assert len(train_prompts) == 90 and train_prompts.isdisjoint(held) and len(held) == 10
    _, eval2, _ = build_datasets(data_cfg(path=write_jsonl(tmp_path / "two.jsonl", qa(2)), eval_fraction=0.01), TOK)
    assert len(eval2.examples) == 1  # at least one when the fraction is > 0
    eval_path = write_jsonl(tmp_path / "e.jsonl", qa(4, prefix="held"))
    _, eval3, stats3 = build_datasets(data_cfg(path=path, eval_path=eval_path), TOK)
    assert [r for _, r in eval3.examples] == [f"answer {i}" for i in range(4)] and stats3.train_examples == 100


def test_same_seed_same_rows_different_seed_different(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", qa(200))
    a, _, _ = build_datasets(data_cfg(path=path, seed=1), TOK)
    b, _, _ = build_datasets(data_cfg(path=path, seed=1), TOK)
    c, _, _ = build_datasets(data_cfg(path=path, seed=2), TOK)
    assert torch.equal(a.rows["input_ids"], b.rows["input_ids"])
    assert not torch.equal(a.rows["input_ids"], c.rows["input_ids"])


# ---------------------------------------------------------------------------------------------------
# Synthetic task

def _solve(prompt: str) -> str:
    task, word = prompt.strip().split(": ")
    return {"reverse": word[::-1], "upper": word.upper(), "sort": "".join(sorted(word)),
            "double": "".join(c * 2 for c in word)}[task]


def test_synthetic_examples_are_correct_and_deterministic() -> None:
    ex = generate_examples(500, seed=7)
    assert ex == generate_examples(500, seed=7) and ex != generate_examples(500, seed=8)
    assert all(response == _solve(prompt) for prompt, response in ex)
    words = [p.strip().split(": ")[1] for p, _ in ex]
    assert len(set(words)) == 500 and all(3 <= len(w) <= 8 and w.isalpha() and w.islower() for w in words)
    assert {p.split(":")[0] for p, _ in ex} == {"reverse", "upper", "sort", "double"}


def test_synthetic_held_out_disjoint_from_train() -> None:
    cfg = DataSection(kind="synthetic", synthetic_examples=2000, eval_fraction=0.1, seed=5)
    train, eval_, stats = build_datasets(cfg, TOK)
    assert (stats.train_examples, stats.eval_examples) == (1800, 200) and len(eval_.examples) == 200
    train_words = set()
    for i in range(len(train)):
        row = train[i]
        for s, e in segments(row):
            train_words.add(TOK.decode(row["input_ids"][s:e].tolist()).split("\n")[0].split(": ")[1])
    assert len(train_words) == 1800
    assert train_words.isdisjoint(p.strip().split(": ")[1] for p, _ in eval_.examples)
    assert all(exact_match(_solve(p), r, "synthetic") for p, r in eval_.examples)


def test_exact_match() -> None:
    assert exact_match(" abc \n", "abc", "synthetic") and not exact_match("abd", "abc", "synthetic")
    ref = "She has 3 + 4 = 7 apples.\n#### 1,234"
    assert exact_match("Different working.\n#### 1234", ref, "instruction")
    assert exact_match("#### 1234.0", ref, "instruction")
    assert not exact_match("#### 1235", ref, "instruction")
    assert not exact_match("the answer is 1234", ref, "instruction")  # no final-answer marker


# ---------------------------------------------------------------------------------------------------
# Text corpora

def test_text_documents_rows_and_split(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    docs = ["first document " * 5, "second one\nwith two lines " * 3, "third"]
    path.write_text("\n<|endoftext|>\n".join(docs))
    train, eval_, stats = build_datasets(DataSection(kind="text", path=str(path), seq_len=16, eval_fraction=0.0), TOK)
    assert stats.examples_read == 3 and len(eval_) == 0 and eval_.examples == []
    ids = train.rows["input_ids"].flatten().tolist()
    labels = train.rows["labels"].flatten().tolist()
    stream = [t for t in ids if t != PAD]
    expected_docs = [docs[0] + "\n", docs[1] + "\n", docs[2]]  # the separator line and its newline go
    assert stream == sum(([BOS] + list(d.encode()) + [EOS] for d in expected_docs), [])
    for t in range(len(stream)):  # loss on every next token of the same document, across row cuts
        nxt = stream[t + 1] if t + 1 < len(stream) and stream[t] != EOS else -100
        assert labels[t] == nxt
    for i in range(len(train)):
        row = train[i]
        for s, e in segments(row):
            assert row["position_ids"][s:e].tolist() == list(range(e - s))
    # Held-out: the last 10% of tokens.
    tr, ev, _ = build_datasets(DataSection(kind="text", path=str(path), seq_len=16, eval_fraction=0.1), TOK)
    n_eval = round(len(stream) * 0.1)
    assert [t for t in ev.rows["input_ids"].flatten().tolist() if t != PAD] == stream[-n_eval:]
    assert [t for t in tr.rows["input_ids"].flatten().tolist() if t != PAD] == stream[:-n_eval]
    tr_labels = [l for t, l in zip(tr.rows["input_ids"].flatten().tolist(), tr.rows["labels"].flatten().tolist())
                 if t != PAD]
    assert stream[-n_eval - 1] != EOS and tr_labels[-1] == -100  # no target across the train/eval cut


def test_text_jsonl_unpacked(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "a" * 20}, {"text": "bb"}])
    train, _, _ = build_datasets(DataSection(kind="text", path=path, seq_len=8, eval_fraction=0.0, pack=False), TOK)
    # doc 0 = 22 tokens -> rows of 8, 8, 6+pad; doc 1 = 4 tokens -> its own row.
    assert len(train) == 4
    assert train[3]["input_ids"].tolist() == [BOS, 98, 98, EOS, PAD, PAD, PAD, PAD]


# ---------------------------------------------------------------------------------------------------
# Loader

def _rows(n: int, seq_len: int = 4) -> PackedDataset:
    ids = torch.arange(n * seq_len).view(n, seq_len)  # row i holds i*seq_len ...: identifies the row
    return PackedDataset({"input_ids": ids, "labels": ids, "position_ids": ids * 0, "document_ids": ids * 0})


def _row_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return (batch["input_ids"][:, 0] // batch["input_ids"].shape[1]).tolist()


def test_loader_epochs_are_permutations_and_seeded() -> None:
    cfg = DataSection()
    loader = build_loader(_rows(12), 4, cfg, seed=1)
    epochs = [sum((_row_ids(next(loader)) for _ in range(3)), []) for _ in range(3)]
    assert all(sorted(e) == list(range(12)) for e in epochs)
    assert epochs[0] != epochs[1]  # reshuffled each epoch
    again = build_loader(_rows(12), 4, cfg, seed=1)
    assert sum((_row_ids(next(again)) for _ in range(3)), []) == epochs[0]
    other = build_loader(_rows(12), 4, cfg, seed=2)
    assert sum((_row_ids(next(other)) for _ in range(3)), []) != epochs[0]
    ordered = build_loader(_rows(10), 4, cfg, seed=1, shuffle=False)
    assert [_row_ids(next(ordered)) for _ in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_state_round_trip(num_workers: int) -> None:
    cfg = DataSection(num_workers=num_workers, prefetch_factor=2 if num_workers == 0 else 3)
    ds = _rows(10)
    loader = build_loader(ds, 3, cfg, seed=11)
    for _ in range(4):  # 3 batches per epoch: this crosses into epoch 1
        next(loader)
    state = loader.state_dict()
    expected = [_row_ids(next(loader)) for _ in range(5)]
    resumed = build_loader(ds, 3, cfg, seed=11)
    resumed.load_state_dict(state)
    assert [_row_ids(next(resumed)) for _ in range(5)] == expected
    batch = next(resumed)
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids"}
    assert all(t.dtype == torch.int64 and t.shape == (3, 4) for t in batch.values())


def test_loader_rejects_too_few_rows_and_changed_data() -> None:
    with pytest.raises(DataError, match=r"5 rows .* batch of 8"):
        build_loader(_rows(5), 8, DataSection(), seed=0)
    with pytest.raises(DataError, match=r"0 rows"):
        build_loader(_rows(0), 1, DataSection(), seed=0)
    state = build_loader(_rows(10), 2, DataSection(), seed=0).state_dict()
    with pytest.raises(DataError, match="num_rows 10 -> 12"):
        build_loader(_rows(12), 2, DataSection(), seed=0).load_state_dict(state)


def test_iter_batches_keeps_last_partial_batch() -> None:
    batches = list(iter_batches(_rows(7), 3))
    assert [_row_ids(b) for b in batches] == [[0, 1, 2], [3, 4, 5], [6]]
    assert batches[0]["input_ids"].dtype == torch.int64


# ---------------------------------------------------------------------------------------------------
# Instruction data in the layouts of Dolly and GSM8K with a byte-level BPE (conftest's fixtures, built here)

@pytest.fixture(scope="module")
def bpe(bpe_json):
    return load_tokenizer(str(bpe_json))


def test_dolly_sample_loads(bpe, dolly_jsonl) -> None:
    cfg = data_cfg(path=str(dolly_jsonl), template="alpaca", seq_len=512, eval_fraction=0.1)
    train, eval_, stats = build_datasets(cfg, bpe)
    assert stats.examples_read == 20
    assert stats.train_examples + stats.eval_examples + stats.examples_dropped == 20
    assert len(eval_.examples) == stats.eval_examples >= 1
    first = bpe.decode(train[0]["input_ids"].tolist())
    assert "### Instruction:" in first and "### Response:" in first


def test_gsm8k_loads_quickly(bpe, gsm8k_jsonl) -> None:
    path = gsm8k_jsonl
    num_lines = sum(1 for line in path.open() if line.strip())
    cfg = data_cfg(path=str(path), instruction_field="question", response_field="answer", context_field="",
                   seq_len=512)
    start = time.perf_counter()
    train, eval_, stats = build_datasets(cfg, bpe)
    assert time.perf_counter() - start < 15
    assert stats.examples_read == num_lines and stats.bad_lines_skipped == 0
    assert all("####" in r for _, r in eval_.examples)
    assert all(exact_match(r, r, "instruction") for _, r in eval_.examples)
    row = train[0]
    targets = row["labels"][row["labels"] != -100].tolist()
    assert "####" in bpe.decode(targets)  # the loss covers the answers, final number included
