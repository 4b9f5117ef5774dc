"""LoRA as a transform over the plain model: `apply_lora` swaps chosen projections for `LoRALinear`.

A LoRA layer keeps the pretrained `nn.Linear` frozen (as `.base`) and learns a low-rank update
`W' = W + (alpha / rank) * B @ A`, with A (rank, in) and B (out, rank). B starts at zero, so the
adapted model starts out computing exactly what the base model computes.

Names are chosen so that checkpoints map one to one onto Hugging Face and PEFT: the wrapped
projection's state-dict keys are `layers.N.self_attn.q_proj.base.weight`, `...q_proj.lora_A.weight`
and `...q_proj.lora_B.weight`; `merge_lora` restores the original `...q_proj.weight` names.

Adapters are kept in `adapter_dtype` (float32 by default) even when the frozen base is cast to bf16:
the optimizer updates only the adapters, and small updates to a bf16 weight would be rounded away.

Two variants are options of `apply_lora`: a 4-bit NF4 frozen base (QLoRA, `base_quant="nf4"`,
models/qlora.py) and DoRA's learned magnitudes (`dora=True`, `DoRALinear` below).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F

from tracetrain.errors import CheckpointError
from tracetrain.models.qlora import NF4Linear, dequantise_all, quantise_frozen_linears

LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """`base(x) + dropout(x) @ A^T @ B^T * (alpha / rank)`, with `base` frozen.

    The adapter matmuls run in the adapters' dtype (the input is cast to it) and the sum is returned
    in the base output's dtype, so a bf16 base stays a bf16 activation stream.
    """

    # False: the layer computes its frozen base alone (`adapters_disabled`: DPO's reference model).
    adapters_enabled: bool = True
    base: nn.Linear | NF4Linear
    in_features: int
    out_features: int

    def __init__(
        self,
        base: nn.Linear | NF4Linear,
        rank: int,
        alpha: float,
        dropout: float,
        adapter_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if rank <= 0:
            raise ValueError(f"LoRA rank must be > 0, got {rank}")
        self.base = base  # nn.Linear, or NF4Linear (QLoRA): `base.weight` is then dequantised on each read
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.in_features, self.out_features = base.in_features, base.out_features
        device = base.codes.device if isinstance(base, NF4Linear) else base.weight.device
        kwargs = {"device": device, "dtype": adapter_dtype}
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **kwargs)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, **kwargs)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.base.requires_grad_(False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """PEFT's init: A kaiming-uniform (as nn.Linear's default), B zero, so the update starts at 0.

        Call again after `to_empty` when the model was built on the meta device.
        """
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapters_enabled:
            return self.base(x)
        out = self.base(x)  # (..., out_features)
        # Under autocast the adapter matmuls run in the autocast dtype anyway: casting x to the adapter
        # dtype first would only copy the activation twice (measured: ~3% of a 7B LoRA step on an H200).
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.lora_A.weight.dtype)
        h = self.dropout(x)
        update = self.lora_B(self.lora_A(h)) * self.scaling
        return out + update.to(out.dtype)

    @torch.no_grad()
    def merged_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W + scaling * B @ A, computed in float32, returned in `dtype` (default: the base weight's).

        A new tensor: the module itself is left unchanged (export uses this on a live model, and asks
        for its output dtype directly so a bf16 base is not rounded twice).
        """
        w = self.base.weight  # on the host when the base runs in FP8 (kernels/fp8.py): merged beside the adapters
        delta = self.lora_B.weight.float() @ self.lora_A.weight.float()  # (out, in)
        return (w.to(delta.device).float() + self.scaling * delta).to(dtype or w.dtype)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, scaling={self.scaling:g}"


# ---------------------------------------------------------------------------------------------------
# DoRA (`lora.dora = true`): weight-decomposed LoRA, computed as PEFT's `LoraConfig(use_dora=True)` does.
#
# DoRA splits the adapted weight into a direction and a learned per-row magnitude m (out_features,):
#
#     W' = m * (W + s B A) / ||W + s B A||_row          s = alpha / rank
#
# m starts at ||W||_row (B is zero at first), so the adapted model starts out computing the base model. As in
# PEFT and the paper (section 4.3), the row norm is treated as a constant (detached): no gradient flows
# through it, which is what makes the backward cheap. The forward is PEFT's, term for term:
#
#     out = base(x) + (m / n - 1) * (x W^T) + (m / n) * s * B(A(x))        n = ||W + s B A||_row, detached
#
# where `x W^T` is the base output without its bias (or, with adapter dropout in training, the base applied to
# the dropped-out input, as PEFT does). The magnitude is the parameter `lora_magnitude_vector`, the name
# PEFT saves (`...q_proj.lora_magnitude_vector`), so `tracetrain export --peft` writes an adapter that
# `PeftModel.from_pretrained` loads with `use_dora = true`. The base may be NF4 (QLoRA + DoRA): `base.weight`
# dequantises it, and the norm is taken over the dequantised weight, as PEFT does over bitsandbytes' 4-bit.


