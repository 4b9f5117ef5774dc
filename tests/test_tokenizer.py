"""Tokenizers: the byte tokenizer's id layout and round trip, a real GPT-2 tokenizer.json, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from tracetrain.data import ByteTokenizer, HFTokenizer, check_vocab, load_tokenizer
from tracetrain.errors import DataError

GPT2_JSON = Path("/work/shared/data/gpt2_tokenizer.json")
GPT2_ENDOFTEXT = 50256  # GPT-2's only special token, as published with the model


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
    half_char = "é".encode("utf-8")[:1]
    assert tok.decode(list(b"ab" + half_char)) == "ab\ufffd"


def test_check_vocab() -> None:
    tok = ByteTokenizer()
    check_vocab(tok, 320)
    check_vocab(tok, 259)
    with pytest.raises(DataError, match=r"tokenizer byte has 259 ids but the model's embedding has 258 rows"):
        check_vocab(tok, 258)


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(DataError, match="nope.json"):
        load_tokenizer(str(path))


def test_tokenizer_file_not_json(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{ this is not json")
    with pytest.raises(DataError, match="broken.json.*not valid JSON"):
        load_tokenizer(str(path))


def test_tokenizer_file_json_but_not_a_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text('{"hello": 1}')
    with pytest.raises(DataError, match="other.json"):
        load_tokenizer(str(path))


@pytest.fixture(scope="module")
def gpt2() -> HFTokenizer:
    if not GPT2_JSON.is_file():
        pytest.skip(f"GPT-2 tokenizer.json not available at {GPT2_JSON}")
    tok = load_tokenizer(str(GPT2_JSON))
    assert isinstance(tok, HFTokenizer)
    return tok


def test_gpt2_specials(gpt2: HFTokenizer) -> None:
    # A bare tokenizer.json with exactly one special token: it is BOS, EOS and PAD (GPT-2's convention).
    assert gpt2.vocab_size == 50257
    assert gpt2.bos_id == gpt2.eos_id == GPT2_ENDOFTEXT
    assert gpt2.pad_id == GPT2_ENDOFTEXT
    assert gpt2.stop_ids == (GPT2_ENDOFTEXT,) and gpt2.add_bos and gpt2.source_dir is None


def test_specials_come_from_the_folder_not_from_names(tmp_path: Path) -> None:
    # GPT-2's tokenizer.json in a folder whose config names another EOS: the config wins over any spelling.
    if not GPT2_JSON.is_file():
        pytest.skip(f"GPT-2 tokenizer.json not available at {GPT2_JSON}")
    (tmp_path / "tokenizer.json").write_text(GPT2_JSON.read_text())
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": null, "eos_token": "\u010a"}')  # "\n" = id 198
    tok = load_tokenizer(str(tmp_path))
    assert (tok.eos_id, tok.pad_id, tok.add_bos, tok.stop_ids, tok.source_dir) == (198, 198, False, (198,), tmp_path)


def test_gpt2_encode_decode(gpt2: HFTokenizer) -> None:
    text = "Hello world, naïve café!"
    ids = gpt2.encode(text)
    assert GPT2_ENDOFTEXT not in ids
    assert len(ids) < len(text)  # BPE merges: fewer ids than characters
    assert gpt2.decode(ids) == text
    assert gpt2.decode([GPT2_ENDOFTEXT] + ids + [GPT2_ENDOFTEXT]) == text
    assert gpt2.encode_batch([text, "x"]) == [ids, gpt2.encode("x")]
