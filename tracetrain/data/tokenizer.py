"""Tokenizers: a built-in byte-level one and Hugging Face tokenizers (a folder, or a bare tokenizer.json).

Both follow one small interface (`Tokenizer`). `encode` never adds special tokens: the data pipeline
places BOS/EOS itself (BOS only where `add_bos`), so that the same code handles tokenizers whose
post-processor adds a BOS (Llama) and those that add nothing (GPT-2, Qwen). `decode` drops special
ids, so generated text reads clean.

The byte tokenizer needs no files and gives the tiny default model a 259-id vocabulary:

    ids 0..255  the UTF-8 bytes
    256 BOS, 257 EOS, 258 PAD

Special tokens of a Hugging Face tokenizer are read, never guessed from their spelling:

- a tokenizer folder (tokenizer.json + tokenizer_config.json, as `save_pretrained` writes it):
  bos/eos/pad from tokenizer_config.json (strings or {"content": ...} dicts; a key set to null means
  "none", e.g. Qwen's bos_token), else special_tokens_map.json; `add_bos_token` from tokenizer_config
  (absent: True when there is a BOS); stop ids = EOS plus generation_config.json `eos_token_id` (an
  int or a list: chat models end a turn with `<|eot_id|>` / `<|im_end|>`); the chat template from
  tokenizer_config.json `chat_template` (a list of named templates -> the "default" one) or a sibling
  `chat_template.jinja`. No EOS anywhere (nor a generation_config eos id) is an error.
- a bare tokenizer.json (no tokenizer_config.json beside it): it must have exactly one special added
  token, which is then BOS, EOS and PAD at once, as in GPT-2 (`<|endoftext|>`); with any other number
  the roles cannot be told apart without the folder, so that is an error asking for it.

A corpus document longer than `PIECE_CHARS` characters is encoded a piece at a time
(`HFTokenizer.encode_batch_arrays`): one call into the Rust tokenizer holds about 150 bytes per character
(GPT-2), so building the rows of a 40 MB document peaked at 6.2 GiB of RSS in one call and 0.6 GiB in
pieces (benchmarks/tokenize_one_document.py, rows bit-identical). Pieces are cut where word-splitting
pre-tokenizers put a word boundary whatever follows (`piece_spans`): before a single space between two
non-space characters, else (no such space nearby) after a newline between two non-space characters. The
ids are then those of one call, checked id for id on tinyshakespeare and random text for GPT-2's byte-level
regex, a Llama-3 style Split regex and (space cuts) Metaspace. What can differ, at a cut only: a tokenizer
that adds a start-of-text marker to every input regardless of a leading space (a `Prepend` normalizer with
no pre-tokenizer, the layout of Llama 2's tokenizer.json) marks the first word of every piece, and with no
pre-tokenizer its merges may also span the cut; Metaspace at a newline cut encodes the newline and the word
after it as two words; an added token that spans a cut is not matched.
"""

from __future__ import annotations

import hashlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tracetrain.errors import DataError

# The named special tokens transformers passes to chat templates as variables (its
# SPECIAL_TOKENS_ATTRIBUTES), in its order.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers' "no limit" model_max_length, written when the source folder gives none.
_NO_MAX_LENGTH = int(1e30)
# Characters per call into the Rust tokenizer for a long document (~150 MB of its memory at GPT-2's rate).
PIECE_CHARS = 1 << 20
# Cuts that leave each side's pre-tokens as they are in the whole text. The space stays with the word it
# starts; the newline ends its side, and the non-space characters around it are never joined to it.
_SPACE_CUT = re.compile(r"\S(?= \S)")
_NEWLINE_CUT = re.compile(r"\S\n(?=\S)")
_ANY_CUT = re.compile(r"\S(?= \S)|\S\n(?=\S)")


