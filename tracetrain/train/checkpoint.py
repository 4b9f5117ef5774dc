"""Atomic checkpoints: save every N steps, at the end and on SIGTERM/SIGINT; resume exactly.

Layout of one checkpoint, `RUN_DIR/checkpoints/step_00000100/`:
  model.safetensors     trainable weights: the whole model, or only the LoRA adapters in LoRA mode
  optimizer.pt          optimizer state (tensors and numbers only)
  trainer_state.pt      step, scheduler, RNG states (CPU and CUDA), data-loader position, counters
  config.toml           the resolved config the run was started with
A save writes everything into `checkpoints/.tmp-step_...` , fsyncs each file and the folder, then
renames the folder into place (atomic on POSIX) and fsyncs the parent. A crash or kill -9 at any
moment leaves either the new complete checkpoint or none — never a torn one — and the previous
checkpoints are only deleted after the rename. Loading uses `torch.load(weights_only=True)`: no
arbitrary objects are ever unpickled.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tracetrain.errors import CheckpointError

_STEP_DIR = re.compile(r"^step_(\d{8})$")


@dataclass
class TrainState:
    """Everything besides weights and optimizer needed to continue a run exactly."""

    step: int
    scheduler: dict[str, Any]
    loader: dict[str, Any]
    counters: dict[str, int]


def trainable_state_dict(model: nn.Module, lora: bool) -> dict[str, torch.Tensor]:
    """The weights a checkpoint must hold: adapters only in LoRA mode (the base is frozen and
    reloadable from its source), otherwise every unique tensor (a tied lm_head is stored once)."""
    if lora:
        return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    seen: set[int] = set()
    out = {}
    for name, tensor in model.state_dict().items():
        if id(tensor) in seen or tensor.untyped_storage().data_ptr() in seen:
            continue
        seen.update({id(tensor), tensor.untyped_storage().data_ptr()})
        out[name] = tensor.detach()
    return out


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainState,
                    config_toml: str, *, lora: bool, keep_last: int) -> Path:
    """Write a checkpoint atomically and prune older ones; returns the checkpoint folder."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{state.step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    weights = {k: v.contiguous().cpu() for k, v in trainable_state_dict(model, lora).items()}
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt", "lora": str(lora)})
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save({"step": state.step, "scheduler": state.scheduler, "loader": state.loader,
                "counters": state.counters, "rng": rng_state()}, tmp / "trainer_state.pt")
    (tmp / "config.toml").write_text(config_toml)
    for f in tmp.iterdir():
        _fsync_file(f)
    _fsync_dir(tmp)
    if final.exists():  # re-saving the same step (e.g. interrupt right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary folders of interrupted saves excluded)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))


def latest_checkpoint(run_dir: Path) -> Path:
    ckpts = list_checkpoints(run_dir)
    if not ckpts:
        raise CheckpointError(f"{run_dir} has no checkpoint to resume from (looked in {run_dir / 'checkpoints'})")
    return ckpts[-1]


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                    lora: bool) -> TrainState:
    """Load weights and optimizer state in place, restore RNG states; return the rest."""
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.pt"):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    weights = load_file(str(path / "model.safetensors"))
    expected = trainable_state_dict(model, lora)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise CheckpointError(f"{path / 'model.safetensors'}: missing tensor(s) {', '.join(missing[:5])}")
    with torch.no_grad():
        for name, target in expected.items():
            if target.shape != weights[name].shape:
                raise CheckpointError(f"{path / 'model.safetensors'}: tensor {name} has shape "
                                      f"{tuple(weights[name].shape)}, the model expects {tuple(target.shape)}")
            target.copy_(weights[name])
    # Load on the CPU, memory-mapped: load_state_dict moves each state to its parameter's device, and an
    # offloaded optimizer's states (81 GB for 7B) must never pass through the GPU.
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", mmap=True, weights_only=True))
    raw = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    set_rng_state(raw["rng"])
    return TrainState(step=raw["step"], scheduler=raw["scheduler"], loader=raw["loader"], counters=raw["counters"])
