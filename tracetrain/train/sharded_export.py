"""Export a sharded (DCP) checkpoint to Hugging Face safetensors tensor by tensor, never the whole model.

`tracetrain export RUN --hf DIR` on a checkpoint saved by several ranks does not rebuild the model: the
tensor names, shapes and dtypes come from the DCP metadata, and each HF tensor is read on its own (one
`dcp.load` of that key, which reads only the byte ranges of its shards from every rank's file), merged
with its LoRA adapters when the run had them (W + alpha / rank * B @ A in fp32, as `LoRALinear`), cast,
and appended to a safetensors file whose header was written first from the known shapes. Host memory is
bounded by a few copies of the largest tensor, whatever the model's size (benchmarks/shard_load_rss.py
measures it). The folder, tokenizer, configs and model card are `models/export.py`'s, as for one process.
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tracetrain.models.build import build_on_meta
from tracetrain.models.llama import ModelArgs
from tracetrain.progress import Progress
from tracetrain.train.sharded_checkpoint import SafeFileSystemReader, _SafeLoadPlanner

_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def dcp_tensors(ckpt: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The model's tensors in a DCP checkpoint: plain-model name -> (full shape, stored dtype)."""
    metadata = SafeFileSystemReader(str(ckpt / "dcp")).read_metadata()
    out = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            out[key.removeprefix("model.")] = (tuple(meta.size), meta.properties.dtype)
    return out


def read_dcp_tensor(ckpt: Path, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """One full tensor of the checkpoint, read from the slices every rank wrote (no process group)."""
    state = {"model": {name: torch.empty(shape, dtype=dtype)}}
    with warnings.catch_warnings():  # one process without a process group is the intended use
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt / "dcp")), planner=_SafeLoadPlanner())
    return state["model"][name]


