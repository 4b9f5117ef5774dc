"""RMSNorm as one custom op: forward and backward in one pass each, statistics in float32.

The eager module (`models.llama.RMSNorm`) upcasts the input to float32, squares, averages, scales and
casts back: five or six memory passes forward, more backward, and it saves a float32 copy of its
input for backward. The fused op reads x once, writes y once, and saves only x and rstd (rows,).

Same numerics as the eager module: y = weight * (x * rstd).to(x.dtype), the output in
promote(x.dtype, weight.dtype) (float32 when the weight is a float32 master weight under autocast).
"""

from __future__ import annotations

import torch

from tracetrain.kernels import triton_available
from tracetrain.models.llama import RMSNorm


def _acc(t: torch.Tensor) -> torch.Tensor:
    """Statistics dtype: float32 (float64 inputs stay float64, so the tests can check the math exactly)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


@torch.library.custom_op("tracetrain::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, dim) -> y (rows, dim), rstd (rows,) float32. Pure PyTorch (CPU and reference)."""
    xf = _acc(x)
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    return weight * (xf * rstd[:, None]).to(x.dtype), rstd


@rms_norm_fwd.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)),
        x.new_empty(x.shape[0], dtype=torch.promote_types(x.dtype, torch.float32)),
    )


@torch.library.custom_op("tracetrain::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, compute_dw: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx = rstd * (g*w - xhat * mean(g*w*xhat)), dw = sum_rows g * xhat (empty if not compute_dw)."""
    xhat = _acc(x) * rstd[:, None]
    gw = _acc(grad) * _acc(weight)
    dx = rstd[:, None] * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
    dw = (_acc(grad) * _acc(xhat.to(x.dtype))).sum(0).to(weight.dtype) if compute_dw else weight.new_empty(0)
    return dx.to(x.dtype), dw


@rms_norm_bwd.register_fake
def _(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, compute_dw: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), weight.new_empty(weight.shape if compute_dw else (0,))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _backward(ctx, grad_y: torch.Tensor, grad_rstd: torch.Tensor):
    x, weight, rstd = ctx.saved_tensors
    compute_dw = ctx.needs_input_grad[1]  # False for a frozen norm (LoRA): no weight reduction at all
    dx, dw = rms_norm_bwd(grad_y.contiguous(), x, weight, rstd, compute_dw)
    return dx, (dw if compute_dw else None), None


rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)

if triton_available():
    from tracetrain.kernels import triton_kernels as _tk

    rms_norm_fwd.register_kernel("cuda")(_tk.rms_norm_fwd)
    rms_norm_bwd.register_kernel("cuda")(_tk.rms_norm_bwd)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (..., dim), fused; differentiable in x and weight."""
    y, _ = rms_norm_fwd(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps)
    return y.view(*x.shape[:-1], x.shape[-1])


class FusedRMSNorm(RMSNorm):
    """`RMSNorm` whose forward is the fused op. Swapped in by class (same parameters and names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a compiled block: Inductor fuses the plain ops (kernels/apply.py)
            return super().forward(x)
        return rms_norm(x, self.weight, self.eps)
