"""Tokenizers: the byte tokenizer's id layout and round trip, a byte-level BPE tokenizer.json (GPT-2's design,
trained at test time: tests/fixtures_gen.py), errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fixtures_gen import bpe_token_id, bpe_vocab_size

from tracetrain.data import ByteTokenizer, HFTokenizer, check_vocab, load_tokenizer
from tracetrain.errors import DataError

ENDOFTEXT = bpe_token_id("<|endoftext|>")  # the BPE's only special token (GPT-2's 50256)
NEWLINE = bpe_token_id("\u010a")  # byte-level "\n" (GPT-2's 198)


def test_byte_tokenizer_layout_and_round_trip() -> None:
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 259)
    text = "naïve café, 東京 🚀\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))  # no special tokens added
    assert len(ids) > len(text)  # multi-byte characters really are several ids
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == text


def test_byte_tokenizer_decodes_invalid_utf8_with_replacement() -> None:
    tok = ByteTokenizer()
    half_char = "é".encode()[:1]
    assert tok.decode(list(b"ab" + half_char)) == "ab\ufffd"


def test_check_vocab() -> None:
    tok = ByteTokenizer()
    check_vocab(tok, 320)
    check_vocab(tok, 259)
    with pytest.raises(DataError, match=r"tokenizer byte has 259 ids but the model's embedding has 258 rows"):
        check_vocab(tok, 258)


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(DataError, match=re.escape("nope.json")):
        load_tokenizer(str(path))


def test_tokenizer_file_not_json(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{ this is not json")
    with pytest.raises(DataError, match=r"broken.json.*not valid JSON"):
        load_tokenizer(str(path))


def test_tokenizer_file_json_but_not_a_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text('{"hello": 1}')
    with pytest.raises(DataError, match=re.escape("other.json")):
        load_tokenizer(str(path))


@pytest.fixture(scope="module")
def bpe(bpe_json: Path) -> HFTokenizer:
    tok = load_tokenizer(str(bpe_json))
    assert isinstance(tok, HFTokenizer)
    return tok


def test_bare_bpe_specials(bpe: HFTokenizer) -> None:
    # A bare tokenizer.json with exactly one special token: it is BOS, EOS and PAD (GPT-2's convention).
    assert bpe.vocab_size == bpe_vocab_size()
    assert bpe.bos_id == bpe.eos_id == ENDOFTEXT
    assert bpe.pad_id == ENDOFTEXT
    assert bpe.stop_ids == (ENDOFTEXT,) and bpe.add_bos and bpe.source_dir is None


def test_specials_come_from_the_folder_not_from_names(tmp_path: Path, bpe_json: Path) -> None:
    # The BPE's tokenizer.json in a folder whose config names another EOS: the config wins over any spelling.
    (tmp_path / "tokenizer.json").write_text(bpe_json.read_text())
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": null, "eos_token": "\u010a"}')  # "\n"
    tok = load_tokenizer(str(tmp_path))
    assert (tok.eos_id, tok.pad_id, tok.add_bos, tok.stop_ids, tok.source_dir) == (
        NEWLINE,
        NEWLINE,
        False,
        (NEWLINE,),
        tmp_path,
    )


def test_bpe_encode_decode(bpe: HFTokenizer) -> None:
    text = "Hello world, naïve café!"
    ids = bpe.encode(text)
    assert ENDOFTEXT not in ids
    assert len(ids) < len(text)  # BPE merges: fewer ids than characters
    assert bpe.decode(ids) == text
    assert bpe.decode([ENDOFTEXT] + ids + [ENDOFTEXT]) == text
    assert bpe.encode_batch([text, "x"]) == [ids, bpe.encode("x")]
