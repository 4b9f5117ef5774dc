"""What differs between the Hugging Face architecture families: one `ArchFamily` entry per family.

models/hf_config.py reads the keys every family shares (sizes, norm eps, rope, embeddings tying) and
asks the checkpoint's family for the rest; models/hf.py and models/hf_load.py ask it how the model's
tensors are named in the family's checkpoints. An entry holds:

- `parse(reader) -> dict`: the family's own ModelArgs fields read from config.json (q/k/v bias, q/k
  norms, sliding window, experts), refusing with one line what the plain model does not compute.
- `matches(args)`: whether this family writes a model of `args` on export; `families.family_of_args`
  asks the entries most specific first, so Llama, which matches everything, is last.
- `export_keys(args) -> dict`: the config.json keys of the family beyond the shared ones.
- `pieces(name, shape, args) -> list[Piece]`: where the model's tensor `name` lies in the checkpoint
  (same name by default; Mixtral's experts are one checkpoint tensor per expert, stacked here).

The table of entries is `families.FAMILIES`; a new family is a module with its entries and a line there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracetrain.errors import CheckpointError
from tracetrain.models.hf_load import Piece
from tracetrain.models.llama import ModelArgs


class ConfigReader:
    """Typed access to one config.json: each value checked, a broken one named with the file and key."""

    def __init__(self, cfg: dict[str, Any], where: Path) -> None:
        self.cfg, self.where = cfg, where

    def get(self, key: str, default: Any = None) -> Any:
        return self.cfg.get(key, default)

    def fail(self, message: str) -> CheckpointError:
        """A one-line error about this file (the caller raises it)."""
        return CheckpointError(f"{self.where}: {message}")

    def positive_int(self, key: str, default: int | None = None) -> int:
        """A positive integer: a string, float or bool there is a broken file, not a size."""
        value = self.cfg.get(key)
        if value is None:
            if default is None:
                raise self.fail(f"required key '{key}' is missing")
            return default
        # bool is a subclass of int in Python (true would read as 1).
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.fail(f"{key} = {json.dumps(value)} is not allowed; it must be a positive integer")
        return value

    def positive_float(self, key: str, default: float, value: Any = None) -> float:
        """A positive, finite number (eps, rope theta, scaling factors, init std); `value` overrides the key's."""
        value = self.cfg.get(key, default) if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise self.fail(f"{key} = {json.dumps(value)} is not allowed; it must be a positive number")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.cfg.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):  # bool("false") is True
            raise self.fail(f"{key} = {json.dumps(value)} is not allowed; it must be true or false")
        return value

    def int_list(self, key: str) -> list[int]:
        """A list of non-negative integers (layer indices); absent or null = empty."""
        value = self.cfg.get(key) or []
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        if not ok:
            raise self.fail(f"{key} = {json.dumps(value)} is not allowed; it must be a list of layer indices")
        return list(value)

    def refuse_if(self, key: str, message: str) -> None:
        """One line when `key` is set (truthy): a feature the plain model does not compute."""
        if self.cfg.get(key):
            raise self.fail(f"{key} = {json.dumps(self.cfg[key])} is not supported: {message}")


def same_name(name: str, shape: tuple[int, ...], args: ModelArgs) -> list[Piece]:
    """The default naming: the model's tensor is the checkpoint's tensor of the same name."""
    return [Piece(name, 0, shape[0] if shape else 1)]


def _no_fields(reader: ConfigReader) -> dict[str, Any]:
    return {}


def _no_keys(args: ModelArgs) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class ArchFamily:
    """One Hugging Face architecture family (see module docstring)."""

    model_type: str  # config.json's model_type
    hf_class: str  # config.json's architectures[0]
    matches: Callable[[ModelArgs], bool]
    parse: Callable[[ConfigReader], dict[str, Any]] = _no_fields
    export_keys: Callable[[ModelArgs], dict[str, Any]] = _no_keys
    pieces: Callable[[str, tuple[int, ...], ModelArgs], list[Piece]] = same_name
    own_rope_and_act: bool = False  # `parse` reads the rope and activation keys (Gemma, Phi-3), not hf_config


_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def moe_pieces(
    router: str, expert: Callable[[str, int], str]
) -> Callable[[str, tuple[int, ...], ModelArgs], list[Piece]]:
    """Naming of a family whose checkpoints hold one tensor per expert: a block's `mlp.router.weight` is
    its `<router>`, and row e of its `mlp.experts.<proj>` (all experts stacked) is its `<expert(proj, e)>`."""

    def pieces(name: str, shape: tuple[int, ...], args: ModelArgs) -> list[Piece]:
        block, sep, leaf = name.partition(".mlp.")
        if not sep:
            return same_name(name, shape, args)
        if leaf == "router.weight":
            return [Piece(f"{block}.{router}", 0, shape[0])]
        proj = leaf.removeprefix("experts.")
        if proj in _EXPERT_PROJS and leaf.startswith("experts."):
            return [Piece(f"{block}.{expert(proj, e)}", e, 1, stacked=True) for e in range(shape[0])]
        return same_name(name, shape, args)

    return pieces
