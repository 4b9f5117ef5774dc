"""The two entry points the trainer calls: `build_datasets` (config -> rows) and `build_loader`
(rows -> an endless, resumable stream of batches).

Order is a pure function of (seed, epoch): epoch e visits the rows in `torch.randperm(n, seed + e)`
order, cut into batches. So a position is just (epoch, batches consumed in that epoch), and resuming
rebuilds the DataLoader with a sampler that starts there, without loading the skipped batches.

Position counts batches the *caller* took, not what worker processes prefetched: the DataLoader may
run `num_workers * prefetch_factor` batches ahead, and those are simply produced again after a resume.
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from tracetrain.config import DataSection
from tracetrain.data.chat import chat_documents, chat_template_file, iter_chat_examples
from tracetrain.data.files import require_data_path
from tracetrain.data.hf_datasets import is_hf
from tracetrain.data.instruction import (
    instruction_documents,
    instruction_splits,
    read_located_examples,
    tokenize_example,
)
from tracetrain.data.mixture import mixture_documents, source_section
from tracetrain.data.on_the_fly import on_the_fly_datasets
from tracetrain.data.packing import DataStats, PackedDataset, TokenizedExample
from tracetrain.data.preference import iter_pairs, preference_documents
from tracetrain.data.record_rows import DocumentsBuilder, build_record_datasets
from tracetrain.data.synthetic import generate_examples, synthetic_documents, synthetic_splits
from tracetrain.data.text import build_text_datasets, iter_documents
from tracetrain.data.tokenizer import Tokenizer, check_tokenizer_file
from tracetrain.errors import DataError
from tracetrain.progress import Progress

Batch = dict[str, torch.Tensor]  # each (batch, seq_len) int64

_DOCUMENTS: dict[str, DocumentsBuilder] = {
    "synthetic": synthetic_documents,
    "instruction": instruction_documents,
    "chat": chat_documents,
    "preference": preference_documents,
}


def check_data_files(data: DataSection) -> None:
    """Every file the data section names is there: data.path, data.eval_path, each data.sources path, a
    data.tokenizer path and a chat template file (an hf: dataset is looked up when read). Called before any
    check of the run's settings, so that a missing file is the error a user sees first (`build_datasets`
    reads them much later, after the settings are checked)."""
    if data.kind != "synthetic" or data.sources:
        for key in ("path", "eval_path"):
            if getattr(data, key):
                require_data_path(getattr(data, key), f"data.{key}")
        for i, source in enumerate(data.sources):
            require_data_path(source.path, f"data.sources[{i}].path")
        if data.kind in ("chat", "preference") or any(s.kind == "chat" for s in data.sources):
            chat_template_file(data)
    check_tokenizer_file(data.tokenizer)


def check_eval_not_training_data(data: DataSection) -> None:
    """data.eval_path naming the training file (the same split of a dataset) would measure the held-out
    loss on rows the model trains on: every evaluation, exact match and report would look better than
    it is. Splits name parts only of hf: datasets and save_to_disk folders."""
    if not data.eval_path:
        return
    spell = (lambda p: p) if is_hf(data.path) else os.path.realpath  # ./a.jsonl and /here/a.jsonl are one file
    if spell(data.eval_path) != spell(data.path):
        return
    splits = is_hf(data.path) or Path(data.path).is_dir()
    if not splits or data.split == data.eval_split:
        also = f" (split {data.split!r} for both)" if splits else ""
        raise DataError(
            f"config key 'data.eval_path': {data.eval_path!r} is data.path too{also}, so the held-out rows would "
            "be training rows; name another file, or leave it '' to hold out data.eval_fraction"
        )


def build_datasets(
    data: DataSection, tok: Tokenizer, *, cache_dir: str | Path | None = None, progress: Progress | None = None
) -> tuple[PackedDataset, PackedDataset, DataStats]:
    """(train, eval, stats) for `data.kind`; the eval split may have zero rows.

    Rows are tokenised ahead into memory-mapped row files: an entry of `cache_dir` (not for the
    synthetic task), reused while the data, tokenizer and settings are unchanged, or temporary files
    deleted once mapped; reporting to `progress`.
    `data.tokenize = "on_the_fly"` (instruction and synthetic data) leaves the training rows to the loader.
    """
    check_eval_not_training_data(data)
    if data.sources:
        return build_record_datasets(data, tok, mixture_documents, cache_dir, progress)
    if data.kind == "text":
        return build_text_datasets(data, tok, cache_dir, progress)
    if data.tokenize == "on_the_fly" and data.kind != "chat":
        stats = DataStats()
        splits = synthetic_splits(data, stats) if data.kind == "synthetic" else instruction_splits(data, stats)
        train, eval_ = on_the_fly_datasets(*splits, tok, data, stats)
        return train, eval_, stats
    # The synthetic task is generated in a moment: its rows are not worth a cache entry in the run folder.
    cache_dir = None if data.kind == "synthetic" else cache_dir
    return build_record_datasets(data, tok, _DOCUMENTS[data.kind], cache_dir, progress)


def tokenize_rows(data: DataSection, tok: Tokenizer, path: str = "") -> Iterator[TokenizedExample]:
    """Every example of a data file (default `data.path`) as the model sees it, in file order, before
    splitting, shuffling and packing: its location, text, ids and per-token trained mask.

    For inspection (statistics, showing trained tokens). Chat conversations are cut to `data.seq_len`
    as in training, preference sides to data.seq_len // 2; other kinds are whole. Bad rows raise or are skipped as in `build_datasets`.
    """
    if data.sources and not path:  # the sources in turn, one example of each at a time
        sources = [tokenize_rows(source_section(data, i), tok) for i in range(len(data.sources))]
        yield from (ex for group in itertools.zip_longest(*sources) for ex in group if ex is not None)
        return
    path = path or data.path
    if data.kind == "chat":
        yield from iter_chat_examples(data, tok, path, "data.path", DataStats(), data.split)
    elif data.kind == "preference":  # each pair's chosen side, then its rejected side
        yield from (
            side for _, pair in iter_pairs(data, tok, path, "data.path", DataStats(), data.split) for side in pair
        )
    elif data.kind == "instruction":
        for where, ex in read_located_examples(path, "data.path", data, data.split)[0]:
            yield TokenizedExample(where, ex[0] + ex[1], *tokenize_example(ex, tok, data.train_on_prompt))
    elif data.kind == "synthetic":
        for i, ex in enumerate(generate_examples(data.synthetic_examples, data.seed)):
            yield TokenizedExample(f"synthetic: {i}", ex[0] + ex[1], *tokenize_example(ex, tok, data.train_on_prompt))
    else:
        bos = [tok.bos_id] if tok.add_bos else []
        docs = iter_documents(path, "data.path", data.skip_bad_lines, data.text_field, split=data.split)
        for i, doc in enumerate(docs):
            # As training tokenises it (a long document in pieces: bounded tokenizer memory, same ids).
            ids = bos + tok.encode_batch_arrays([doc])[0].tolist() + [tok.eos_id]
            yield TokenizedExample(f"{path}: document {i}", doc, ids, [False] + [True] * (len(ids) - 1))


def batches_per_epoch(num_rows: int, batch_size: int, drop_last: bool) -> int:
    return num_rows // batch_size if drop_last else -(-num_rows // batch_size)


class EpochBatchSampler(Sampler[list[int]]):
    """Endless batches of row indices, epoch after epoch, starting at (start_epoch, start_batch).

    Endless so that one DataLoader (and its worker processes) serves the whole run, with no refill
    stall at epoch boundaries.
    """

    def __init__(
        self,
        num_rows: int,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        start_epoch: int = 0,
        start_batch: int = 0,
    ) -> None:
        self.num_rows, self.batch_size, self.shuffle = num_rows, batch_size, shuffle
        self.seed, self.drop_last = seed, drop_last
        self.start_epoch, self.start_batch = start_epoch, start_batch

    def epoch_order(self, epoch: int) -> list[int]:
        """Row indices in the order epoch `epoch` visits them."""
        if not self.shuffle:
            return list(range(self.num_rows))
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_rows, generator=gen).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        epoch, skip = self.start_epoch, self.start_batch
        num_batches = batches_per_epoch(self.num_rows, self.batch_size, self.drop_last)
        while True:
            order = self.epoch_order(epoch)
            for b in range(skip, num_batches):
                yield order[b * self.batch_size : (b + 1) * self.batch_size]
            epoch, skip = epoch + 1, 0


def _ignore_stop_signals(worker_id: int) -> None:
    """A data worker ignores SIGINT, SIGTERM and SIGHUP. A terminal's Ctrl-C and a scheduler's or systemd's
    stop reach every process of the job, and torch's workers die of SIGTERM (their own handler): the run
    then ended on "DataLoader worker exited unexpectedly" instead of saving at the step boundary (under
    torchrun, without any save). The run's process decides (train/faults.py) and ends its workers itself;
    a worker whose run died outright sees it gone and exits."""
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # train/faults.py STOP_SIGNALS
        signal.signal(stop, signal.SIG_IGN)


class StatefulLoader:
    """An endless iterator of batches whose position can be saved and restored exactly."""

    def __init__(
        self,
        dataset: PackedDataset,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int = 2,
    ) -> None:
        self.dataset, self.batch_size = dataset, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.num_workers, self.pin_memory, self.prefetch_factor = num_workers, pin_memory, prefetch_factor
        self.batches_per_epoch = batches_per_epoch(len(dataset), batch_size, drop_last)
        if self.batches_per_epoch == 0:
            raise DataError(
                f"the {dataset.name} data has {len(dataset)} rows of {dataset.seq_len} tokens, "
                f"fewer than one batch of {batch_size}; add data or lower the batch size"
            )
        self.epoch, self.batch_in_epoch = 0, 0
        self._iter: Iterator[Batch] | None = None

    def _start(self) -> Iterator[Batch]:
        sampler = EpochBatchSampler(
            len(self.dataset),
            self.batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            drop_last=self.drop_last,
            start_epoch=self.epoch,
            start_batch=self.batch_in_epoch,
        )
        workers = self.num_workers > 0
        loader = DataLoader(
            self.dataset,
            batch_sampler=sampler,
            num_workers=self.num_workers,
            # Pinned pages only pay off for asynchronous copies to a GPU.
            pin_memory=self.pin_memory and torch.cuda.is_available(),
            prefetch_factor=self.prefetch_factor if workers else None,
            persistent_workers=workers,
            # Its own generator: a DataLoader iterator otherwise draws its worker base
            # seed from the global RNG, and recreating the loader on resume would shift
            # the dropout random stream (resume would no longer be exact).
            generator=torch.Generator().manual_seed(self.seed),
            worker_init_fn=_ignore_stop_signals if workers else None,
        )
        return iter(loader)

    def __iter__(self) -> StatefulLoader:
        return self

    def __next__(self) -> Batch:
        if self._iter is None:
            self._iter = self._start()
        batch = next(self._iter)
        # Advance only now, once the caller holds the batch: this is the position a resume restores.
        self.batch_in_epoch += 1
        if self.batch_in_epoch == self.batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position (batches consumed) plus what it is only meaningful with."""
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "num_rows": len(self.dataset),
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the next batch is the one after the last one consumed."""
        mine = self.state_dict()
        changed = [
            f"{k} {state[k]!r} -> {mine[k]!r}"
            for k in ("num_rows", "batch_size", "shuffle", "seed", "drop_last")
            if state.get(k) != mine[k]
        ]
        if changed:
            raise DataError(
                f"cannot resume the data position: the {self.dataset.name} data or loader "
                f"changed since the checkpoint ({', '.join(changed)})"
            )
        self.close()
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])

    def close(self) -> None:
        """Drop the running DataLoader iterator (its worker processes exit with it)."""
        self._iter = None


def build_loader(
    dataset: PackedDataset,
    batch_size: int,
    data: DataSection,
    *,
    shuffle: bool = True,
    seed: int,
    drop_last: bool = True,
) -> StatefulLoader:
    """An endless `StatefulLoader` over `dataset` with the worker settings of the data config."""
    return StatefulLoader(
        dataset,
        batch_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        num_workers=data.num_workers,
        pin_memory=data.pin_memory,
        prefetch_factor=data.prefetch_factor,
    )


def iter_batches(dataset: PackedDataset, batch_size: int) -> Iterator[Batch]:
    """Rows in order, `batch_size` at a time, the last partial batch included (for evaluation)."""
    for start in range(0, len(dataset), batch_size):
        yield dataset.batch(start, start + batch_size)
