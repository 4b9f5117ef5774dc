"""DoRA (`lora.dora = true`): weight-decomposed LoRA, computed as PEFT's `LoraConfig(use_dora=True)` does.

DoRA splits the adapted weight into a direction and a learned per-row magnitude m (out_features,):

    W' = m * (W + s B A) / ||W + s B A||_row          s = alpha / rank

m starts at ||W||_row (B is zero at first), so the adapted model starts out computing the base model. As in
PEFT and the paper (section 4.3), the row norm is treated as a constant (detached): no gradient flows
through it, which is what makes the backward cheap. The forward is PEFT's, term for term:

    out = base(x) + (m / n - 1) * (x W^T) + (m / n) * s * B(A(x))        n = ||W + s B A||_row, detached

where `x W^T` is the base output without its bias (or, with adapter dropout in training, the base applied to
the dropped-out input, as PEFT does). The magnitude is the parameter `lora_magnitude_vector`, the name
PEFT saves (`...q_proj.lora_magnitude_vector`), so `tracetrain export --peft` writes an adapter that
`PeftModel.from_pretrained` loads with `use_dora = true`. The base may be NF4 (QLoRA + DoRA): `base.weight`
dequantises it, and the norm is taken over the dequantised weight, as PEFT does over bitsandbytes' 4-bit.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tracetrain.models.lora import LoRALinear
from tracetrain.models.qlora import NF4Linear


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
