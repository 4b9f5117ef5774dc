"""Read a Hugging Face checkpoint slice by slice: each rank reads only the blocks of the tensors it owns.

`HFCheckpoint` (made by models/hf.py `open_hf_checkpoint`) indexes a single or sharded safetensors
checkpoint (names from the index or the header, never the data). `fill(local, name, shape, offsets)` copies the block of tensor `name` that
starts at `offsets` and has `local`'s shape — an FSDP dim-0 shard, a TP row or column shard, a pipeline
stage's layers — through `safe_open(...).get_slice`, which reads only that block from the file. One file
is open at a time, so a rank's host memory holds its shards, one block in flight and the touched pages
of one file (benchmarks/shard_load_rss.py measures it). `materialize_parts` (models/build.py) calls
`fill` for every parameter of this rank's parts; `load_hf_weights` (models/hf.py) for a whole model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tracetrain.errors import CheckpointError
from tracetrain.safe_load import open_safetensors

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved; recomputed here


def local_name(hf_name: str) -> str:
    """'model.layers.0.self_attn.q_proj.weight' -> 'layers.0.self_attn.q_proj.weight'."""
    return hf_name.removeprefix("model.")


def list_some(names: set[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(sorted(names)[:limit]) + more


class HFCheckpoint:
    """A HF checkpoint's tensors by local name (no `model.` prefix), read block by block."""

    def __init__(self, path: Path, weight_map: dict[str, str], *, tied: bool = False) -> None:
        """`weight_map`: the file's key -> the file holding it (models/hf.py `open_hf_checkpoint` reads it)."""
        self.path = path
        stored = {k: v for k, v in weight_map.items() if not k.endswith(IGNORED_SUFFIXES)}
        self.keys = {local_name(k): k for k in stored}  # local name -> the file's key
        self.files = {local_name(k): v for k, v in stored.items()}
        if tied:  # lm_head is the embedding (as in HF, which ties after loading): a saved copy is skipped
            self.keys.pop("lm_head.weight", None)
            self.files.pop("lm_head.weight", None)
        self._open_file: str | None = None
        self._handle: Any = None

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Every tensor the model expects (local name -> full shape) is stored with that shape, and
        nothing else is; one CheckpointError line otherwise. Reads the headers only."""
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
        file = self.files[name]
        if file != self._open_file:
            self.close()  # one file mapped at a time: its touched pages leave this process's memory
            self._handle = open_safetensors(self.path / file).__enter__()
            self._open_file = file
        try:
            return self._handle.get_slice(self.keys[name])
        except Exception:  # safetensors raises its own error type for a key the header lacks
            raise CheckpointError(
                f"{self.path / file}: tensor '{self.keys[name]}' is listed in the index but not in the file"
            ) from None

    @torch.no_grad()
    def fill(self, local: torch.Tensor, name: str, shape: tuple[int, ...], offsets: tuple[int, ...]) -> bool:
        """Copy the block of `name` at `offsets` (of `local`'s shape) into `local`; False if not stored."""
        if name not in self.files:
            return False
        if local.numel() == 0:
            return True
        block = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))
        local.copy_(self._slice(name)[block] if block else self._slice(name)[:])
        return True

    def close(self) -> None:
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
        self._handle, self._open_file = None, None
