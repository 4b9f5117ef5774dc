"""`apply_fp8`, the `train.fp8` transform: the blocks' linears in FP8, in place (fp8.py's module doc
says how). It sits above both FP8 layers, the frozen linear (fp8.py) and the fused MLP (fp8_mlp.py,
which builds on fp8.py), so the three modules import one way."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from tracetrain.errors import ConfigError
from tracetrain.kernels.fp8 import ALIGN, RECIPES, Float8FrozenLinear, Recipe, fp8_compatible, to_float8_frozen
from tracetrain.kernels.fp8_mlp import Float8FrozenFeedForward, fp8_mlp_eligible, to_float8_frozen_mlp


def apply_fp8(model: nn.Module, recipe: Recipe, fused_mlp: bool = False) -> int:
    """Run the blocks' linear layers in FP8, in place; returns how many were converted.

    Frozen `nn.Linear`s of `model.layers` (LoRA bases and un-adapted projections) become
    `Float8FrozenLinear`; if any block weight is trained (full fine-tuning), the block linears go through
    torchao instead. With `fused_mlp` (off by default: slower on the H100, see the module doc), a block
    MLP that `fp8_mlp.fp8_mlp_eligible` accepts (three plain frozen linears) becomes one
    `Float8FrozenFeedForward` instead, counted as its three linears.
    `lm_head`, the embedding and the adapters (LoRA A and B) stay as they are. Layers whose dims are not
    multiples of 16 stay bf16 (one warning). Apply after LoRA (the bases must exist and be frozen) and
    before recomputation and compile (both must see the FP8 modules).
    """
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; allowed: {', '.join(RECIPES)}")
    linears = [
        (f"layers.{i}.{n}", m)
        for i, block in enumerate(model.layers)  # type: ignore[arg-type]  # nn.Module attributes are typed Tensor | Module in torch's stubs
        for n, m in block.named_modules()
        if type(m) is nn.Linear and not _is_adapter(n)
    ]
    skipped = [name for name, m in linears if not fp8_compatible(m)]
    if skipped:
        warnings.warn(
            f"FP8: {len(skipped)} linear layer(s) kept in bf16, their dims are not multiples of "
            f"{ALIGN} (first: {skipped[0]})",
            stacklevel=2,
        )
    trained = [m for _, m in linears if m.weight.requires_grad]
    if trained:
        return _apply_torchao(model, recipe, set(skipped))
    count = 0
    for block in model.layers:  # type: ignore[union-attr]  # nn.Module attributes are typed Tensor | Module in torch's stubs
        mlps = [to_float8_frozen_mlp(block.mlp, recipe)] if fused_mlp and fp8_mlp_eligible(block.mlp) else []
        inside = set(block.mlp.children()) if mlps else set()  # the fused MLP's own linears stay nn.Linear
        frozen = [
            to_float8_frozen(m, recipe)
            for n, m in block.named_modules()
            if type(m) is nn.Linear and m not in inside and not _is_adapter(n) and fp8_compatible(m)
        ]
        if frozen or mlps:
            block.register_forward_pre_hook(_refresh_hook([*frozen, *mlps]))
        count += len(frozen) + 3 * len(mlps)
    return count


def _is_adapter(name: str) -> bool:
    return name.rpartition(".")[2] in ("lora_A", "lora_B")


def _refresh_hook(modules: list[Float8FrozenLinear | Float8FrozenFeedForward]) -> Callable[..., None]:
    """Block forward pre-hook (runs eagerly even when the block is compiled): re-quantise stale weights."""

    def hook(module: nn.Module, args: Any) -> None:
        for fp8_module in modules:
            fp8_module.refresh_if_stale()

    return hook


def _apply_torchao(model: nn.Module, recipe: Recipe, skipped: set[str]) -> int:
    """torchao's Float8Linear for the trained block linears (not lm_head, not layers with odd dims)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ConfigError(
            f"config key 'train.fp8' = {recipe!r} with full fine-tuning needs torchao: pip install 'tracetrain[fp8]'"
        ) from None

    def keep(module: nn.Module, fqn: str) -> bool:
        return (
            fqn.startswith("layers.")
            and fqn not in skipped
            and isinstance(module, nn.Linear)
            and fp8_compatible(module)
        )

    before = sum(1 for m in model.modules() if type(m) is nn.Linear)
    convert_to_float8_training(model, module_filter_fn=keep, config=Float8LinearConfig.from_recipe_name(recipe))
    return before - sum(1 for m in model.modules() if type(m) is nn.Linear)
