"""Load a trained model back from a run directory or checkpoint, for eval, generation and export."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tracetrain.config import Config, load_config
from tracetrain.data import load_tokenizer
from tracetrain.errors import CheckpointError
from tracetrain.models.build import build_model
from tracetrain.models.llama import Transformer
from tracetrain.train.checkpoint import latest_checkpoint, list_checkpoints
from tracetrain.train.runtime import resolve_device, resolve_precision


@dataclass
class Loaded:
    model: Transformer
    tokenizer: Any
    cfg: Config
    checkpoint: Path
    device: torch.device
    precision: str


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run directory (its latest checkpoint)."""
    p = Path(path)
    if ((p / "model.safetensors").is_file() or (p / "dcp" / ".metadata").is_file()) and (p / "config.toml").is_file():
        return p
    if list_checkpoints(p):
        return latest_checkpoint(p)
    raise CheckpointError(f"{p} is neither a checkpoint folder nor a run directory with checkpoints")


def load_trained(path: str | Path, device: str = "auto", overrides: list[str] | None = None) -> Loaded:
    """Rebuild the model from a checkpoint's own config and load its weights (adapters stay unmerged)."""
    ckpt = find_checkpoint(path)
    cfg = load_config(ckpt / "config.toml", overrides)
    dev = resolve_device(device)
    precision = resolve_precision(cfg.train.precision, dev)
    base_dtype = torch.bfloat16 if (cfg.train.mode == "lora" and dev.type == "cuda") else None
    model = build_model(cfg, dev, base_dtype=base_dtype)
    if (ckpt / "dcp" / ".metadata").is_file():
        # Saved by several ranks (parallel/checkpoint.py): DCP gathers every shard into this single
        # process's full tensors, whatever layout wrote them (no process group needed).
        from tracetrain.parallel.checkpoint import load_sharded
        try:
            load_sharded(ckpt, model, None)
        except (RuntimeError, ValueError, KeyError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{ckpt / 'dcp'}: the sharded checkpoint does not fit the model built from "
                                  f"{ckpt / 'config.toml'} ({first})") from None
        model.eval()
        return Loaded(model, load_tokenizer(cfg.data.tokenizer), cfg, ckpt, dev, precision)
    weights = load_file(str(ckpt / "model.safetensors"))
    params = dict(model.named_parameters())
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in weights.items():
            target = params.get(name, state.get(name))
            if target is None or target.shape != tensor.shape:
                raise CheckpointError(f"{ckpt / 'model.safetensors'}: tensor {name} does not fit the model "
                                      f"built from {ckpt / 'config.toml'}")
            target.copy_(tensor)
    model.eval()
    return Loaded(model, load_tokenizer(cfg.data.tokenizer), cfg, ckpt, dev, precision)