def _header(entries: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> tuple[bytes, list[int]]:
    """The safetensors header for tensors written in this order, and each one's byte size."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # transformers checks "format"
    sizes, offset = [], 0
    for name, shape in entries:
        size = itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        sizes.append(size)
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, sizes


def write_safetensors_streamed(
    path: Path,
    entries: list[tuple[str, tuple[int, ...]]],
    dtype: torch.dtype,
    produce: Callable[[int], torch.Tensor],
    on_written: Callable[[int], None] = lambda n: None,
) -> None:
    """A safetensors file of `entries` (name, shape), all in `dtype`: the header first, then each tensor
    as `produce(i)` returns it, so only one tensor is in memory at a time."""
    header, sizes = _header(entries, dtype)
    with open(path, "wb") as f:
        f.write(header)
        for i, ((name, shape), size) in enumerate(zip(entries, sizes, strict=True)):
            t = produce(i).to(device="cpu", dtype=dtype).contiguous()
            assert tuple(t.shape) == tuple(shape), f"{name}: produced {tuple(t.shape)}, header says {shape}"
            f.write(t.view(torch.uint8).numpy().data if t.numel() else b"")  # the tensor's bytes, not a copy
            on_written(size)
            del t


def _hf_shape(meta: dict[str, torch.Tensor], pieces: list[tuple[str, Any]]) -> tuple[int, ...]:
    """Shape of the HF tensor made of `pieces` (model key, models.hf_load.Piece) of the model's tensors."""
    name, first = pieces[0]
    trailing = tuple(meta[name].shape[1:])
    if first.stacked:
        return trailing
    return (sum(p.rows for _, p in pieces), *trailing) if meta[name].dim() else ()


def write_hf_from_dcp(
    ckpt: Path,
    args: ModelArgs,
    lora_scaling: float | None,
    out_dir: Path,
    dtype: torch.dtype,
    max_shard_bytes: int,
    progress: Progress | None = None,
) -> None:
    """`model.safetensors`, or shards + `model.safetensors.index.json`, streamed from the DCP checkpoint
    `ckpt` into the existing folder `out_dir`, LoRA adapters merged (`lora_scaling` = alpha / rank)."""
    from tracetrain.models.hf import _export_parts, _plan_shards  # the same names and split as one process

    stored = dcp_tensors(ckpt)
    meta = build_on_meta(args).state_dict()  # the plain model's names, in its order, and shapes (no memory)
    if args.tie_embeddings:
        meta.pop("lm_head.weight", None)  # HF ties it on load
    itemsize = torch.empty((), dtype=dtype).element_size()
    parts = _export_parts(args, meta)  # HF key -> pieces of the model's tensors (one per expert: MoE)
    shapes = {hf: _hf_shape(meta, ps) for hf, ps in parts.items()}
    sizes = {hf: math.prod(shape) * itemsize for hf, shape in shapes.items()}
    last: dict[str, torch.Tensor] = {}  # the model tensor read last: a block's experts are cut from one

    def read(name: str) -> torch.Tensor:
        base = name.removesuffix(".weight") + ".base.weight"
        if name in stored:
            return read_dcp_tensor(ckpt, name, *stored[name])
        assert base in stored and lora_scaling is not None, f"{name} is not in {ckpt}"
        w = read_dcp_tensor(ckpt, base, *stored[base]).float()
        a_name, b_name = base.replace(".base.", ".lora_A."), base.replace(".base.", ".lora_B.")
        lora_a, lora_b = (read_dcp_tensor(ckpt, n, *stored[n]).float() for n in (a_name, b_name))
        return w.add_(lora_b @ lora_a, alpha=lora_scaling)  # (out, in): W + scaling * B @ A, in fp32

    shards = _plan_shards(sizes, max_shard_bytes)
    total, done = sum(sizes.values()), [0]
    weight_map: dict[str, str] = {}
    for i, keys in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        what = f"exporting weights: shard {i + 1} of {len(shards)}"

        def written(n: int, what: str = what) -> None:
            done[0] += n
            if progress:
                progress(what, done[0], total, "bytes")

        entries = [(hf, shapes[hf]) for hf in keys]

        def produce(j: int, keys: list[str] = keys) -> torch.Tensor:
            chunks = []
            for name, piece in sorted(parts[keys[j]], key=lambda kp: kp[1].hf_start):
                if name not in last:
                    last.clear()
                    last[name] = read(name)
                value = last[name]
                chunks.append(value[piece.start] if piece.stacked else value[piece.start : piece.start + piece.rows])
            return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

        write_safetensors_streamed(out_dir / file, entries, dtype, produce, written)
        weight_map.update(dict.fromkeys((e[0] for e in entries), file))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def export_sharded_run_hf(
    ckpt: Path,
    out_dir: str | Path,
    dtype: torch.dtype | None,
    overwrite: bool,
    max_shard_bytes: int,
    progress: Progress | None = None,
    overrides: list[str] | None = None,
) -> list[str]:
    """`export_run_hf` of a sharded checkpoint folder, streamed: the model is never built or gathered."""
    from tracetrain.config import load_config
    from tracetrain.data import load_tokenizer
    from tracetrain.data.chat import resolve_chat_template
    from tracetrain.models.build import model_args_from_config
    from tracetrain.models.export import EXPORT_DTYPES, export_run_hf
    from tracetrain.models.lora import is_lora_key

    cfg = load_config(ckpt / "config.toml", overrides)
    args = model_args_from_config(cfg)
    scaling = cfg.lora.alpha / cfg.lora.rank if cfg.train.mode == "lora" else None
    tok = load_tokenizer(cfg.data.tokenizer, cfg.model.init_from)
    run = SimpleNamespace(cfg=cfg, tokenizer=tok, checkpoint=ckpt)
    run.model = None
    notes = []
    if dtype is None:  # --dtype auto: as the checkpoint stores the weights (models/export.py run_weights_dtype)
        stored = {d for n, (_, d) in dcp_tensors(ckpt).items() if not is_lora_key(n) and d.is_floating_point}
        dtype = stored.pop() if len(stored) == 1 and stored <= set(EXPORT_DTYPES.values()) else torch.float32
        name = str(dtype).removeprefix("torch.")
        notes.append(f"weights: {name}, as the run stores them (the checkpoint); --dtype bf16/fp16/fp32 converts")

    def weights(folder: Path, out_dtype: torch.dtype) -> None:
        write_hf_from_dcp(ckpt, args, scaling, folder, out_dtype, max_shard_bytes, progress)

    written = export_run_hf(
        run,
        out_dir,
        dtype,
        overwrite,
        max_shard_bytes,
        progress,
        chat_template=resolve_chat_template(cfg.data, tok) if tok.has_hf_form else None,
        args=args,
        write_weights=weights,
    )
    return notes + written
