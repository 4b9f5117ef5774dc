"""Text corpora tokenised as a stream into memory-mapped rows (issue #18 part 4): the rows equal ones worked
out from the raw text, whatever the chunk sizes; the cache is reused, keyed by content, and atomic; progress
is reported in bytes of the file; peak memory does not grow with the corpus; eval and checkpoint progress."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from tests.conftest import REPO
from tracetrain.config import DataSection
from tracetrain.data import build_datasets, load_tokenizer
from tracetrain.data import text as text_module
from tracetrain.errors import DataError
from tracetrain.progress import ReportingList
from tracetrain.train.checkpoint import TrainState, save_checkpoint
from tracetrain.train.console import Reporter
from tracetrain.train.resume import data_fingerprint

BYTE = load_tokenizer("byte")
WORDS = ["alpha", "beta", "gamma", "Zürich", "naïve", "3.14", "the", "of"]


def corpus(num_docs: int = 40, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [
        "\n".join(" ".join(rng.choice(WORDS, rng.integers(1, 9))) for _ in range(rng.integers(1, 12)))
        for _ in range(num_docs)
    ]


def documents_of(text: str) -> list[str]:
    """A text file's documents worked out line by line: a line that is `<|endoftext|>` (spaces or tabs
    around it allowed) separates them; a document keeps its line ends; blank documents are left out."""
    docs, current = [], ""
    for line in text.splitlines(keepends=True):
        if line.strip(" \t\r\n") == "<|endoftext|>":
            docs.append(current)
            current = ""
        else:
            current += line
    return [d for d in docs + [current] if d.strip()]


def reference_rows(docs: list[str], tok, seq_len: int, pack: bool, eval_fraction: float) -> dict:
    """The rows worked out directly from the documents, row by row in plain Python (no library code)."""
    stream: list[tuple[int, int]] = []  # (token, document)
    for d, doc in enumerate(docs):
        ids = ([tok.bos_id] if tok.add_bos else []) + tok.encode(doc) + [tok.eos_id]
        stream += [(t, d) for t in ids]
    cut = len(stream) - round(len(stream) * eval_fraction)
    out = {}
    for split, part in (("train", stream[:cut]), ("eval", stream[cut:])):
        labels = [
            part[i + 1][0] if i + 1 < len(part) and part[i + 1][1] == part[i][1] else -100 for i in range(len(part))
        ]
        pieces: list[list[int]] = []  # token indices of each row
        if pack:
            pieces = [list(range(i, min(i + seq_len, len(part)))) for i in range(0, len(part), seq_len)]
        else:
            for d in dict.fromkeys(p[1] for p in part):
                where = [i for i, p in enumerate(part) if p[1] == d]
                pieces += [where[i : i + seq_len] for i in range(0, len(where), seq_len)]
        rows = {"input_ids": [], "labels": [], "position_ids": [], "document_ids": []}
        for piece in pieces:
            pad = seq_len - len(piece)
            docs_in_row = list(dict.fromkeys(part[i][1] for i in piece))
            first = {d: next(j for j, i in enumerate(piece) if part[i][1] == d) for d in docs_in_row}
            rows["input_ids"].append([part[i][0] for i in piece] + [tok.pad_id] * pad)
            rows["labels"].append([labels[i] for i in piece] + [-100] * pad)
            rows["position_ids"].append([j - first[part[i][1]] for j, i in enumerate(piece)] + [0] * pad)
            rows["document_ids"].append([docs_in_row.index(part[i][1]) for i in piece] + [-1] * pad)
        out[split] = rows
    return out


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few characters and blocks of a few rows, so that every boundary is crossed many times."""
    monkeypatch.setattr(text_module, "_READ_CHARS", 7)
    monkeypatch.setattr(text_module, "_BATCH_CHARS", 50)
    monkeypatch.setattr(text_module, "_BLOCK_TOKENS", 16)


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_rows_equal_reference_across_chunk_boundaries(
    tmp_path: Path, small_chunks, pack: bool, tokenizer: str, bpe_json: Path
):
    tok = BYTE if tokenizer == "byte" else load_tokenizer(str(bpe_json))
    docs = corpus()
    path = tmp_path / "c.txt"
    path.write_text("\n<|endoftext|>\n".join(docs) + "\n \t<|endoftext|>\n\n<|endoftext|>\n")  # + a blank doc
    data = DataSection(kind="text", path=str(path), seq_len=8, pack=pack, eval_fraction=0.1)
    train, eval_, stats = build_datasets(data, tok)
    docs = documents_of(path.read_text())
    assert len(docs) == 40
    expected = reference_rows(docs, tok, 8, pack, 0.1)
    for split, ds in (("train", train), ("eval", eval_)):
        for key, rows in expected[split].items():
            assert ds.rows[key].tolist() == rows, (split, key)
    assert stats.examples_read == len(docs)
    assert stats.train_sequences == len(expected["train"]["input_ids"])
    assert stats.train_target_tokens == sum(t != -100 for r in expected["train"]["labels"] for t in r)


