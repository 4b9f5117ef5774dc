"""Atomic, verified checkpoints: save every N steps, at the end and on SIGTERM/SIGINT; resume exactly.

Layout of one checkpoint, `RUN_DIR/checkpoints/step_00000100/`:
  model.safetensors     trainable weights: the whole model, or only the LoRA adapters in LoRA mode
  optimizer.pt          optimizer state (tensors and numbers only)
  trainer_state.pt      step, scheduler, RNG states (CPU and CUDA), data-loader position, counters,
                        the data fingerprint
  config.toml           the resolved config the run was started with
  manifest.json         written last: every file's size and sha256, and the step (train/manifest.py)
A save checks the free space first, writes everything into `checkpoints/.tmp-step_...@HOST@PID`,
fsyncs each file, writes the manifest, fsyncs it and the folder, then renames the folder into place
(atomic on POSIX) and fsyncs the parent. Older checkpoints (and an earlier copy of the same step) are
renamed aside before they are deleted. So a crash, a kill -9 or a full disk at any moment leaves every
visible checkpoint complete, and a failed save leaves nothing behind. Loading verifies the manifest and
the full tensor set and uses `torch.load(weights_only=True)`: no arbitrary objects are ever unpickled.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from tracetrain.errors import CheckpointError
from tracetrain.progress import Progress
from tracetrain.safe_load import load_pt, read_safetensors
from tracetrain.train.manifest import (
    check_free_space,
    discard,
    fsync_path,
    is_legacy,
    looks_complete,
    note,
    remove_stale,
    staging,
    step_of,
    temp_dir_for,
    verify_checkpoint,
    write_manifest,
)
from tracetrain.train.state_checks import check_optimizer_state, check_rng_state


@dataclass
class TrainState:
    """Everything besides weights and optimizer needed to continue a run exactly."""

    step: int
    scheduler: dict[str, Any]
    loader: dict[str, Any]
    counters: dict[str, Any]  # skipped_steps: int; scaler: the GradScaler's state dict under fp16
    data_fingerprint: str = ""  # identifies the training data the run was started on ("" before it existed)
    rng: dict[str, Any] | None = None  # the random states saved with it (None: a checkpoint older than them)


def trainer_state_dict(state: TrainState) -> dict[str, Any]:
    """What trainer_state.pt (and each rank's trainer_state_rank<R>.pt) holds, RNG states included."""
    return {
        "step": state.step,
        "scheduler": state.scheduler,
        "loader": state.loader,
        "counters": state.counters,
        "data_fingerprint": state.data_fingerprint,
        "rng": rng_state(),
    }


# No run takes a trillion optimizer steps; a larger step is a forged or corrupted trainer state.
MAX_CHECKPOINT_STEP = 10**12


def train_state_from_dict(raw: Any, where: Path | str = "trainer_state.pt") -> TrainState:
    """The TrainState of a loaded trainer-state dict; checkpoints older than the fingerprint lack it.
    A forged one (a step of -5 or 1e15, a missing or mistyped part) is one CheckpointError naming `where`."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: not a trainer state (a {type(raw).__name__}, not a dict)")
    for key, kind in (("step", int), ("scheduler", dict), ("loader", dict), ("counters", dict)):
        value = raw.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CheckpointError(f"{where}: '{key}' is {type(value).__name__}, not {kind.__name__}")
    step = raw["step"]
    if not 0 <= step <= MAX_CHECKPOINT_STEP:
        raise CheckpointError(f"{where}: step {step} is not allowed (0 to {MAX_CHECKPOINT_STEP:,})")
    folder = Path(where).parent if Path(where).suffix == ".pt" else Path(where)
    named = re.fullmatch(r"step_(\d+)", folder.name)
    if named and int(named.group(1)) != step:
        raise CheckpointError(f"{where}: step {step} does not match its folder {folder.name}")
    if not isinstance(raw.get("data_fingerprint", ""), str):
        raise CheckpointError(f"{where}: 'data_fingerprint' is {type(raw['data_fingerprint']).__name__}, not str")
    skipped = raw["counters"].get("skipped_steps", 0)
    if not isinstance(skipped, int) or isinstance(skipped, bool) or not 0 <= skipped <= step:
        raise CheckpointError(f"{where}: 'counters.skipped_steps' is {skipped!r}, not a count from 0 to {step}")
    if "rng" in raw:
        check_rng_state(raw["rng"], where)
    return TrainState(
        step=raw["step"],
        scheduler=raw["scheduler"],
        loader=raw["loader"],
        counters=raw["counters"],
        data_fingerprint=raw.get("data_fingerprint", ""),
        rng=raw.get("rng"),
    )


def restore_rng(state: TrainState, where: Path) -> None:
    """The random states saved with `state`; a checkpoint saved before they were (none) is noted."""
    if state.rng is None:
        note(f"{where} has no random state (saved by an older tracetrain): random streams restart from train.seed")
        return
    set_rng_state(state.rng)


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


def tensor_bytes(tree: Any) -> int:
    """Bytes of every tensor in a nested dict/list (global shapes for DTensors): the size of a save."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    return 0


# Headers, pickles, config and manifest: small, but a save must not fill the disk to the last byte.
SAVE_MARGIN_BYTES = 16 << 20


def save_checkpoint(
    run_dir: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    config_toml: str,
    *,
    lora: bool,
    keep_last: int,
    progress: Progress | None = None,
) -> Path:
    """Write a checkpoint atomically and prune older ones; returns the checkpoint folder. `progress` hears
    the bytes of tensors written, file by file, then the sealing (checksums, fsync, rename)."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    remove_stale(root)
    final = root / f"step_{state.step:08d}"
    weights = {k: v.contiguous().cpu() for k, v in trainable_state_dict(model, lora).items()}
    optimizer_state = optimizer.state_dict()
    weights_bytes, total_bytes = tensor_bytes(weights), tensor_bytes(weights) + tensor_bytes(optimizer_state)
    check_free_space(root, final.name, total_bytes + SAVE_MARGIN_BYTES)
    report = progress or (lambda what, done, total, unit="": None)
    with staging(temp_dir_for(final), final.name) as tmp:
        report("saving checkpoint: model.safetensors", 0, total_bytes, "bytes")
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt", "lora": str(lora)})
        report("saving checkpoint: optimizer.pt", weights_bytes, total_bytes, "bytes")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(trainer_state_dict(state), tmp / "trainer_state.pt")
        (tmp / "config.toml").write_text(config_toml)
        report("saving checkpoint: sealing (checksums, fsync)", total_bytes, total_bytes, "bytes")
        for f in tmp.iterdir():
            fsync_path(f)
        write_manifest(tmp, state.step)  # last: its presence means every other file is complete
    publish(tmp, final, keep_last)
    return final


def publish(tmp: Path, final: Path, keep_last: int) -> None:
    """Rename a sealed temporary folder into place, then prune to the newest `keep_last` checkpoints."""
    root = final.parent
    if final.exists():  # re-saving the same step (e.g. an interrupt right after a periodic save)
        discard(final)
    os.rename(tmp, final)
    fsync_path(root)
    _rotate(root, final, keep_last)


def _rotate(root: Path, newest: Path, keep_last: int) -> None:
    """Keep `newest` and the newest `keep_last - 1` other usable checkpoints; discard the rest (and any
    step folder with a broken manifest: it can never be loaded)."""
    others = [p for p in _step_dirs(root) if p != newest]
    usable = [p for p in others if is_legacy(p) or looks_complete(p)]
    keep = set(usable[max(0, len(usable) - (keep_last - 1)) :]) if keep_last > 1 else set()
    for old in others:
        if old not in keep:
            discard(old)


def _step_dirs(root: Path) -> list[Path]:
    """Visible step folders, oldest step first."""
    if not root.is_dir():
        return []
    steps = {p: step_of(p) for p in root.iterdir() if p.is_dir()}
    return sorted((p for p, s in steps.items() if s is not None), key=lambda p: steps[p] or 0)


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run (a manifest whose files are all present), oldest first. Hidden
    folders of saves and deletions in progress, and legacy folders without a manifest, are excluded."""
    return [p for p in _step_dirs(run_dir / "checkpoints") if looks_complete(p)]


def legacy_checkpoints(run_dir: Path) -> list[Path]:
    """Step folders written before manifests existed, oldest first."""
    return [p for p in _step_dirs(run_dir / "checkpoints") if is_legacy(p)]


def newest_checkpoint(run_dir: Path) -> Path | None:
    """Cheap (no hashing), for choosing among runs: the newest complete checkpoint, else the newest
    legacy one, else None."""
    found = list_checkpoints(run_dir) or legacy_checkpoints(run_dir)
    return found[-1] if found else None


def latest_checkpoint(run_dir: Path) -> Path:
    """The newest checkpoint that verifies (sha256 of every file); each newer one skipped is noted.
    A run with no manifest checkpoint falls back to its newest legacy folder (noted as unverified)."""
    skipped = []
    for ckpt in reversed(_step_dirs(run_dir / "checkpoints")):
        if is_legacy(ckpt):
            continue
        try:
            verify_checkpoint(ckpt)
        except CheckpointError as e:
            skipped.append(ckpt)
            note(f"skipped checkpoint {ckpt.name}: {e}")
            continue
        return ckpt
    legacy = legacy_checkpoints(run_dir)
    if legacy:
        note(f"{legacy[-1]} has no manifest.json (saved by an older tracetrain): it is loaded unverified")
        return legacy[-1]
    found = f" ({len(skipped)} failed verification)" if skipped else ""
    raise CheckpointError(f"{run_dir} has no usable checkpoint{found} (looked in {run_dir / 'checkpoints'})")


def check_checkpoint(path: Path) -> None:
    """Verify a checkpoint folder before loading it (one CheckpointError line if it does not verify)."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not verify_checkpoint(path):
        note(
            f"{path} has no manifest.json (saved by an older tracetrain): it is loaded unverified, "
            "after checking its tensor set and file headers only"
        )


def load_weights(file: Path, model: nn.Module, *, lora: bool, config: Path | None = None) -> None:
    """Copy a checkpoint's weights into `model` in place; every expected tensor must be there and fit.
    Expected: the adapters in adapters-only LoRA mode, else every unique tensor of the model."""
    weights = read_safetensors(file)
    expected = trainable_state_dict(model, lora)
    built = f" built from {config}" if config else ""
    missing = sorted(set(expected) - set(weights))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(
            f"{file}: missing tensor(s) {', '.join(missing[:5])}{more} (expected by the model{built})"
        )
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"{file}: tensor {unexpected[0]} does not fit the model{built} ({len(unexpected)} unexpected tensor(s))"
        )
    with torch.no_grad():
        for name, target in expected.items():
            if target.shape != weights[name].shape:
                raise CheckpointError(
                    f"{file}: tensor {name} has shape {tuple(weights[name].shape)}, "
                    f"the model{built} expects {tuple(target.shape)}"
                )
            target.copy_(weights[name])


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, lora: bool) -> TrainState:
    """Verify, then load weights and optimizer state in place, restore RNG states; return the rest."""
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.pt"):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    check_checkpoint(path)
    load_weights(path / "model.safetensors", model, lora=lora)
    # Load on the CPU, memory-mapped: load_state_dict moves each state to its parameter's device, and an
    # offloaded optimizer's states (81 GB for 7B) must never pass through the GPU.
    saved = load_pt(path / "optimizer.pt", mmap=True)
    check_optimizer_state(saved, optimizer, path / "optimizer.pt")
    try:
        optimizer.load_state_dict(saved)
    except (ValueError, KeyError) as e:  # torch's "loaded state dict contains a parameter group that ..."
        raise CheckpointError(f"{path / 'optimizer.pt'}: does not fit this model's optimizer ({e})") from None
    state = train_state_from_dict(load_pt(path / "trainer_state.pt"), path / "trainer_state.pt")
    restore_rng(state, path)  # checked above, before the RNG is touched
    return state