class Tokenizer(ABC):
    """Text <-> ids. Subclasses set every attribute below."""

    name: str
    vocab_size: int
    bos_id: int  # with no BOS token (add_bos False) this is the EOS id, so old callers still get an int
    eos_id: int
    pad_id: int
    add_bos: bool  # documents start with bos_id
    stop_ids: tuple[int, ...]  # ids that end a generated answer: EOS plus end-of-turn ids
    chat_template: str | None  # the tokenizer's own Jinja chat template
    source_dir: Path | None  # the Hugging Face tokenizer folder it came from
    # Whether it has a Hugging Face form (tokenizer.json) that export can write; only HFTokenizer does.
    # A flag, not an isinstance check, so that models/ (export) needs no import of data/.
    has_hf_form: bool = False

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without any special tokens added."""

    @abstractmethod
    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """(ids, [start, end) character span of `text` each id came from), no special tokens added."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; special ids (BOS, EOS, PAD) are skipped."""

    @abstractmethod
    def decode_with_specials(self, ids: list[int]) -> str:
        """Text of `ids` with special tokens written out (`tracetrain data --show` shows what is trained)."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` over many texts; subclasses override it where a batched path is faster."""
        return [self.encode(t) for t in texts]

    def encode_batch_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """`encode_batch` as int32 arrays: a corpus is tokenised this way, without a Python int per token."""
        return [np.asarray(ids, dtype=np.int32) for ids in self.encode_batch(texts)]

    def fingerprint(self) -> str:
        """Identifies what this tokenizer produces (vocabulary, merges, special ids), for caches of tokens."""
        return f"{type(self).__name__}:{self.name}:{self.vocab_size}:{self.bos_id}:{self.eos_id}:{self.pad_id}:{self.add_bos}"

    def special_tokens(self) -> dict[str, str]:
        """Template variables bos_token, eos_token, ... -> their text (only those the tokenizer has)."""
        return {}

    @property
    def bos_text(self) -> str | None:
        """The text of the BOS token when it is a real token of the vocabulary, else None."""
        return self.special_tokens().get("bos_token") if self.add_bos else None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_id if self.add_bos else None}, eos={self.eos_id}, pad={self.pad_id}, "
            f"stop={list(self.stop_ids)})"
        )


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0-255, plus BOS 256, EOS 257, PAD 258 (vocab_size 259)."""

    def __init__(self) -> None:
        self.name = "byte"
        self.bos_id, self.eos_id, self.pad_id = 256, 257, 258
        self.vocab_size = 259
        self.add_bos, self.stop_ids = True, (257,)
        self.chat_template, self.source_dir = None, None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch_arrays(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) for t in texts]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for i, ch in enumerate(text):
            raw = ch.encode("utf-8")
            ids += raw
            offsets += [(i, i + 1)] * len(raw)
        return ids, offsets

    def decode(self, ids: list[int]) -> str:
        # A model can emit a byte sequence that is not valid UTF-8 (e.g. half a character); replace
        # it with U+FFFD rather than fail in the middle of an evaluation.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def decode_with_specials(self, ids: list[int]) -> str:
        names = {self.bos_id: "<|bos|>", self.eos_id: "<|eos|>", self.pad_id: "<|pad|>"}
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            out += [run.decode("utf-8", errors="replace"), names.get(i, f"<|{i}|>")]
            run = bytearray()
        return "".join(out) + run.decode("utf-8", errors="replace")


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, {} when absent; DataError when it is not a JSON object."""
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:  # the decoder recurses once per nesting level
        raise DataError(f"{path}: JSON nested too deeply to read") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise DataError(f"{path}: not readable JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _token_text(value: Any) -> str | None:
    """A special-token entry: "<s>" or {"content": "<s>", ...} -> "<s>"; null -> None."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _named_template(value: Any) -> str | None:
    """tokenizer_config.json `chat_template`: a string, or a list of {name, template} -> "default"."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return None


def piece_spans(text: str, piece_chars: int) -> Iterator[tuple[int, int]]:
    """[start, end) spans that cover `text` in order, each cut at the first safe cut (module docstring) at
    or after `piece_chars` characters: a space cut within the next quarter of that, else a newline cut
    there, else the first cut of either kind further on. A text with no cut at all is one span."""
    start = 0
    while len(text) - start > piece_chars:
        end = _first_cut(text, start + piece_chars, piece_chars // 4)
        yield start, end
        start = end
    if start < len(text):
        yield start, len(text)


def _first_cut(text: str, pos: int, window: int) -> int:
    """Where the piece reaching `pos` ends (the end of `text` when no cut follows `pos`)."""
    for pattern in (_SPACE_CUT, _NEWLINE_CUT):
        if m := pattern.search(text, pos, pos + window):
            return m.end()
    m = _ANY_CUT.search(text, pos)
    return m.end() if m else len(text)


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer run by the `tokenizers` library (Rust, batched): a folder or a tokenizer.json.

    `piece_chars`: a corpus document longer than this is encoded a piece at a time (module docstring).
    """

    has_hf_form = True

    def __init__(self, path: str | Path, piece_chars: int = PIECE_CHARS) -> None:
        if piece_chars < 1:
            raise ValueError(f"piece_chars must be at least 1, got {piece_chars}")
        self.piece_chars = piece_chars
        path = Path(path)
        folder = path if path.is_dir() else None
        if not path.is_dir() and path.name == "tokenizer.json" and (path.parent / "tokenizer_config.json").is_file():
            folder = path.parent  # a folder's tokenizer.json: its config files belong to it
        file = folder / "tokenizer.json" if folder else path
        self._tok = _load_rust_tokenizer(file)
        self.name = str(folder or file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.source_dir = folder
        self._config: dict[str, Any] = {}
        if folder:
            self._read_folder(folder)
        else:
            self._read_bare(file)

    def _id_of(self, text: str, where: str) -> int:
        i = self._tok.token_to_id(text)
        if i is None:
            raise DataError(f"{where} names the token {text!r}, which tokenizer.json does not have")
        return i

    def _read_folder(self, folder: Path) -> None:
        cfg = _read_json(folder / "tokenizer_config.json")
        stm = _read_json(folder / "special_tokens_map.json")
        gen = _read_json(folder / "generation_config.json")
        self._config = cfg
        texts: dict[str, str | None] = {}
        for key in SPECIAL_TOKEN_KEYS:
            # A key present in tokenizer_config.json wins even when null (null = "this tokenizer has none").
            texts[key] = _token_text(cfg[key]) if key in cfg else _token_text(stm.get(key))
        self._specials = {k: v for k, v in texts.items() if v is not None}
        where = f"{folder}/tokenizer_config.json"
        gen_eos_ids = self._gen_eos_ids(gen.get("eos_token_id"), folder / "generation_config.json")
        if texts["eos_token"] is not None:
            self.eos_id = self._id_of(texts["eos_token"], where)
        elif gen_eos_ids:
            self.eos_id = gen_eos_ids[0]
            self._specials["eos_token"] = self._tok.id_to_token(self.eos_id)
        else:
            raise DataError(
                f"{folder}: no eos_token in tokenizer_config.json or special_tokens_map.json, and no "
                "eos_token_id in generation_config.json; add one (the data pipeline ends documents "
                "with it)"
            )
        bos = texts["bos_token"]
        self.bos_id = self._id_of(bos, where) if bos is not None else self.eos_id
        add_bos = cfg.get("add_bos_token")
        self.add_bos = bos is not None and (add_bos if isinstance(add_bos, bool) else True)
        pad = texts["pad_token"]
        self.pad_id = self._id_of(pad, where) if pad is not None else self.eos_id
        self.stop_ids = tuple(dict.fromkeys([self.eos_id, *gen_eos_ids]))
        self.chat_template = _named_template(cfg.get("chat_template"))
        if self.chat_template is None and (folder / "chat_template.jinja").is_file():
            try:
                self.chat_template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{folder}/chat_template.jinja is not UTF-8 text (byte {e.start})") from None

    def _gen_eos_ids(self, value: Any, where: Path) -> list[int]:
        """generation_config.json's `eos_token_id` (one id or a list), each an id of this vocabulary."""
        ids = value if isinstance(value, list) else [] if value is None else [value]
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise DataError(
                    f"{where}: eos_token_id {json.dumps(i)[:40]} is not allowed; it must be a token id "
                    f"from 0 to {self.vocab_size - 1} (or a list of them)"
                )
        return list(ids)

    def _read_bare(self, file: Path) -> None:
        specials = sorted((i, t.content) for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        if len(specials) != 1:
            names = ", ".join(text for _, text in specials) or "none"
            raise DataError(
                f"{file}: a bare tokenizer.json with {len(specials)} special tokens ({names}) does not "
                "say which is BOS or EOS; set data.tokenizer to the Hugging Face tokenizer folder "
                "(with its tokenizer_config.json)"
            )
        # GPT-2's convention: its one special token separates documents, so it is BOS, EOS and PAD.
        only_id, only_text = specials[0]
        self.bos_id = self.eos_id = self.pad_id = only_id
        self.add_bos, self.stop_ids = True, (only_id,)
        self.chat_template = None
        self._specials = {"bos_token": only_text, "eos_token": only_text}

    def special_tokens(self) -> dict[str, str]:
        return dict(self._specials)

    def tokenizer_json(self) -> dict[str, Any]:
        """The tokenizer as its tokenizer.json holds it (model type, vocab, merges, added tokens)."""
        return json.loads(self._tok.to_str())

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, list(enc.offsets)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # One call into Rust tokenises the whole list in parallel threads.
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_batch_arrays(self, texts: list[str]) -> list[np.ndarray]:
        # Texts up to piece_chars in one batched call (the caller bounds the batch); each longer one a
        # piece at a time, so that the tokenizer's memory never grows with a document.
        is_long = [len(t) > self.piece_chars for t in texts]
        short = iter(
            self._tok.encode_batch([t for t, long in zip(texts, is_long) if not long], add_special_tokens=False)
        )
        return [
            self._encode_in_pieces(t) if long else np.asarray(next(short).ids, dtype=np.int32)
            for t, long in zip(texts, is_long)
        ]

    def _encode_in_pieces(self, text: str) -> np.ndarray:
        """The ids of `text` as int32, encoded one `piece_spans` piece per call."""
        pieces = [
            np.asarray(self._tok.encode(text[a:b], add_special_tokens=False).ids, dtype=np.int32)
            for a, b in piece_spans(text, self.piece_chars)
        ]
        return np.concatenate(pieces)

    def fingerprint(self) -> str:
        # The whole tokenizer.json as loaded (vocabulary, merges, normalizer, ...), plus the special ids read
        # from the folder's config files.
        digest = hashlib.blake2b(self._tok.to_str().encode(), digest_size=16).hexdigest()
        return f"{super().fingerprint()}:{digest}"

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def decode_with_specials(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def save_hf_files(self, out_dir: Path, chat_template: str | None) -> list[str]:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`, so that
        `transformers.AutoTokenizer.from_pretrained(out_dir)` has the same ids, specials and template.

        Returns the file names written.
        """
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(out_dir / "tokenizer.json"))
        specials = self.special_tokens()
        if self.pad_id != self.eos_id or "pad_token" in specials:
            specials["pad_token"] = self._tok.id_to_token(self.pad_id)
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **{k: specials.get(k) for k in ("bos_token", "eos_token", "pad_token")},
            **{k: v for k, v in specials.items() if k not in ("bos_token", "eos_token", "pad_token")},
            "add_bos_token": self.add_bos,
            "add_eos_token": False,
            "model_max_length": self._config.get("model_max_length", _NO_MAX_LENGTH),
            "clean_up_tokenization_spaces": bool(self._config.get("clean_up_tokenization_spaces", False)),
        }
        if chat_template is not None:
            config["chat_template"] = chat_template
        (out_dir / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        (out_dir / "special_tokens_map.json").write_text(
            json.dumps(specials, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


def _load_rust_tokenizer(file: Path) -> Any:
    from tokenizers import Tokenizer as RustTokenizer

    if not file.is_file():
        raise DataError(f"tokenizer file {file} does not exist (config key 'data.tokenizer')")
    try:
        json.loads(file.read_text(encoding="utf-8"))
        tok = RustTokenizer.from_file(str(file))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{file}: not valid JSON, so not a tokenizer.json ({e})") from None
    except Exception as e:  # the Rust side raises a bare Exception for a schema mismatch
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{file}: not a Hugging Face tokenizer.json ({reason})") from None
    # Some tokenizer.json files carry truncation/padding settings from their training pipeline;
    # the data pipeline does both itself, so they must not silently cut or pad our texts.
    tok.no_truncation()
    tok.no_padding()
    return tok


def resolve_tokenizer_spec(spec: str, init_from: str = "") -> str:
    """`data.tokenizer` -> 'byte' or a path. 'auto' = the `model.init_from` checkpoint's own tokenizer
    when it has a tokenizer.json, else 'byte' (a random-init run, or a checkpoint without tokenizer files)."""
    if spec != "auto":
        return spec
    if not init_from:
        return "byte"
    folder = Path(init_from)
    if (folder / "tokenizer.json").is_file():
        return str(folder)
    slow = [n for n in ("tokenizer.model", "vocab.json", "tokenizer_config.json") if (folder / n).is_file()]
    if slow:
        # Falling back to bytes here would train a checkpoint on ids it never saw: refuse instead.
        raise DataError(
            f"{folder} has tokenizer files ({', '.join(slow)}) but no tokenizer.json, which is the "
            "format tracetrain reads; save it with a fast tokenizer (tokenizer.save_pretrained) or set "
            "data.tokenizer"
        )
    return "byte"


def check_tokenizer_file(spec: str) -> None:
    """A `data.tokenizer` path names a tokenizer.json, or a folder holding one: DataError when it is not
    there (checked before any setting of the run, so a wrong path is the error named)."""
    if spec in ("auto", "byte"):
        return
    path = Path(spec)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise DataError(f"tokenizer file {file} does not exist (config key 'data.tokenizer')")


def load_tokenizer(spec: str, init_from: str = "") -> Tokenizer:
    """'byte' -> ByteTokenizer; 'auto' -> see `resolve_tokenizer_spec`; otherwise a Hugging Face tokenizer
    folder or a tokenizer.json file. Pass `model.init_from` as `init_from` for 'auto'."""
    spec = resolve_tokenizer_spec(spec, init_from)
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


def check_vocab(tok: Tokenizer, model_vocab_size: int) -> None:
    """Raise DataError if the tokenizer can produce ids the model's embedding has no row for."""
    if tok.vocab_size > model_vocab_size:
        raise DataError(
            f"tokenizer {tok.name} has {tok.vocab_size} ids but the model's embedding has "
            f"{model_vocab_size} rows; use a larger preset or set model.vocab_size >= "
            f"{tok.vocab_size}"
        )
