"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save on one layout, load on any other.

Every rank writes only its own shards of the model and of the optimizer states, in parallel; the
checkpoint's metadata records each tensor's global shape and which slice each file holds, keyed by
the plain model's parameter names (`layers.3.mlp.up_proj.weight`, optimizer states as
`state.layers.3.mlp.up_proj.weight.exp_avg`). Loading asks the *current* layout's state dict
(DTensors of this mesh, or plain tensors in a single process) to be filled, and DCP reads whichever
slices overlap: dp_shard=4 -> dp_shard=2 x tp=2, -> pp=2, -> one process without a process group.

Layout of one checkpoint, `RUN_DIR/checkpoints/step_00000100/` (mirrors train/checkpoint.py):
  dcp/                       .metadata + one __<rank>_0.distcp file per rank (model and optimizer)
  trainer_state_rank<R>.pt   that rank's step, scheduler, loader position, RNG states (torch.save)
  config.toml                the resolved config the run was started with
Atomic like the single-process checkpoints: every rank writes into `checkpoints/.tmp-step_...`, the
ranks meet at a barrier, rank 0 fsyncs and renames the folder into place, then prunes old ones.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from tracetrain.errors import CheckpointError

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*"), reverse=True):  # files first, then their folders
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """{"model": ..., "optim": ...}: this rank's shards under plain-model names (DTensors when sharded)."""
    if optimizer is None:
        return {"model": get_model_state_dict(model, options=StateDictOptions())}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions())
    return {"model": model_sd, "optim": optim_sd}


def save_sharded(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                 trainer_state: dict[str, Any], config_toml: str, keep_last: int) -> Path:
    """Save a checkpoint collectively (every rank calls this); returns the checkpoint folder.

    `model` is `ParallelModel.module` (plain-model names), `trainer_state` this rank's small state.
    """
    root = run_dir / "checkpoints"
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}"
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(sharded_state(model, optimizer), checkpoint_id=str(tmp / "dcp"))
    torch.save(trainer_state, tmp / f"trainer_state_rank{rank}.pt")
    if rank == 0:
        (tmp / "config.toml").write_text(config_toml)
    _barrier()  # every rank's files are written
    if rank == 0:
        _fsync_tree(tmp)
        if final.exists():  # re-saving the same step
            shutil.rmtree(final)
        os.rename(tmp, final)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        done = sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))
        for old in done[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()  # nobody returns before the checkpoint is in place
    return final


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Load model (and optimizer) shards for the current layout in place; return the trainer state.

    Works on any layout, including a single process without a process group. The trainer state is
    this rank's when the checkpoint has one, else rank 0's (the layout changed): loader position and
    scheduler are layout-independent, per-rank RNG streams then restart from rank 0's.
    """
    if not (path / "dcp" / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a sharded checkpoint ({path / 'dcp' / '.metadata'} is missing)")
    state = sharded_state(model, optimizer)
    with warnings.catch_warnings():  # one process without a process group is an intended use
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, checkpoint_id=str(path / "dcp"))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    own = path / f"trainer_state_rank{_rank()}.pt"
    return torch.load(own if own.is_file() else path / "trainer_state_rank0.pt", map_location="cpu",
                      weights_only=True)
