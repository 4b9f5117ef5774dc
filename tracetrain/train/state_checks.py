"""Checks of the state a checkpoint hands back, before any of it is used to resume a run.

`torch.load(weights_only=True)` keeps code out of a `.pt` file, not nonsense: a forged or damaged
`optimizer.pt` or `trainer_state.pt` (a missing key, a string where a number belongs, a moment tensor of
another shape, a random state of the wrong size) would otherwise reach `load_state_dict`, `setstate` or the
first step and end the resume with a traceback, or be trained on. Each check compares the saved value with
what this run would save now (the same keys, kinds and sizes) and names the file and the key that differ.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from tracetrain.errors import CheckpointError

# Entries of a learning-rate scheduler's state that come and go between torch versions (2.11 to 2.13).
# What every parameter's entry of AdamW's state holds; an optimizer of ours that holds more says so in its
# STATE_KEYS (and STATE_FOR_EVERY_PARAMETER when each parameter must have one).
ADAMW_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")
SCHEDULER_LOOSE_KEYS = ("_is_initial", "_get_lr_called_within_step", "verbose")


def _kind(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, (list, tuple)):
        return "list"
    return {str: "str", dict: "dict", torch.Tensor: "tensor"}.get(type(value), type(value).__name__)


def check_like(saved: Any, current: Any, where: Path | str, key: str, loose: Collection[str] = ()) -> None:
    """`saved` has the make of `current` (what this run would save now): a dict with its keys (those in
    `loose` may be missing or extra: they differ between torch versions), lists of its length, numbers
    (finite) where it has numbers, flags, strings and tensors of its kind. One CheckpointError naming the key."""
    if _kind(saved) != _kind(current):
        raise CheckpointError(f"{where}: '{key}' is {type(saved).__name__}, not {type(current).__name__}")
    if isinstance(saved, float) and not math.isfinite(saved):
        raise CheckpointError(f"{where}: '{key}' is {saved}, not a finite number")
    if isinstance(saved, (list, tuple)):
        if len(saved) != len(current):
            raise CheckpointError(f"{where}: '{key}' holds {len(saved)} values, this run has {len(current)}")
        for i, (s, c) in enumerate(zip(saved, current, strict=True)):
            check_like(s, c, where, f"{key}[{i}]", loose)
    if isinstance(saved, dict):
        missing = [k for k in current if k not in saved and k not in loose]
        extra = [k for k in saved if k not in current and k not in loose]
        if missing or extra:
            what = f"lacks '{missing[0]}'" if missing else f"has an unknown entry {extra[0]!r}"
            raise CheckpointError(f"{where}: '{key}' {what}")
        for k in saved.keys() & current.keys():
            check_like(saved[k], current[k], where, f"{key}.{k}")


def check_optimizer_state(saved: Any, optimizer: torch.optim.Optimizer, where: Path) -> None:
    """A saved optimizer state fits `optimizer`: its groups' settings have the kinds of the current ones
    and name as many parameters, and every state entry belongs to one parameter, holds the keys the
    others hold, and tensors that are scalars (the step) or of its parameter's shape."""
    current = optimizer.state_dict()
    if not isinstance(saved, dict) or set(saved) != {"state", "param_groups"}:
        raise CheckpointError(f"{where}: not an optimizer state (a dict of 'state' and 'param_groups')")
    # 'initial_lr' is written into each group by an LR scheduler: a scheduled run's checkpoint loads into an
    # optimizer that has none yet (the API's load_checkpoint, a scheduler built after the load).
    check_like(saved["param_groups"], current["param_groups"], where, "param_groups", loose=("initial_lr",))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in saved["param_groups"] for i in group["params"]]
    if sorted(ids) != list(range(len(params))):
        raise CheckpointError(f"{where}: 'param_groups' must number the parameters 0 to {len(params) - 1}")
    state, shapes = saved["state"], dict(zip(ids, (tuple(p.shape) for p in params), strict=True))
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: 'state' is {type(state).__name__}, not dict")
    keys = set(getattr(optimizer, "STATE_KEYS", ADAMW_STATE_KEYS))
    keys |= {"max_exp_avg_sq"} if any(g.get("amsgrad") for g in optimizer.param_groups) else set()
    if getattr(optimizer, "STATE_FOR_EVERY_PARAMETER", False) and set(state) != set(shapes):
        raise CheckpointError(f"{where}: 'state' must hold every parameter's state ({len(shapes)} entries)")
    for index, entry in state.items():
        if index not in shapes or not isinstance(entry, dict):
            raise CheckpointError(f"{where}: state entry {index!r} is not a parameter's state")
        if set(entry) != keys:
            raise CheckpointError(f"{where}: state entry {index} holds {sorted(entry)}, not {sorted(keys)}")
        for name, value in entry.items():
            _check_state_value(value, shapes[index] if name != "step" else (), where, f"state.{index}.{name}")


def _check_state_value(value: Any, shape: tuple[int, ...], where: Path, key: str) -> None:
    """A moment (float tensor of its parameter's shape) or the step (a scalar tensor or a finite number)."""
    if isinstance(value, torch.Tensor):
        integer_step = not shape and value.dtype in (torch.int32, torch.int64)
        if not (value.dtype.is_floating_point or integer_step):
            raise CheckpointError(f"{where}: '{key}' is a {value.dtype} tensor")
        if tuple(value.shape) != shape and not (not shape and value.numel() == 1):
            raise CheckpointError(f"{where}: '{key}' has shape {tuple(value.shape)}, not {shape}")
    elif shape or _kind(value) != "number" or not math.isfinite(value):
        raise CheckpointError(f"{where}: '{key}' is {value!r}, not a {'tensor' if shape else 'finite number'}")


def check_rng_state(rng: Any, where: Path | str) -> None:
    """The random states this process would save: torch's and Python's `random`'s, each tried on a
    throwaway generator first (they refuse a state of the wrong size or kind)."""
    if not isinstance(rng, dict) or not {"torch", "python"} <= rng.keys():
        raise CheckpointError(f"{where}: 'rng' is not a dict of 'torch' and 'python' random states")
    try:
        torch.Generator().set_state(rng["torch"])
        random.Random().setstate(rng["python"])
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise CheckpointError(f"{where}: 'rng' is not a random state ({str(e).splitlines()[0]})") from None
    cuda = rng.get("cuda", [])
    if not isinstance(cuda, list) or not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda):
        raise CheckpointError(f"{where}: 'rng.cuda' is not a list of CUDA random states")
