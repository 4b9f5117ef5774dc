"""Readers for the files tracetrain loads (safetensors, torch .pt) that fail with one line naming the file.

A truncated, empty or corrupt file is a user-fixable problem (pick another checkpoint), not a bug, so
the library's exception becomes a CheckpointError. `.pt` files are read with `weights_only=True`: only
tensors and plain values are ever unpickled, and torch's advice to retry with `weights_only=False`
(which would run code from the file) is never passed on.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from tracetrain.errors import CheckpointError


def _first_sentence(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text.split(". ")[0].rstrip(".")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, on the CPU."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({_first_sentence(e)}); it is truncated, empty or corrupt"
        ) from None


def open_safetensors(path: Path) -> Any:
    """`safe_open(path)` (a context manager reading tensors one by one); a file whose header is
    truncated, empty or corrupt is one CheckpointError line."""
    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({_first_sentence(e)}); it is truncated, empty or corrupt"
        ) from None


def _unpickling_reason(error: BaseException) -> str:
    # torch's message opens with how to load the file unsafely; keep only the line that names the culprit.
    for line in str(error).splitlines():
        if line.startswith(("Trying to load unsupported", "Unsupported global", "Unsupported operand")):
            return line.strip().rstrip(".")
    return "corrupt pickle data"


def load_pt(path: Path, *, mmap: bool = False) -> Any:
    """torch.load(weights_only=True) on the CPU; a corrupt or truncated file is one CheckpointError."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: cannot be loaded ({_unpickling_reason(e)}); tracetrain reads only "
            "tensors and plain values from .pt files"
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError, KeyError, AttributeError, IndexError) as e:
        raise CheckpointError(
            f"{path}: not a readable PyTorch file ({_first_sentence(e) or 'empty'}); it is truncated, empty or corrupt"
        ) from None
