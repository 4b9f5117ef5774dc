"""Tokenised rows on disk, memory-mapped: data larger than memory trains from a file of rows.

Every `data.kind` tokenised ahead (text corpora, instruction and chat files, the synthetic task) ends up
here. One entry is a folder of flat int32 arrays, (num_rows, seq_len) each, per split:

    <cache_dir>/<kind>-<key>/train.input_ids.i32   train.labels.i32   train.position_ids.i32   ...
                             eval.input_ids.i32    ...
                             meta.json             row counts, the data statistics (and the held-out
                                                   prompt/response pairs of instruction data), written last

`key` is a hash of everything the rows depend on: the data file's bytes (and the held-out file's), the
tokenizer (its tokenizer.json and special ids; a chat template's text), and the data settings that shape
rows (seq_len, pack, eval_fraction, fields, templates, seed, ...). So a second run on the same data
reuses the rows without tokenising again, and a changed file is never mistaken for the old one.

An entry is built in `.tmp-<kind>-<key>-<pid>` and renamed into place once complete (atomic on POSIX):
an interrupted build leaves no entry that looks usable, and of several processes building one entry
(ranks of one job) the first rename wins and the others use it. The folder holds nothing but entries
(the trainer's is `<train.output_dir>/.cache/data`); deleting it only costs the next run its
tokenisation. Without a cache folder the arrays go to a temporary folder that is deleted as soon as they
are mapped (the mappings stay valid), so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from tracetrain.progress import Progress

CACHE_VERSION = 2  # 2: meta.json holds the arrays' digest, checked on every use
DATA_CACHE_DIR = ".cache/data"  # the trainer's cache folder, under train.output_dir
ROW_KEYS = ("input_ids", "labels", "position_ids", "document_ids")
SPLITS = ("train", "eval")
_HASH_CHUNK_BYTES = 8 << 20

# build(folder) -> meta: writes the arrays into `folder`, returns {"rows": {split: n}, "stats": {...}, ...}
Build = Callable[[Path], dict[str, Any]]


def content_digest(path: str, progress: Progress | None = None) -> str:
    """blake2b of a file's bytes, or of every file under a folder (relative names and bytes, in name order)."""
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    return files_digest(files, root if root.is_dir() else None, root.name, progress)


def files_digest(files: list[Path], root: Path | None, label: str, progress: Progress | None = None) -> str:
    """blake2b of the files' bytes in the order given (with their names relative to `root`, when given)."""
    total = sum(f.stat().st_size for f in files)
    h = hashlib.blake2b(digest_size=16)
    done = 0
    for file in files:
        h.update(str(file.relative_to(root)).encode() if root is not None else b"")
        with open(file, "rb") as f:
            while chunk := f.read(_HASH_CHUNK_BYTES):
                h.update(chunk)
                done += len(chunk)
                if progress:
                    progress(f"checking {label}", done, total, "bytes")
    return h.hexdigest()


def entry_key(parts: dict[str, Any]) -> str:
    """A short hash of the parts (JSON-serialisable) that decide an entry's contents."""
    text = json.dumps({"version": CACHE_VERSION, **parts}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def row_file(folder: Path, split: str, key: str) -> Path:
    return folder / f"{split}.{key}.i32"


@contextlib.contextmanager
def row_writers(folder: Path, split: str) -> Iterator[dict[str, BinaryIO]]:
    """One split's four row files, open for appending rows (int32, row after row). Plain writes, not a
    writable map: pages written through a map would count as this process's resident memory."""
    with contextlib.ExitStack() as stack:
        yield {key: stack.enter_context(open(row_file(folder, split, key), "wb")) for key in ROW_KEYS}


def _open_rows(folder: Path, split: str, num_rows: int, seq_len: int) -> dict[str, torch.Tensor]:
    """The four arrays of a split as int32 tensors over copy-on-write memory maps (nothing is read now)."""
    shape = (num_rows, seq_len)
    if num_rows == 0:
        return {key: torch.zeros(shape, dtype=torch.int32) for key in ROW_KEYS}
    # Mode "c": writable (torch wants that) but private; the file is never changed.
    return {
        key: torch.from_numpy(np.memmap(row_file(folder, split, key), np.int32, "c", shape=shape)) for key in ROW_KEYS
    }


def _complete(folder: Path) -> dict[str, Any] | None:
    """The meta of a finished entry whose arrays all have their sizes, else None."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        seq_len = int(meta["seq_len"])
        for split in SPLITS:
            size = int(meta["rows"][split]) * seq_len * 4
            if any(row_file(folder, split, key).stat().st_size != size for key in ROW_KEYS):
                return None
        # The bytes too, not only the sizes: a damaged entry of the right size would train on wrong tokens
        # (and a later resume would blame the unchanged data file). One read of the arrays, per run start.
        if meta["digest"] != _arrays_digest(folder):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return dict(meta)


def _arrays_digest(folder: Path) -> str:
    return files_digest(sorted(folder.glob("*.i32")), folder, "token cache")


def _write_meta(folder: Path, meta: dict[str, Any]) -> None:
    for array in folder.glob("*.i32"):  # the arrays reach the disk before the meta that vouches for them
        with open(array, "rb") as f:
            os.fsync(f.fileno())
    meta["digest"] = _arrays_digest(folder)
    (folder / "meta.json").write_text(json.dumps(meta, indent=2))


def write_rows(out: dict[str, BinaryIO], rows: dict[str, torch.Tensor]) -> None:
    """Append rows (the four tensors of consecutive rows) to a split's files (`row_writers`), as int32."""
    for key in ROW_KEYS:
        rows[key].to(torch.int32).numpy().tofile(out[key])


def open_or_build(
    cache_dir: str | Path | None, key: str, build: Build, kind: str = "text"
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any], bool]:
    """({split: rows}, meta, reused) for entry `<kind>-<key>`: the cached entry when complete, else built now.

    `build(folder)` writes the split arrays (`row_writers`) and returns the meta ({"rows": {split: n},
    "seq_len": ..., "stats": {...}}).
    """
    if cache_dir is None:
        tmp = Path(tempfile.mkdtemp(prefix="tracetrain-rows-"))
        try:
            meta = build(tmp)
            return _open_all(tmp, meta), meta, False
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # the maps stay valid without their names
    root = Path(cache_dir)
    final = root / f"{kind}-{key}"
    meta_found = _complete(final)
    if meta_found is not None:
        return _open_all(final, meta_found), meta_found, True
    if final.exists():  # an unfinished or damaged entry of ours: only this cache writes here
        shutil.rmtree(final, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{kind}-{key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        meta = build(tmp)
        _write_meta(tmp, meta)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same entry first: use its copy
            if _complete(final) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _open_all(final, meta), meta, False


def _open_all(folder: Path, meta: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    return {split: _open_rows(folder, split, int(meta["rows"][split]), int(meta["seq_len"])) for split in SPLITS}
