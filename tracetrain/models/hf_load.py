"""Read a Hugging Face checkpoint slice by slice: each rank reads only the blocks of the tensors it owns.

`HFCheckpoint` (made by models/hf.py `open_hf_checkpoint`) indexes a single or sharded safetensors
checkpoint (names from the index, shapes from the headers via `safe_open`, never the data).
`fill(local, name, shape, offsets)` copies the block of tensor `name` that starts at `offsets` and has
`local`'s shape — an FSDP dim-0 shard, a TP row or column shard, a pipeline stage's layers — reading
only that block's rows from the file, 64 MiB at a time, with plain reads rather than a memory map: a
rank's host memory holds its own shards plus one read, whatever the model's size, and no page of the
checkpoint stays mapped into it (benchmarks/shard_load_rss.py measures it). `materialize_parts`
(models/build.py) calls `fill` for every parameter of this rank's parts; `load_hf_weights` (models/hf.py)
for a whole model. A model tensor may be several checkpoint tensors (`Piece`: Mixtral's and Qwen3-MoE's one
tensor per expert, stacked along dim 0 here): an expert-parallel rank then reads only its experts' files.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tracetrain.errors import CheckpointError
from tracetrain.safe_load import open_safetensors

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved; recomputed here
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
_READ_BYTES = 64 * 2**20  # one read: the most a rank holds beyond its own shards while loading


def local_name(hf_name: str) -> str:
    """'model.layers.0.self_attn.q_proj.weight' -> 'layers.0.self_attn.q_proj.weight'."""
    return hf_name.removeprefix("model.")


def list_some(names: set[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(sorted(names)[:limit]) + more


@dataclass(frozen=True)
class Piece:
    """Rows [start, start + rows) (dim 0) of one of the model's tensors, as stored in a checkpoint.

    They are rows [hf_start, hf_start + rows) of the checkpoint's tensor `hf_name` (a local name, no
    `model.`) of the same trailing shape; or, `stacked`, the model's row `start` (rows = 1) is the whole
    checkpoint tensor `hf_name` of shape = the model's trailing shape (one expert of a MoE block).
    """

    hf_name: str
    start: int
    rows: int
    hf_start: int = 0
    stacked: bool = False


Pieces = Callable[[str, tuple[int, ...]], list[Piece]]  # (model's local name, full shape) -> its pieces


def _same_name(name: str, shape: tuple[int, ...]) -> list[Piece]:
    return [Piece(name, 0, shape[0] if shape else 1)]


def checkpoint_shapes(shapes: dict[str, tuple[int, ...]], pieces: Pieces) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors (local name -> full shape) that hold the model's tensors `shapes`."""
    stored: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        for p in pieces(name, shape):
            if p.stacked:
                stored[p.hf_name] = shape[1:]
            else:  # several model tensors may fill one fused checkpoint tensor: it has the rows of all
                rows = max(p.hf_start + p.rows, stored.get(p.hf_name, (0,))[0])
                stored[p.hf_name] = (rows, *shape[1:])
    return stored


