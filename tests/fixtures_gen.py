"""Data the tests build for themselves, so that a fresh clone (no downloads, no ../shared) tests every
feature: an English-like text corpus, a byte-level BPE tokenizer trained on it (GPT-2's design at a
small vocabulary), a Hugging Face tokenizer folder with a chat template, GSM8K-like instruction rows and
Dolly-like records. Everything is generated from fixed seeds: the same bytes on every machine.

tests/conftest.py wraps these in session fixtures; the functions take the folder to write into, except
the corpus and the BPE, built once per process (test modules read the BPE's ids at import).
"""

from __future__ import annotations

import atexit
import functools
import json
import random
import shutil
import tempfile
from pathlib import Path

ENDOFTEXT = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPEAKERS = ["FIRST CITIZEN", "MENENIUS", "CORIOLANUS", "VOLUMNIA", "ROMEO", "JULIET", "NURSE", "KING RICHARD"]
_WORD_TEXT = (
    "the and to of I you my a that in is not with me it for be his your this but he have as thou so him "
    "will what thy all her do no by shall if are we thee our on lord now good from sir come they more "
    "would well let was here then there how love know man like hath may upon make us such say one yet "
    "king go should than when can which must them see some their take heart father mine death night "
    "world sweet blood time day life hand eyes heaven honour grace noble tongue fair brother naïve café "
    "I'll 'tis o'er don't we'll you're"
)
WORDS = _WORD_TEXT.split()
PUNCTUATION = [",", ",", ".", ";", "!", "?", ":", ""]


def text_corpus(num_chars: int = 1_100_000, seed: int = 0) -> str:
    """A play-like text (speaker lines, verse of common words, punctuation, contractions, a few digits
    and accented words), about the size and shape of tinyshakespeare."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < num_chars:
        lines = [f"{rng.choice(SPEAKERS)}:"]
        for _ in range(rng.randint(1, 6)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(4, 11))]
            if rng.random() < 0.05:
                words.insert(rng.randrange(len(words)), str(rng.randint(1, 1999)))
            line = " ".join(words)
            lines.append(line[0].upper() + line[1:] + rng.choice(PUNCTUATION))
        block = "\n".join(lines) + "\n\n"
        parts.append(block)
        size += len(block)
    return "".join(parts)[:num_chars]


def train_bpe(path: Path, text: str, vocab_size: int = 2048) -> Path:
    """A byte-level BPE tokenizer.json like GPT-2's (its regex pre-tokenizer, every byte in the alphabet,
    <|endoftext|> as its one special token), trained on `text`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.split("\n\n"), trainer)
    tok.save(str(path))
    return path


@functools.cache
def bpe_json_path() -> Path:
    """The corpus (corpus.txt) and the BPE trained on it (bpe.json), in a folder removed at exit."""
    folder = Path(tempfile.mkdtemp(prefix="tracetrain-tests-"))
    atexit.register(shutil.rmtree, folder, True)
    text = text_corpus()
    (folder / "corpus.txt").write_text(text, encoding="utf-8")
    return train_bpe(folder / "bpe.json", text)


def bpe_ids() -> tuple[int, int]:
    """(the id of <|endoftext|>, the BPE's vocabulary size: the id of the first special token added)."""
    return bpe_token_id(ENDOFTEXT), bpe_vocab_size()


def bpe_token_id(token: str) -> int:
    """The BPE's id of `token`, written as in its vocabulary ("\u010a" is byte-level "\n")."""
    from tokenizers import Tokenizer

    found = Tokenizer.from_file(str(bpe_json_path())).token_to_id(token)
    assert found is not None, token
    return found


def bpe_vocab_size() -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(bpe_json_path())).get_vocab_size()


def chat_tokenizer_folder(folder: Path, bpe_json: Path) -> Path:
    """A Hugging Face tokenizer folder: the BPE plus ChatML's specials, a chat template, eos = <|im_end|>,
    no BOS (as Qwen's), and a generation_config naming both stop ids."""
    from tokenizers import AddedToken, Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(bpe_json))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in (IM_START, IM_END)])
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "add_bos_token": False,
        "model_max_length": 1024,
        "chat_template": CHATML,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    stops = [tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT)]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return folder


def gsm8k_like(path: Path, num_rows: int = 7473, seed: int = 0) -> Path:
    """GSM8K's layout and size (its train split has 7,473 rows): {"question", "answer"}, worked steps with
    <<calculator>> notes, the final number after "####"."""
    rng = random.Random(seed)
    names = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Mark"]
    things = ["clips", "apples", "books", "stickers", "pencils", "marbles"]
    with path.open("w", encoding="utf-8") as f:
        for _ in range(num_rows):
            name, thing = rng.choice(names), rng.choice(things)
            a, b, c = rng.randint(2, 90), rng.randint(2, 9), rng.randint(1, 50)
            question = (
                f"{name} had {a} {thing}. Then {name} bought {b} times as many {thing} and gave away {c}. "
                f"How many {thing} does {name} have now?"
            )
            bought, total = a * b, a + a * b - c
            answer = (
                f"{name} bought {a} * {b} = <<{a}*{b}={bought}>>{bought} {thing}.\n"
                f"After giving {c} away: {a} + {bought} - {c} = <<{a}+{bought}-{c}={total}>>{total}.\n#### {total}"
            )
            f.write(json.dumps({"question": question, "answer": answer}) + "\n")
    return path


def dolly_like(path: Path, num_rows: int = 20, seed: int = 0) -> Path:
    """Dolly's layout: {"instruction", "context", "response", "category"}, context empty in some rows."""
    rng = random.Random(seed)
    categories = ["open_qa", "closed_qa", "summarization", "brainstorming", "information_extraction"]
    with path.open("w", encoding="utf-8") as f:
        for i in range(num_rows):
            words = [rng.choice(WORDS) for _ in range(rng.randint(20, 60))]
            row = {
                "instruction": f"Question {i}: what does the passage say about {rng.choice(WORDS)}?",
                "context": " ".join(words) if i % 3 else "",
                "response": " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40))) + ".",
                "category": rng.choice(categories),
            }
            f.write(json.dumps(row) + "\n")
    return path