def test_crlf_text_and_jsonl_rows_equal_reference(tmp_path: Path, small_chunks):
    docs = corpus(12, seed=1)
    crlf = tmp_path / "c.txt"
    crlf.write_bytes("\n<|endoftext|>\n".join(docs).replace("\n", "\r\n").encode())
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\r\n" for d in docs))
    expected = reference_rows(documents_of("\n<|endoftext|>\n".join(docs)), BYTE, 16, True, 0.0)["train"]["input_ids"]
    assert reference_rows(docs, BYTE, 16, True, 0.0)["train"]["input_ids"] != expected  # line ends are kept
    for path in (crlf,):
        train, _, _ = build_datasets(DataSection(kind="text", path=str(path), seq_len=16, eval_fraction=0.0), BYTE)
        assert train.rows["input_ids"].tolist() == expected, path.name
    train, _, _ = build_datasets(DataSection(kind="text", path=str(jsonl), seq_len=16, eval_fraction=0.0), BYTE)
    assert train.rows["input_ids"].tolist() == reference_rows(docs, BYTE, 16, True, 0.0)["train"]["input_ids"]


def test_cache_is_reused_keyed_by_content_and_leaves_no_temporaries(tmp_path: Path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n<|endoftext|>\n".join(corpus()))
    original = path.read_bytes()
    cache = tmp_path / "cache"
    data = DataSection(kind="text", path=str(path), seq_len=16, eval_fraction=0.1)
    first, _, stats = build_datasets(data, BYTE, cache_dir=cache)
    (entry,) = cache.iterdir()
    assert entry.name.startswith("text-") and (entry / "meta.json").is_file()
    stamp = (entry / "meta.json").stat().st_mtime_ns
    again, _, stats_again = build_datasets(data, BYTE, cache_dir=cache)
    assert (entry / "meta.json").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert torch.equal(first.rows["input_ids"], again.rows["input_ids"]) and stats_again == stats
    assert data_fingerprint(first) == data_fingerprint(again)
    fresh, _, _ = build_datasets(data, BYTE)  # no cache: temporary files, the same rows
    assert data_fingerprint(fresh) == data_fingerprint(first)
    path.write_text(path.read_text().replace("alpha", "ALPHA"))  # same size, other bytes: another entry
    changed, _, _ = build_datasets(data, BYTE, cache_dir=cache)
    assert len(list(cache.iterdir())) == 2
    assert data_fingerprint(changed) != data_fingerprint(first)
    path.write_bytes(original)
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "corpus.txt"]


