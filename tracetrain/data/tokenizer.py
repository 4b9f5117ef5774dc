"""Tokenizers: a built-in byte-level one and Hugging Face `tokenizer.json` files.

Both follow one small interface (`Tokenizer`). `encode` never adds special tokens: the data pipeline
places BOS/EOS itself, so that the same code handles tokenizers whose post-processor adds a BOS
(Llama) and those that add nothing (GPT-2). `decode` drops special ids, so generated text reads clean.

The byte tokenizer needs no files and gives the tiny default model a 259-id vocabulary:

    ids 0..255  the UTF-8 bytes
    256 BOS, 257 EOS, 258 PAD
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path

from tracetrain.errors import DataError

# Special-token spellings by family, most specific first. GPT-2 has only <|endoftext|>, so it ends up
# as both BOS and EOS, which is how GPT-2 itself was trained.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "<|eot_id|>", "</s>", "<eos>", "<|endoftext|>")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


class Tokenizer(ABC):
    """Text <-> ids. Subclasses set `name`, `vocab_size`, `bos_id`, `eos_id` and `pad_id`."""

    name: str
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without any special tokens added."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; special ids (BOS, EOS, PAD) are skipped."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` over many texts; subclasses override it where a batched path is faster."""
        return [self.encode(t) for t in texts]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_id}, eos={self.eos_id}, pad={self.pad_id})")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0-255, plus BOS 256, EOS 257, PAD 258 (vocab_size 259)."""

    def __init__(self) -> None:
        self.name = "byte"
        self.bos_id, self.eos_id, self.pad_id = 256, 257, 258
        self.vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # A model can emit a byte sequence that is not valid UTF-8 (e.g. half a character); replace
        # it with U+FFFD rather than fail in the middle of an evaluation.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json`, run by the `tokenizers` library (Rust, batched)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"tokenizer file {path} does not exist (config key 'data.tokenizer')")
        try:
            json.loads(path.read_text(encoding="utf-8"))
            self._tok = RustTokenizer.from_file(str(path))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: not valid JSON, so not a tokenizer.json ({e})") from None
        except Exception as e:  # the Rust side raises a bare Exception for a schema mismatch
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"{path}: not a Hugging Face tokenizer.json ({reason})") from None
        # Some tokenizer.json files carry truncation/padding settings from their training pipeline;
        # the data pipeline does both itself, so they must not silently cut or pad our texts.
        self._tok.no_truncation()
        self._tok.no_padding()
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id, self.pad_id = self._find_specials(path)

    def _find_specials(self, path: Path) -> tuple[int, int, int]:
        """(bos, eos, pad) ids, looked up among the added tokens first, then the whole vocabulary."""
        added = {tok.content: i for i, tok in self._tok.get_added_tokens_decoder().items()}

        def first(names: tuple[str, ...]) -> int | None:
            for name in names:
                if name in added:
                    return added[name]
            for name in names:
                if (i := self._tok.token_to_id(name)) is not None:
                    return i
            return None

        bos, eos, pad = first(_BOS_NAMES), first(_EOS_NAMES), first(_PAD_NAMES)
        if eos is None:
            raise DataError(f"{path}: no end-of-sequence token found (looked for {', '.join(_EOS_NAMES)})")
        # No BOS (e.g. Qwen2): the EOS doubles as the document separator, as in GPT-2.
        # No PAD: padding positions carry label -100 and their own document id, so any id will do.
        return (eos if bos is None else bos), eos, (eos if pad is None else pad)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # One call into Rust tokenises the whole list in parallel threads.
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(spec: str) -> Tokenizer:
    """'byte' -> ByteTokenizer; otherwise a path to a tokenizer.json (or a folder holding one)."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


def check_vocab(tok: Tokenizer, model_vocab_size: int) -> None:
    """Raise DataError if the tokenizer can produce ids the model's embedding has no row for."""
    if tok.vocab_size > model_vocab_size:
        raise DataError(f"tokenizer {tok.name} has {tok.vocab_size} ids but the model's embedding has "
                        f"{model_vocab_size} rows; use a larger preset or set model.vocab_size >= "
                        f"{tok.vocab_size}")