class HFCheckpoint:
    """A HF checkpoint's tensors by local name (no `model.` prefix), read block by block.

    `pieces` says where each of the model's tensors lies in the checkpoint (models/arch.py: the family's
    naming); by default a model tensor is the checkpoint tensor of the same name."""

    def __init__(
        self, path: Path, weight_map: dict[str, str], *, tied: bool = False, pieces: Pieces | None = None
    ) -> None:
        """`weight_map`: the file's key -> the file holding it (models/hf.py `open_hf_checkpoint` reads it)."""
        self.path = path
        self.pieces = pieces or _same_name
        stored = {k: v for k, v in weight_map.items() if not k.endswith(IGNORED_SUFFIXES)}
        self.keys = {local_name(k): k for k in stored}  # local name -> the file's key
        self.files = {local_name(k): v for k, v in stored.items()}
        if tied:  # lm_head is the embedding (as in HF, which ties after loading): a saved copy is skipped
            self.keys.pop("lm_head.weight", None)
            self.files.pop("lm_head.weight", None)
        self._open_file: str | None = None
        self._handle: Any = None
        self._headers: dict[Path, tuple[int, dict[str, Any]]] = {}

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Every tensor the model expects (local name -> full shape) is stored with that shape, and
        nothing else is; one CheckpointError line otherwise. Reads the headers only."""
        shapes = checkpoint_shapes(shapes, self.pieces)
        missing, unexpected = shapes.keys() - self.files.keys(), self.files.keys() - shapes.keys()
        if missing:
            raise CheckpointError(f"{self.path}: tensors missing from the checkpoint: {list_some(missing)}")
        if unexpected:
            raise CheckpointError(f"{self.path}: unexpected tensors in the checkpoint: {list_some(unexpected)}")
        for name in sorted(shapes, key=lambda n: self.files[n]):
            stored = tuple(self._slice(name).get_shape())
            if stored != shapes[name]:
                raise CheckpointError(
                    f"{self.path / self.files[name]}: tensor '{self.keys[name]}' has shape {stored} "
                    f"but the model expects {shapes[name]}"
                )
        self.close()

    def _slice(self, name: str) -> Any:
        """The safetensors slice handle of `name` (headers and shapes only: the data is read by `_entry`)."""
        file = self.files[name]
        if file != self._open_file:
            self.close()
            self._handle = open_safetensors(self.path / file).__enter__()  # one CheckpointError line if corrupt
            self._open_file = file
        try:
            return self._handle.get_slice(self.keys[name])
        except Exception:  # safetensors raises its own error type for a key the header lacks
            raise CheckpointError(
                f"{self.path / file}: tensor '{self.keys[name]}' is listed in the index but not in the file"
            ) from None

    def _entry(self, name: str) -> tuple[Path, torch.dtype, int]:
        """(file, stored dtype, absolute byte offset of the tensor's data), from the file's header."""
        file = self.path / self.files[name]
        if file not in self._headers:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                self._headers[file] = (8 + size, json.loads(f.read(size)))
        start, header = self._headers[file]
        entry = header[self.keys[name]]
        if entry["dtype"] not in _DTYPES:
            raise CheckpointError(f"{file}: tensor '{self.keys[name]}' has dtype {entry['dtype']}, not a float dtype")
        return file, _DTYPES[entry["dtype"]], start + entry["data_offsets"][0]

    @torch.no_grad()
    def fill(self, local: torch.Tensor, name: str, shape: tuple[int, ...], offsets: tuple[int, ...]) -> bool:
        """Copy the block at `offsets` (of `local`'s shape) of the model's tensor `name` (full `shape`) into
        `local`, from the checkpoint pieces that hold it; False if the checkpoint does not hold it."""
        pieces = self.pieces(name, shape)
        if any(p.hf_name not in self.files for p in pieces):
            return False
        start = offsets[0] if shape else 0
        stop = start + (local.shape[0] if shape else 1)
        for p in pieces:
            lo, hi = max(start, p.start), min(stop, p.start + p.rows)
            if p.stacked:
                for row in range(lo, hi):
                    self._fill_block(local[row - start], p.hf_name, shape[1:], offsets[1:])
            elif lo < hi:
                rows = local[lo - start : hi - start] if shape else local
                hf_offsets = (p.hf_start + lo - p.start, *offsets[1:]) if shape else offsets
                self._fill_block(rows, p.hf_name, shape, hf_offsets)
        return True

    def _fill_block(self, local: torch.Tensor, name: str, shape: tuple[int, ...], offsets: tuple[int, ...]) -> bool:
        """Copy the block of the checkpoint's tensor `name` at `offsets` (of `local`'s shape) into `local`.

        Reads with plain file reads, not a memory map: only the block's rows cross into this process (its
        columns are cut from them), at most `_READ_BYTES` at a time, and no page of the file stays mapped."""
        if name not in self.files:
            return False
        if local.numel() == 0:
            return True
        file, dtype, data = self._entry(name)
        itemsize = torch.empty((), dtype=dtype).element_size()
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        rows_per_read = max(1, _READ_BYTES // (row * itemsize))
        first = offsets[0] if shape else 0
        count = local.shape[0] if shape else 1
        trailing = tuple(slice(o, o + n) for o, n in zip(offsets[1:], local.shape[1:], strict=True))
        with open(file, "rb", buffering=0) as f:
            for r in range(0, count, rows_per_read):
                n = min(rows_per_read, count - r)
                raw = bytearray(n * row * itemsize)
                f.seek(data + (first + r) * row * itemsize)
                if f.readinto(raw) != len(raw):
                    raise CheckpointError(f"{file}: tensor '{self.keys[name]}' is cut short (the file is truncated)")
                rows = torch.frombuffer(raw, dtype=dtype).view(n, *shape[1:])  # no copy of the bytes
                if shape:
                    local[r : r + n].copy_(rows[(slice(None), *trailing)])
                else:
                    local.copy_(rows.view(()))
        return True

    def close(self) -> None:
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
        self._handle, self._open_file = None, None
