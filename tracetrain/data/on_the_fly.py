"""Rows tokenised when the loader asks for them (`data.tokenize = "on_the_fly"`), one example per row.

Tokenising ahead of time (the default) makes the training loop's data cost nearly zero. This mode is
what many pipelines do instead — tokenise in `__getitem__` — so start-up is instant and the work
moves into the DataLoader: with `data.num_workers = 0` it runs on the training thread and the GPU
waits for it; with workers it overlaps the step. The profiler's data-loader analysis is tested on
exactly this difference. Packing needs every length in advance, so rows here are padded, not packed.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tracetrain.config import DataSection
from tracetrain.data.instruction import Example, tokenize_examples
from tracetrain.data.packing import DataStats, PackedDataset, pack_documents
from tracetrain.data.tokenizer import Tokenizer

# Workers are forked after the tokenizer may have used its thread pool; its own parallelism inside
# each worker would only oversubscribe the cores.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class OnTheFlyDataset(torch.utils.data.Dataset):
    """Same interface as PackedDataset for the loader: `len`, `[i] -> dict of (seq_len,) int64`."""

    def __init__(
        self, examples: list[tuple[str, str]], tok: Tokenizer, seq_len: int, train_on_prompt: bool, name: str = "train"
    ) -> None:
        self.examples, self.tok = examples, tok
        self._seq_len, self.train_on_prompt, self.name = seq_len, train_on_prompt, name

    @property
    def seq_len(self) -> int:
        return self._seq_len

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        docs, _ = tokenize_examples([self.examples[i]], self.tok, self._seq_len, self.train_on_prompt, DataStats())
        if not docs:  # dropped (empty response or prompt too long): a row with no targets
            docs = [([self.tok.pad_id], [-100])]
        rows = pack_documents(docs, self._seq_len, self.tok.pad_id, pack=False)
        return {k: v[0] for k, v in rows.items()}


def on_the_fly_datasets(
    train_examples: list[Example], eval_examples: list[Example], tok: Tokenizer, data: DataSection, stats: DataStats
) -> tuple[Any, PackedDataset]:
    """`data.tokenize = "on_the_fly"`: training rows tokenised by the loader; the (small) eval split is
    still tokenised ahead, one example per row."""
    order = torch.randperm(len(train_examples), generator=torch.Generator().manual_seed(data.seed)).tolist()
    train = OnTheFlyDataset([train_examples[i] for i in order], tok, data.seq_len, data.train_on_prompt)
    eval_docs, eval_kept = tokenize_examples(eval_examples, tok, data.seq_len, data.train_on_prompt, stats)
    eval_rows = pack_documents(eval_docs, data.seq_len, tok.pad_id, False)
    stats.train_examples, stats.eval_examples = len(train), len(eval_kept)
    return train, PackedDataset(eval_rows, examples=eval_kept, name="eval")
