"""Load a trained model back from a run directory or checkpoint, for eval, generation and export.

A checkpoint is verified before it is used (manifest sizes and sha256, then the full tensor set the
model expects; see train/manifest.py). Given a run directory, the newest checkpoint that verifies is
taken and any newer one skipped is noted; a checkpoint folder named explicitly must verify.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tracetrain.config import Config, load_config
from tracetrain.data import load_tokenizer
from tracetrain.errors import CheckpointError
from tracetrain.kernels.fp8 import fp8_runs_on
from tracetrain.models.llama import Transformer
from tracetrain.spec import RunSpec, resolve
from tracetrain.train.assemble import assemble
from tracetrain.train.checkpoint import check_checkpoint, latest_checkpoint, load_weights
from tracetrain.train.manifest import MANIFEST, STEP_DIR, note
from tracetrain.train.runtime import resolve_device


@dataclass
class Loaded:
    model: Transformer  # with the run's model transforms applied (LoRA, attention, kernels, FP8, ...)
    tokenizer: Any
    cfg: Config
    checkpoint: Path
    device: torch.device
    precision: str
    spec: RunSpec  # the run's spec on this device: `step_context(spec)` scores as training did


def _is_checkpoint_folder(p: Path) -> bool:
    if (p / MANIFEST).is_file() and STEP_DIR.match(p.name):
        return True
    return ((p / "model.safetensors").is_file() or (p / "dcp" / ".metadata").is_file()) and (
        p / "config.toml"
    ).is_file()


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder (verified), or a run directory (its newest checkpoint that verifies)."""
    p = Path(path)
    if _is_checkpoint_folder(p):
        check_checkpoint(p)
        return p
    if (p / "checkpoints").is_dir():
        return latest_checkpoint(p)
    raise CheckpointError(f"{p} is neither a checkpoint folder nor a run directory with checkpoints")


def load_trained(
    path: str | Path, device: str = "auto", overrides: list[str] | None = None, *, generation: bool = False
) -> Loaded:
    """Rebuild the model from a checkpoint's own config and load its weights (adapters stay unmerged).
    `generation`: assembled for `tracetrain generate` (spec.py `resolve(..., generation=True)`, which words
    the fused-kernel decision for KV-cache forwards); otherwise exactly as the run trained."""
    ckpt = find_checkpoint(path)
    cfg = load_config(ckpt / "config.toml", overrides)
    dev = resolve_device(device, "--device")  # eval and generate: their flag (export passes "cpu")
    if cfg.train.fp8 != "none" and not fp8_runs_on(dev):
        # FP8 is only how the frozen matmuls ran: the checkpoint holds the same bf16 weights either way, so
        # an export (always on the CPU) or an evaluation without FP8 tensor cores uses them unquantised.
        note(
            f"{ckpt} was trained with train.fp8 = {cfg.train.fp8!r}; {dev.type} has no FP8 tensor cores, so its "
            "weights run unquantised here (numbers can differ slightly from the run's own FP8 evaluations)"
        )
        cfg = load_config(ckpt / "config.toml", [*(overrides or []), "--train.fp8=none"])
    # The training run's own spec on this device (lora.base_dtype honoured, as training did), and its
    # model rows: model (meta), MoE, LoRA, attention, kernels, FP8, recompute, compile, materialise (no optimizer).
    spec = resolve(cfg, dev, generation=generation)
    precision = spec.precision
    model = assemble(spec, until="materialise").plain()
    if (ckpt / "dcp" / ".metadata").is_file():
        # Saved by several ranks (train/sharded_checkpoint.py): DCP gathers every shard into this single
        # process's full tensors, whatever layout wrote them (no process group needed).
        from tracetrain.train.sharded_checkpoint import load_sharded

        load_sharded(ckpt, model, None)
    else:
        # As the trainer saved it: the spec decides whether a checkpoint holds only the adapters.
        load_weights(ckpt / "model.safetensors", model, lora=spec.adapters_only, config=ckpt / "config.toml")
    model.eval()
    return Loaded(model, load_tokenizer(cfg.data.tokenizer, cfg.model.init_from), cfg, ckpt, dev, precision, spec)