def test_a_damaged_cache_entry_is_rebuilt(tmp_path: Path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n<|endoftext|>\n".join(corpus()))
    data = DataSection(kind="text", path=str(path), seq_len=16, eval_fraction=0.0)
    good = build_datasets(data, BYTE, cache_dir=tmp_path / "cache")[0].rows["input_ids"].clone()
    (entry,) = (tmp_path / "cache").iterdir()
    with open(entry / "train.input_ids.i32", "r+b") as f:
        f.truncate(8)  # a torn file: sizes no longer match the meta
    rebuilt, _, _ = build_datasets(data, BYTE, cache_dir=tmp_path / "cache")
    assert torch.equal(rebuilt.rows["input_ids"], good)


def test_progress_counts_bytes_of_the_file_and_tokens(tmp_path: Path, small_chunks):
    calls: list[tuple] = []
    path = tmp_path / "corpus.txt"
    path.write_text("\n<|endoftext|>\n".join(corpus(200)))
    size = path.stat().st_size
    data = DataSection(kind="text", path=str(path), seq_len=16, eval_fraction=0.1)
    build_datasets(data, BYTE, progress=lambda what, done, total, unit="": calls.append((what, done, total, unit)))
    reading = [c for c in calls if c[0].startswith("tokenizing")]
    assert reading and all(c[2] == size and c[3] == "bytes" for c in reading)
    done = [c[1] for c in reading]
    assert done == sorted(done) and done[-1] == size
    assert re.search(r"tokenizing corpus.txt: [\d,]+ tokens, [\d,]+ tok/s", reading[-1][0])
    cutting = [c for c in calls if c[0] == "cutting rows"]
    assert cutting and cutting[-1][1] == cutting[-1][2]


def test_errors_are_one_line_and_name_the_file(tmp_path: Path, small_chunks):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine text " * 10 + b"\xff and more")
    with pytest.raises(DataError, match=r"bad.txt: not valid UTF-8 text \(invalid start byte at byte 100\)"):
        build_datasets(DataSection(kind="text", path=str(bad)), BYTE)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n \n<|endoftext|>\n")
    with pytest.raises(DataError, match=r"blank.txt: no text to train on \(config key 'data.path'\)"):
        build_datasets(DataSection(kind="text", path=str(blank)), BYTE, cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match=r"data file .*missing.txt does not exist \(config key 'data.path'\)"):
        build_datasets(DataSection(kind="text", path=str(tmp_path / "missing.txt")), BYTE, cache_dir=tmp_path / "c")
    assert not list((tmp_path / "cache").iterdir())  # a failed build leaves no entry


PEAK = r"""
import sys
from tracetrain.config import DataSection
from tracetrain.data import build_datasets, load_tokenizer
def peak():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 1024
tok = load_tokenizer("byte")
before = peak()
build_datasets(DataSection(kind="text", path=sys.argv[1], seq_len=256, eval_fraction=0.01), tok)
print(peak() - before)
"""


def test_peak_memory_does_not_grow_with_the_corpus(tmp_path: Path):
    """Tokenising 1 MB and 4 MB of text (byte tokens: 4M) adds about the same to the peak; holding the
    4M tokens as rows in memory would alone take 16 bytes a token (64 MB). Measured when written: +88 and
    +92 MiB; before streaming, +110 and +435 MiB."""
    growth = {}
    for mb in (1, 4):
        path = tmp_path / f"c{mb}.txt"
        doc = "\n".join(corpus(30)) + "\n<|endoftext|>\n"
        path.write_text(doc * (mb * 10**6 // len(doc.encode())))
        run = subprocess.run([sys.executable, "-c", PEAK, str(path)], capture_output=True, text=True, cwd=REPO)
        assert run.returncode == 0, run.stderr
        growth[mb] = float(run.stdout.strip())
    assert growth[4] < growth[1] + 30, growth


PEAK_ONE_DOCUMENT = r"""
import json, sys
from pathlib import Path
from tracetrain.config import DataSection
from tracetrain.data import HFTokenizer
from tracetrain.data.text import tokenize_to_file
def peak():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) / 1024
tok = HFTokenizer(sys.argv[1], piece_chars=int(sys.argv[2]))
before, growth = peak(), []
for path in sys.argv[3:]:  # the smaller first: the peak only rises, so the second growth includes the first
    tokenize_to_file(path, "data.path", DataSection(kind="text", path=path), tok, Path(path + ".i32"), None)
    growth.append(peak() - before)
print(json.dumps(growth))
"""


def test_peak_memory_does_not_grow_with_one_long_document(tmp_path: Path, corpus_txt: Path, bpe_json: Path):
    """A single document (no separator lines) goes to the byte-level BPE a piece at a time: tokenising
    0.28 MB and 1.1 MB of the tests' corpus adds about the same to the peak (measured: +7.2 and +9.9 MiB;
    with GPT-2 and tinyshakespeare +1.8 and +4.4). In one call the tokenizer holds about 180 bytes a
    character (+52 and +200 MiB). Pieces of 32K
    characters here, so that small files show it; cutting tokens into rows is bounded by its blocks
    (the test above)."""
    text = corpus_txt.read_text()
    paths = [tmp_path / "quarter.txt", tmp_path / "whole.txt"]
    paths[0].write_text(text[: len(text) // 4])
    paths[1].write_text(text)
    args = [str(bpe_json), str(1 << 15), *map(str, paths)]
    run = subprocess.run([sys.executable, "-c", PEAK_ONE_DOCUMENT, *args], capture_output=True, text=True, cwd=REPO)
    assert run.returncode == 0, run.stderr
    quarter, whole = json.loads(run.stdout)
    assert whole < quarter + 30, (quarter, whole)


def test_reporter_shows_counts_on_a_terminal_and_nothing_elsewhere():
    def run(progress: bool, terminal: bool) -> str:
        out = io.StringIO()
        reporter = Reporter(progress, Console(file=out, force_terminal=terminal, width=120))
        with reporter.status("evaluating") as report:
            for i in range(3):
                if report:
                    report("evaluating", i + 1, 3, "batches")
            if report:
                report("saving checkpoint: model.safetensors", 5_000_000, 20_000_000, "bytes")
        return out.getvalue()

    shown = run(True, True)
    assert "3/3 batches" in shown and "5.0/20.0 MB" in shown
    assert run(False, True) == "" and run(True, False) == ""


def test_reporting_list_counts_items_as_they_are_used():
    calls = []
    items = ReportingList(
        [10, 20, 30], lambda what, done, total, unit="": calls.append((done, total, unit)), "x", "batches"
    )
    assert isinstance(items, list) and len(items) == 3
    assert sum(items) == 60
    assert calls == [(1, 3, "batches"), (2, 3, "batches"), (3, 3, "batches")]


def test_checkpoint_save_reports_the_bytes_written(tmp_path: Path):
    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    calls = []
    state = TrainState(step=1, scheduler={}, loader={}, counters={})
    save_checkpoint(
        tmp_path,
        model,
        optimizer,
        state,
        "",
        lora=False,
        keep_last=1,
        progress=lambda what, done, total, unit="": calls.append((what, done, total, unit)),
    )
    weights = (64 * 32 + 32) * 4
    total = weights * 3 + 2 * 4  # weights, two Adam moments, a step count per parameter
    assert [c[1:] for c in calls] == [(0, total, "bytes"), (weights, total, "bytes"), (total, total, "bytes")]
    assert calls[0][0] == "saving checkpoint: model.safetensors"
