"""The built-in synthetic task: string transformations a tiny model learns in minutes on a CPU.

No files are needed, so `tracetrain train` works out of the box and an end-to-end test can check that
the loss really falls and that greedy generation gets answers right. Each example is one of:

    reverse: abcd   ->  dcba
    upper: abcd     ->  ABCD
    sort: dbca      ->  abcd
    double: abc     ->  aabbcc

over random lowercase words of 3-8 letters. The "plain" template is always used, whatever
`data.template` says: short prompts keep a 128-token byte-level row full of useful tokens (~6
examples per row). Every word occurs in one example only, so the held-out words are never trained on.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable

from tracetrain.config import DataSection
from tracetrain.data.instruction import Example, examples_documents, format_prompt, held_out_split
from tracetrain.data.packing import DataStats, Documents
from tracetrain.data.tokenizer import Tokenizer

TASKS: dict[str, Callable[[str], str]] = {
    "reverse": lambda w: w[::-1],
    "upper": str.upper,
    "sort": lambda w: "".join(sorted(w)),
    "double": lambda w: "".join(c + c for c in w),
}
MIN_LETTERS, MAX_LETTERS = 3, 8


def generate_examples(num_examples: int, seed: int) -> list[Example]:
    """`num_examples` (prompt, response) pairs with pairwise distinct input words, fixed by `seed`."""
    rng = random.Random(seed)
    names = list(TASKS)
    seen: set[str] = set()
    examples: list[Example] = []
    while len(examples) < num_examples:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(MIN_LETTERS, MAX_LETTERS)))
        if word in seen:  # a repeated word could land on both sides of the held-out split
            continue
        seen.add(word)
        task = rng.choice(names)
        examples.append((format_prompt("plain", f"{task}: {word}"), TASKS[task](word)))
    return examples


def synthetic_splits(data: DataSection, stats: DataStats) -> tuple[list[Example], list[Example]]:
    """`data.kind = "synthetic"`: the generated (train, eval) examples."""
    examples = generate_examples(data.synthetic_examples, data.seed)
    train_idx, eval_idx = held_out_split(len(examples), data.eval_fraction, data.seed)
    stats.examples_read = len(examples)
    return [examples[i] for i in train_idx], [examples[i] for i in eval_idx]


def synthetic_documents(data: DataSection, tok: Tokenizer) -> Documents:
    """`data.kind = "synthetic"`: generated examples -> both splits' documents (`record_rows` packs them)."""
    stats = DataStats()
    return examples_documents(*synthetic_splits(data, stats), tok, data, stats, "synthetic task")
