"""SwiGLU's `silu(gate) * up` as one custom op, forward and backward.

Eager, this is a silu kernel and a multiply forward (and silu(gate) is saved for backward: one more
(tokens, ffn_dim) activation), and four or five elementwise kernels backward. The fused op reads gate
and up and writes the product once; backward recomputes silu from the saved gate and writes both
gradients in one pass. The MLP's matmuls are unchanged (they stay in `FeedForward`'s Linear layers,
so LoRA on gate/up/down works as before).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tracetrain.kernels import triton_available
from tracetrain.models.llama import FeedForward


@torch.library.custom_op("tracetrain::swiglu_fwd", mutates_args=())
def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (pure PyTorch: the same ops as the eager module)."""
    return F.silu(gate) * up


@swiglu_fwd.register_fake
def _(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate)


@torch.library.custom_op("tracetrain::swiglu_bwd", mutates_args=())
def swiglu_bwd(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d/dgate = g * up * sig * (1 + gate * (1 - sig)), d/dup = g * silu(gate); float32 math."""
    acc = torch.promote_types(gate.dtype, torch.float32)  # float64 stays float64 (tests)
    g, gf, uf = grad.to(acc), gate.to(acc), up.to(acc)
    sig = torch.sigmoid(gf)
    dgate = g * uf * sig * (1 + gf * (1 - sig))
    return dgate.to(gate.dtype), (g * gf * sig).to(up.dtype)


@swiglu_bwd.register_fake
def _(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(gate), torch.empty_like(up)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor):
    gate, up = ctx.saved_tensors
    return swiglu_bwd(grad.contiguous(), gate, up)


swiglu_fwd.register_autograd(_backward, setup_context=_setup_context)

if triton_available():
    from tracetrain.kernels import triton_kernels as _tk

    swiglu_fwd.register_kernel("cuda")(_tk.swiglu_fwd)
    swiglu_bwd.register_kernel("cuda")(_tk.swiglu_bwd)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, fused; gate and up of one shape and dtype."""
    return swiglu_fwd(gate.contiguous(), up.contiguous())


class FusedFeedForward(FeedForward):
    """`FeedForward` whose activation is the fused op. Swapped in by class (same submodules)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a compiled block: Inductor fuses the plain ops (kernels/apply.py)
            return super().forward(x)
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