class DoRALinear(LoRALinear):
    """`LoRALinear` plus the magnitude vector (see module docstring). Same A, B, scaling and names."""

    def __init__(
        self,
        base: nn.Linear | NF4Linear,
        rank: int,
        alpha: float,
        dropout: float,
        adapter_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(base, rank, alpha, dropout, adapter_dtype)
        device = self.lora_A.weight.device
        self.lora_magnitude_vector = nn.Parameter(torch.empty(self.out_features, device=device, dtype=adapter_dtype))
        if device.type != "meta":
            self.reset_magnitude()

    def _row_norm(self, weight: torch.Tensor) -> torch.Tensor:
        """||W + s B A|| per output row, in float32, detached (the paper's section 4.3)."""
        with torch.no_grad():
            lora_weight = self.lora_B.weight.float() @ self.lora_A.weight.float()  # (out, in)
            return torch.linalg.vector_norm(weight.float() + self.scaling * lora_weight, dim=1)

    @torch.no_grad()
    def reset_magnitude(self) -> None:
        """m = ||W + s B A||_row of the current base and adapters (||W|| at initialisation, where B is zero).

        Called once the base holds its values: at construction on a real device, or by
        `models/build.py::materialize_parts` after a model built on meta is filled."""
        self.lora_magnitude_vector.copy_(self._row_norm(self.base.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapters_enabled:  # DPO's reference: the frozen base alone (models/lora.py)
            return self.base(x)
        out = self.base(x)  # (..., out_features), bias included
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.lora_A.weight.dtype)
        weight = self.base.weight  # (out, in); dequantised when the base is NF4
        scale = self.lora_magnitude_vector / self._row_norm(weight)  # (out,): m / n, gradient into m only
        if isinstance(self.dropout, nn.Identity) or not self.training:
            bias = getattr(self.base, "bias", None)
            base_out = out if bias is None else out - bias
            h = x
        else:
            h = self.dropout(x)
            base_out = F.linear(h, weight.to(h.dtype))  # PEFT: the base on the dropped-out input
        lora_out = self.lora_B(self.lora_A(h))  # (..., out_features)
        scale = scale.to(lora_out.dtype)
        update = (scale - 1) * base_out.to(lora_out.dtype) + scale * lora_out * self.scaling
        return out + update.to(out.dtype)

    @torch.no_grad()
    def merged_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """m / ||W + s B A||_row * (W + s B A), in float32, returned in `dtype` (default: the base's)."""
        w = self.base.weight
        merged = w.float() + self.scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())
        factor = self.lora_magnitude_vector.float() / torch.linalg.vector_norm(merged, dim=1)
        return (factor[:, None] * merged).to(dtype or w.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", dora"


def resolve_targets(targets: list[str]) -> list[str]:
    """Expand 'all-linear' and check names; raises ValueError naming the bad entry and the allowed ones."""
    allowed = ", ".join((*LORA_TARGETS, "all-linear"))
    if not targets:
        raise ValueError(f"LoRA targets are empty; choose from {allowed}")
    for name in targets:
        if name != "all-linear" and name not in LORA_TARGETS:
            raise ValueError(f"unknown LoRA target '{name}'; allowed: {allowed}")
    if "all-linear" in targets:
        return list(LORA_TARGETS)
    return list(dict.fromkeys(targets))  # de-duplicated, in the given order


def _parent(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    """'self_attn.q_proj' -> (the self_attn module, 'q_proj')."""
    parent_name, _, leaf = name.rpartition(".")
    return (root.get_submodule(parent_name) if parent_name else root), leaf


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: float,
    dropout: float,
    targets: list[str],
    base_dtype: torch.dtype | None = None,
    adapter_dtype: torch.dtype = torch.float32,
    *,
    base_quant: str = "none",
    dora: bool = False,
) -> int:
    """Wrap the `targets` projections of every block in `model.layers` with `LoRALinear`, in place.

    Every other parameter is frozen (and cast to `base_dtype` when given, to halve the memory of the
    frozen weights in bf16). `lm_head` and the embedding are never adapted. `base_quant="nf4"` first
    stores every frozen projection of the blocks in NF4, dequantised to `base_dtype` (default bf16) for
    compute (QLoRA); `dora=True` adapts with `DoRALinear`. Returns the number of trainable parameters,
    which equals `accounting.lora_params(args, rank, targets, dora)`.
    """
    names = resolve_targets(targets)
    if base_quant not in ("none", "nf4"):
        raise ValueError(f"unknown base quantisation {base_quant!r}; allowed: none, nf4")
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("model already has LoRA adapters; merge_lora it first")
    model.requires_grad_(False)
    if base_dtype is not None:
        # Assigning `.data` keeps each Parameter object, so tied weights (lm_head = embedding) stay tied.
        for p in model.parameters():
            p.data = p.data.to(base_dtype)
    if base_quant == "nf4":  # before wrapping: DoRA's magnitudes are the norms of the quantised base
        quantise_frozen_linears(model, base_dtype or torch.bfloat16)
    layer = DoRALinear if dora else LoRALinear
    for block in model.layers:  # type: ignore[union-attr]  # nn.Module attributes are typed Tensor | Module in torch's stubs
        matches = [
            (n, m)
            for n, m in block.named_modules()
            if isinstance(m, (nn.Linear, NF4Linear)) and n.rpartition(".")[2] in names
        ]
        for name, linear in matches:
            parent, leaf = _parent(block, name)
            setattr(parent, leaf, layer(linear, rank, alpha, dropout, adapter_dtype))
    return sum(p.numel() for p in trainable_parameters(model).values())


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """Fold every adapter into its base weight and put the plain `nn.Linear` back, in place.

    Afterwards the state dict has the original names (`...q_proj.weight`) again. The restored
    layers stay frozen; call `model.requires_grad_(True)` for full fine-tuning from here. An NF4 base
    (QLoRA) becomes a plain `nn.Linear` holding the dequantised weight, merged where it was adapted.
    """
    lora_modules = [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    for name, module in lora_modules:
        merged = module.merged_weight()
        if isinstance(module.base, NF4Linear):
            dequantise_all(module)  # module.base is a plain nn.Linear now
        module.base.weight.copy_(merged)
        parent, leaf = _parent(model, name)
        setattr(parent, leaf, module.base)
    dequantise_all(model)  # the projections that had no adapter


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block, every `LoRALinear` of `model` computes its frozen base alone: the model is its
    own base, with no second copy (DPO's reference model for LoRA, as PEFT's `disable_adapter`)."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.adapters_enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.adapters_enabled = True


def is_lora_key(key: str) -> bool:
    """True for adapter entries of a state dict (`...lora_A.weight`, `...lora_B.weight`, DoRA's
    `...lora_magnitude_vector`)."""
    return ".lora_A." in key or ".lora_B." in key or key.endswith(".lora_magnitude_vector")


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters only, keyed by their names in the model (`layers.0.self_attn.q_proj.lora_A.weight`)."""
    return {k: v for k, v in model.state_dict().items() if is_lora_key(k)}


def _list_some(keys: set[str] | list[str], limit: int = 5) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


@torch.no_grad()
def load_lora_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors into a model that already went through `apply_lora` (same targets and rank).

    Raises CheckpointError naming missing or unexpected adapters, or the first tensor whose shape
    does not match; nothing is copied unless every name and shape matches.
    """
    params = {k: v for k, v in model.state_dict(keep_vars=True).items() if is_lora_key(k)}
    missing, unexpected = params.keys() - state_dict.keys(), state_dict.keys() - params.keys()
    if missing:
        raise CheckpointError(f"LoRA adapters missing from the state dict: {_list_some(missing)}")
    if unexpected:
        raise CheckpointError(f"unexpected LoRA adapters in the state dict: {_list_some(unexpected)}")
    for key, param in params.items():
        if state_dict[key].shape != param.shape:
            raise CheckpointError(
                f"LoRA tensor '{key}' has shape {tuple(state_dict[key].shape)} "
                f"but the model expects {tuple(param.shape)} (different rank?)"
            )
    for key, param in params.items():
        param.copy_(state_dict[key])


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters that require grad, by name (after `apply_lora`: the adapters only)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}
