"""Instruction and chat rows go through the token cache as text corpora do (data/record_rows.py): the same
rows as built without a cache, memory-mapped from the entry, reused without tokenising again, and rebuilt
when the file, the chat template or a setting that shapes rows changes. The synthetic task's rows are
memory-mapped from temporary files and leave no entry."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tracetrain.config import DataSection
from tracetrain.data import ByteTokenizer, build_datasets
from tracetrain.data import loader as loader_module
from tracetrain.train.resume import data_fingerprint

TOK = ByteTokenizer()
RECORDS = {
    "instruction": [{"instruction": f"task {i}", "context": "", "response": f"result {i} " * (i % 5 + 1)}
                    for i in range(60)],
    "chat": [{"messages": [{"role": "user", "content": f"hi {i}"},
                           {"role": "assistant", "content": f"hello {i} " * (i % 4 + 1)}]} for i in range(60)],
}


def data_for(kind: str, folder: Path, **kw) -> DataSection:
    path = folder / f"{kind}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS[kind]))
    extra = {"chat": {"chat_template": "chatml"}, "instruction": {"template": "plain"}}[kind]
    return DataSection(kind=kind, path=str(path), seq_len=256, eval_fraction=0.1, **{**extra, **kw})


def mapped_files() -> str:
    return Path("/proc/self/maps").read_text()


def refuse_to_tokenise(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    def boom(*_args):
        raise AssertionError("tokenised again instead of reusing the cached rows")

    monkeypatch.setitem(loader_module._DOCUMENTS, kind, boom)


@pytest.mark.parametrize("kind", list(RECORDS))
def test_rows_are_cached_mapped_and_reused_without_tokenising(tmp_path: Path, kind: str, monkeypatch):
    data = data_for(kind, tmp_path)
    cache = tmp_path / "cache"
    fresh_train, fresh_eval, fresh_stats = build_datasets(data, TOK)  # temporary files, deleted once mapped
    train, eval_, stats = build_datasets(data, TOK, cache_dir=cache)
    (entry,) = cache.iterdir()
    assert entry.name.startswith(f"{kind}-") and (entry / "meta.json").is_file()
    assert str(entry / "train.input_ids.i32") in mapped_files()  # the rows are the file's pages, not a copy
    for a, b in ((fresh_train, train), (fresh_eval, eval_)):
        assert all(torch.equal(a.rows[k], b.rows[k]) for k in a.rows) and a.examples == b.examples
    assert stats == fresh_stats and len(eval_) > 0
    assert eval_.examples if kind == "instruction" else not eval_.examples  # prompt/response pairs: exact match
    stamp = (entry / "meta.json").stat().st_mtime_ns

    refuse_to_tokenise(monkeypatch, kind)
    again_train, again_eval, again_stats = build_datasets(dataclasses.replace(data, num_workers=2), TOK, cache_dir=cache)
    assert (entry / "meta.json").stat().st_mtime_ns == stamp and len(list(cache.iterdir())) == 1
    assert data_fingerprint(again_train) == data_fingerprint(train) and again_stats == stats
    assert again_eval.examples == eval_.examples
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp")]


@pytest.mark.parametrize("kind,change", [
    ("instruction", {"train_on_prompt": True}),
    ("instruction", {"template": "chatml"}),
    ("chat", {"train_on_prompt": True}),
    ("chat", {"chat_template": "llama-3"}),
    ("chat", {"seq_len": 128}),
    ("instruction", {"pack": False}),
])
def test_a_setting_that_shapes_rows_builds_another_entry(tmp_path: Path, kind: str, change: dict, monkeypatch):
    data = data_for(kind, tmp_path)
    cache = tmp_path / "cache"
    first, _, _ = build_datasets(data, TOK, cache_dir=cache)
    refuse_to_tokenise(monkeypatch, kind)
    with pytest.raises(AssertionError, match="tokenised again"):
        build_datasets(dataclasses.replace(data, **change), TOK, cache_dir=cache)
    monkeypatch.undo()
    other, _, _ = build_datasets(dataclasses.replace(data, **change), TOK, cache_dir=cache)
    assert len(list(cache.iterdir())) == 2 and data_fingerprint(other) != data_fingerprint(first)


@pytest.mark.parametrize("kind", ["instruction", "chat"])
def test_changed_file_bytes_build_another_entry(tmp_path: Path, kind: str):
    data = data_for(kind, tmp_path)
    cache = tmp_path / "cache"
    first, _, _ = build_datasets(data, TOK, cache_dir=cache)
    path = Path(data.path)
    path.write_text(path.read_text().replace("hello 1 ", "HELLO 1 ").replace("result 1 ", "RESULT 1 "))
    changed, _, _ = build_datasets(data, TOK, cache_dir=cache)
    assert len(list(cache.iterdir())) == 2 and data_fingerprint(changed) != data_fingerprint(first)


def test_a_chat_template_file_is_keyed_by_its_text(tmp_path: Path):
    from tracetrain.data.chat_templates import BUILTIN_TEMPLATES

    template = tmp_path / "t.jinja"
    template.write_text(BUILTIN_TEMPLATES["chatml"])
    data = data_for("chat", tmp_path, chat_template=str(template))
    cache = tmp_path / "cache"
    first, _, _ = build_datasets(data, TOK, cache_dir=cache)
    template.write_text(BUILTIN_TEMPLATES["chatml"].replace("<|im_start|>", "<|im_begin|>"))
    changed, _, _ = build_datasets(data, TOK, cache_dir=cache)
    assert len(list(cache.iterdir())) == 2 and data_fingerprint(changed) != data_fingerprint(first)


def test_the_synthetic_task_leaves_no_cache_entry(tmp_path: Path):
    data = DataSection(kind="synthetic", synthetic_examples=300, seq_len=64)
    train, eval_, stats = build_datasets(data, TOK, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # generated in a moment: nothing written in the run folder
    fresh, fresh_eval, fresh_stats = build_datasets(data, TOK)
    assert data_fingerprint(train) == data_fingerprint(fresh) and stats == fresh_stats
    assert eval_.examples == fresh_eval.examples and len(eval_.examples) == 15


@pytest.mark.parametrize("kind", ["instruction", "chat"])
def test_a_missing_file_is_one_data_error_before_any_hashing(tmp_path: Path, kind: str):
    from tracetrain.errors import DataError

    data = dataclasses.replace(data_for(kind, tmp_path), eval_path=str(tmp_path / "gone.jsonl"))
    with pytest.raises(DataError, match=r"gone\.jsonl does not exist \(config key 'data.eval_path'\)"):
        build_datasets(data, TOK, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
