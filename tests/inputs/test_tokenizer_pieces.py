"""A long document is encoded a piece at a time (data/tokenizer.py): the cuts fall where the pieces' ids
are the ids of one call on the whole text, for GPT-2's byte-level regex (a BPE of GPT-2's design trained at
test time, tests/fixtures_gen.py), a Llama-3 style Split regex and Metaspace; a cut anywhere else would
change them."""

from __future__ import annotations

import itertools
import random
import re
from pathlib import Path

import numpy as np
import pytest
from fixtures_gen import bpe_json_path

from tracetrain.data import HFTokenizer
from tracetrain.data.tokenizer import piece_spans

# Llama 3's pre-tokenizer pattern (its tokenizer.json), run as a Split before a byte level without regex.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Characters and strings that pre-tokenizers treat differently: runs of spaces, tabs, \r\n, Unicode spaces
# (no-break, ideographic, NEL, and \x1c which Python counts as a space), contractions, digits, a combining
# accent, CJK, an emoji and GPT-2's special token.
ALPHABET = list("abZ9 0'.,!?\n\n\t  ") + [
    "\r\n",
    "'s",
    "'ll",
    "é",
    "Ω",
    "\u00a0",
    "\u3000",
    "\x85",
    "\x1c",
    "日本",
    "😀",
    "e\u0301",
    " 12345",
    "<|endoftext|>",
]


def corpus() -> str:
    """The tests' play-like corpus (1.1 MB, the size of tinyshakespeare), the BPE's training text."""
    return (bpe_json_path().parent / "corpus.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tokenizer.json files: the byte-level BPE; its vocabulary behind Llama 3's Split regex; a BPE with a
    Metaspace pre-tokenizer (SentencePiece style) trained here on part of the corpus."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    bpe = bpe_json_path()
    folder = tmp_path_factory.mktemp("tokenizers")
    llama3 = Tokenizer.from_file(str(bpe))
    llama3.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    llama3.save(str(folder / "llama3.json"))
    metaspace = Tokenizer(models.BPE())
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>"], show_progress=False)
    metaspace.train_from_iterator([corpus()[:200_000]], trainer)
    metaspace.save(str(folder / "metaspace.json"))
    return {"bpe": bpe, "llama3": folder / "llama3.json", "metaspace": folder / "metaspace.json"}


def pieces_and_whole(path: Path, text: str, piece_chars: int) -> tuple[list[int], list[int]]:
    """(ids through the corpus path, `encode_batch_arrays`, in pieces; ids of one call on the whole text)."""
    tok = HFTokenizer(path, piece_chars=piece_chars)
    short = "To be, or not to be"
    in_pieces, short_ids = tok.encode_batch_arrays([text, short])
    assert short_ids.tolist() == tok.encode(short)  # a short text in the same batch is one call
    return in_pieces.tolist(), tok.encode(text)


def test_spans_cover_the_text_and_cut_only_at_safe_places() -> None:
    text = corpus()[:300_000]
    spans = list(piece_spans(text, 4096))
    assert spans[0][0] == 0 and spans[-1][1] == len(text)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # in order, no gap, no overlap
    assert len(spans) > 60 and all(4096 < b - a <= 4096 + 1024 for a, b in spans[:-1])
    for _, end in spans[:-1]:  # a space cut: non-space, then the piece starts " X"
        assert re.fullmatch(r"\S \S", text[end - 1 : end + 2]), repr(text[end - 3 : end + 3])
    # No space in reach: after a newline between non-space characters; no cut at all: one piece.
    lines = "\n".join(["ab"] * 40 + ["  ", "x\n\ny", "c"] * 5)
    assert [lines[end - 2 : end + 1] for _, end in piece_spans(lines, 8)][:3] == ["b\na", "b\na", "b\na"]
    assert "".join(lines[a:b] for a, b in piece_spans(lines, 8)) == lines
    assert list(piece_spans("x" * 1000 + "  \n\n " * 10, 16)) == [(0, 1050)]
    assert list(piece_spans("", 16)) == [] and list(piece_spans("short", 16)) == [(0, 5)]
    with pytest.raises(ValueError, match="piece_chars must be at least 1, got 0"):
        HFTokenizer(bpe_json_path(), piece_chars=0)


def test_bpe_pieces_give_the_ids_of_one_call_on_the_corpus(tokenizer_files: dict[str, Path]) -> None:
    text = corpus()  # 1.1 MB: about 270 pieces of 4096 characters
    in_pieces, whole = pieces_and_whole(tokenizer_files["bpe"], text, 4096)
    assert len(whole) > 300_000 and in_pieces == whole
    # The check can fail: cut every 4096 characters regardless of what is there, the ids differ.
    tok = HFTokenizer(tokenizer_files["bpe"])
    blind = [i for start in range(0, len(text), 4096) for i in tok.encode(text[start : start + 4096])]
    assert blind != whole


@pytest.mark.parametrize("kind", ["llama3", "metaspace"])
def test_other_pre_tokenizers_give_the_ids_of_one_call(tokenizer_files: dict[str, Path], kind: str) -> None:
    text = corpus()[200_000:500_000]  # text the Metaspace BPE was not trained on
    in_pieces, whole = pieces_and_whole(tokenizer_files[kind], text, 4096)
    assert in_pieces == whole


@pytest.mark.parametrize("kind", ["bpe", "llama3"])
def test_pieces_of_random_text_give_the_ids_of_one_call(tokenizer_files: dict[str, Path], kind: str) -> None:
    """Pieces of a few characters, so that cuts of both kinds land next to every kind of character."""
    rng = random.Random(0)
    tok = HFTokenizer(tokenizer_files[kind], piece_chars=7)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(20, 600))) for _ in range(60)]
    for text, ids in zip(texts, tok.encode_batch_arrays(texts)):
        assert ids.dtype == np.int32 and ids.tolist() == tok.encode(text), repr(text)
