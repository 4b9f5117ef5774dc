"""Data files users have: JSONL, JSON arrays, Parquet and Hugging Face `datasets` folders give the same rows
for every data kind; bad rows name the file and the row; deeply nested JSON is a bad row, not a crash."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tracetrain.config import DataSection
from tracetrain.data import ByteTokenizer, build_datasets
from tracetrain.errors import DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

TOK = ByteTokenizer()

RECORDS = {
    "instruction": [{"instruction": f"task {i}", "context": "", "response": f"result {i}"} for i in range(9)],
    "chat": [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]}
             for i in range(9)],
    "text": [{"text": f"document number {i} " * 3} for i in range(9)],
}


def write(folder: Path, fmt: str, records: list[dict], name: str = "data") -> str:
    """`records` in format `fmt`; returns the path to give data.path."""
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif fmt == "json":
        path = folder / f"{name}.json"
        path.write_text(json.dumps(records, indent=1))
    elif fmt == "parquet":
        path = folder / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(records), path)
    elif fmt == "dataset":
        path = folder / name
        datasets.Dataset.from_list(records).save_to_disk(str(path))
    else:  # a DatasetDict: the "train" split is read
        path = folder / name
        ds = datasets.Dataset.from_list(records)
        datasets.DatasetDict({"test": ds.select([0]), "train": ds}).save_to_disk(str(path))
    return str(path)


def cfg(kind: str, path: str, **kw) -> DataSection:
    extra = {"chat_template": "chatml"} if kind == "chat" else {"template": "plain"} if kind == "instruction" else {}
    return DataSection(kind=kind, path=path, **{"seq_len": 64, "eval_fraction": 0.0, **extra, **kw})


@pytest.mark.parametrize("kind", list(RECORDS))
def test_every_format_gives_the_same_rows(tmp_path: Path, kind: str) -> None:
    reference, _, ref_stats = build_datasets(cfg(kind, write(tmp_path, "jsonl", RECORDS[kind])), TOK)
    assert ref_stats.examples_read == 9
    for fmt in ("json", "parquet", "dataset", "datasetdict"):
        train, _, stats = build_datasets(cfg(kind, write(tmp_path / fmt, fmt, RECORDS[kind])), TOK)
        assert stats.examples_read == 9, fmt
        assert all(torch.equal(train.rows[k], reference.rows[k]) for k in reference.rows), fmt


def test_text_field_and_plain_text_still_work(tmp_path: Path) -> None:
    path = write(tmp_path, "parquet", [{"body": "abc"}, {"body": "de"}])
    train, _, _ = build_datasets(cfg("text", path, text_field="body", seq_len=16), TOK)
    assert [t for t in train.rows["input_ids"][0].tolist() if t != 258] == [256, 97, 98, 99, 257, 256, 100, 101, 257]
    with pytest.raises(DataError, match=r"data.parquet: row 0: missing field 'text' \(fields present: 'body'\)"):
        build_datasets(cfg("text", path), TOK)
    plain = tmp_path / "corpus.txt"
    plain.write_text("plain text")
    train, _, _ = build_datasets(cfg("text", str(plain), seq_len=16), TOK)
    assert TOK.decode(train[0]["input_ids"].tolist()) == "plain text"


@pytest.mark.parametrize("fmt", ["json", "parquet", "dataset"])
def test_bad_row_names_file_and_index(tmp_path: Path, fmt: str) -> None:
    records = [*RECORDS["instruction"][:2], {"instruction": "x", "context": "", "response": None},
               RECORDS["instruction"][3]]
    path = write(tmp_path, fmt, records)
    with pytest.raises(DataError) as err:
        build_datasets(cfg("instruction", path), TOK)
    assert str(err.value) == f"{path}: row 2: field 'response' is NoneType, expected a string"
    _, _, stats = build_datasets(cfg("instruction", path, skip_bad_lines=True), TOK)
    assert (stats.bad_lines_skipped, stats.train_examples) == (1, 3)


def test_json_array_of_non_objects_and_jsonl_in_a_json_file(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text(json.dumps([RECORDS["instruction"][0], [1, 2]]))
    with pytest.raises(DataError, match=r"a\.json: row 1: not a JSON object \(got list\)$"):
        build_datasets(cfg("instruction", str(path)), TOK)
    lines = tmp_path / "lines.json"  # many "JSON" files on the Hub are JSONL
    lines.write_text("".join(json.dumps(r) + "\n" for r in RECORDS["instruction"]))
    _, _, stats = build_datasets(cfg("instruction", str(lines)), TOK)
    assert stats.examples_read == 9
    broken = tmp_path / "broken.json"
    broken.write_text('[{"instruction": "a", "response": "b"}, {"instruction": ')
    with pytest.raises(DataError, match=r"broken\.json: row 1: not valid JSON .*unreadable from there"):
        build_datasets(cfg("instruction", str(broken)), TOK)


DEEP = "[" * 100_000 + "]" * 100_000


def test_deeply_nested_json_is_a_bad_row(tmp_path: Path) -> None:
    good = [json.dumps(r) for r in RECORDS["instruction"][:3]]
    path = tmp_path / "deep.jsonl"
    path.write_text("\n".join([good[0], '{"instruction": ' + DEEP + "}", *good[1:]]) + "\n")
    with pytest.raises(DataError) as err:
        build_datasets(cfg("instruction", str(path)), TOK)
    assert str(err.value) == f"{path}:2: JSON nested too deeply to read"
    _, _, stats = build_datasets(cfg("instruction", str(path), skip_bad_lines=True), TOK)
    assert (stats.bad_lines_skipped, stats.train_examples) == (1, 3)
    array = tmp_path / "deep.json"
    array.write_text("[" + ", ".join([good[0], '{"a": "]\\"[", "b": ' + DEEP + "}", *good[1:]]) + "]")
    with pytest.raises(DataError, match=rf"^{array}: row 1: JSON nested too deeply to read$"):
        build_datasets(cfg("instruction", str(array)), TOK)
    _, _, stats = build_datasets(cfg("instruction", str(array), skip_bad_lines=True), TOK)
    assert (stats.bad_lines_skipped, stats.train_examples) == (1, 3)  # the rows after it are still read


def test_datasets_folder_errors(tmp_path: Path) -> None:
    ds = datasets.Dataset.from_list(RECORDS["instruction"])
    datasets.DatasetDict({"validation": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"dd: a DatasetDict folder without a 'train' split \(splits: validation\)"):
        build_datasets(cfg("instruction", str(tmp_path / "dd")), TOK)
    (tmp_path / "plain_folder").mkdir()
    with pytest.raises(DataError, match=r"plain_folder: a folder but not a Hugging Face datasets folder"):
        build_datasets(cfg("instruction", str(tmp_path / "plain_folder")), TOK)
    with pytest.raises(DataError, match=r"nothere\.parquet does not exist \(config key 'data.path'\)"):
        build_datasets(cfg("instruction", str(tmp_path / "nothere.parquet")), TOK)


def test_missing_pyarrow_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, "parquet", RECORDS["instruction"])
    # `import pyarrow` fails, as on an install without the extra: None in sys.modules (put back after the
    # test), in this process rather than a fresh interpreter (seconds of imports).
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(DataError) as err:
        build_datasets(DataSection(kind="instruction", path=path), ByteTokenizer())
    assert str(err.value) == (
        "reading Parquet files and datasets folders needs pyarrow; pip install 'tracetrain[parquet]'"
    )
