"""LoRA's `base(x) + scaling * B(A(x))` with the add and the scale in the second GEMM's epilogue.

`models.lora.LoRALinear` computes the adapter output as its own (tokens, out) tensor, scales it and adds
it to the base output: two extra full-size passes forward, and one backward (`grad * scaling`), per
adapted projection; for 7B with q/k/v/o adapters that is ~1 GB of traffic per layer and step. Here the
second adapter GEMM is `torch.addmm(base_out, A(x), B^T, alpha=scaling)`: cuBLAS adds into the base
output in its epilogue, and autograd applies `alpha` to the small (tokens, rank) and (rank, out)
gradients instead of the full-size one. One rounding to bf16 instead of three.

Used when the base output and the adapter path share a dtype (always under autocast); otherwise (a
bf16 base with float32 adapters and no autocast, i.e. CPU float32 runs) it falls back to the module's
own forward, which casts.
"""

from __future__ import annotations

import torch

from tracetrain.models.lora import LoRALinear


class FusedLoRALinear(LoRALinear):
    """`LoRALinear` with the scale-and-add fused into `addmm`. Swapped in by class (same parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapters_enabled:
            return self.base(x)
        out = self.base(x)  # (..., out_features)
        if not torch.is_autocast_enabled(x.device.type) and out.dtype != self.lora_A.weight.dtype:
            return super().forward(x)
        down = self.lora_A(self.dropout(x))  # (..., rank)
        weight_b = self.lora_B.weight
        if not torch.is_autocast_enabled(x.device.type):
            weight_b = weight_b.to(out.dtype)
        fused = torch.addmm(
            out.reshape(-1, out.shape[-1]), down.reshape(-1, down.shape[-1]), weight_b.t(), alpha=self.scaling
        )
        return fused.view(out.shape)
