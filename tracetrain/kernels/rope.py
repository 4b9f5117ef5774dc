"""Rotary embedding of q and k as one custom op (no float32 copies of q and k in memory).

The eager `apply_rope` upcasts q (and k) to float32, builds `rotate_half` with a chunk, a negation and
a concatenation, multiplies, adds and casts back: about eight full-size passes per tensor forward,
each over a float32 copy, and as many backward (`CatArrayBatchedCopy` and the float copies were ~8% of
the profiled 7B LoRA step). The fused op reads each element of q/k once, reads cos/sin (shared by all
heads of a token) once per token, and writes the result once, in q's dtype; backward is the same
kernel with the rotation transposed. Outputs keep the input strides (q/k are transposed views).

cos/sin are the model's (batch, seq, head_dim) float32 tables, computed once per batch from
position_ids and shared by every layer (`Transformer.rope`); the two halves of the last dim may
differ (the kernel does not assume the usual duplicated layout).
"""

from __future__ import annotations

import torch

from tracetrain.kernels import triton_available
from tracetrain.models.llama import apply_rope_qk


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """Pure PyTorch: x (batch, heads, seq, head_dim); forward x*cos + rotate_half(x)*sin, or its transpose."""
    half = x.shape[-1] // 2
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (batch, 1, seq, head_dim): broadcast over heads
    xf = x.to(torch.promote_types(x.dtype, torch.float32))  # float64 stays float64 (tests)
    x1, x2 = xf[..., :half], xf[..., half:]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    if backward:
        out = torch.cat((x1 * c1 + x2 * s2, x2 * c2 - x1 * s1), dim=-1)
    else:
        out = torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)
    return torch.empty_like(x).copy_(out)  # keep x's strides, as the Triton kernel and the fake do


@torch.library.custom_op("tracetrain::rope_qk", mutates_args=())
def rope_qk_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (batch, heads, seq, hd) and k (batch, kv_heads, seq, hd) by cos/sin (batch, seq, hd)."""
    return _rotate(q, cos, sin, backward), _rotate(k, cos, sin, backward)


@rope_qk_op.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k)


def _setup_context(ctx, inputs, output) -> None:
    _, _, cos, sin, backward = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backward = backward


def _backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor):
    cos, sin = ctx.saved_tensors
    dq, dk = rope_qk_op(grad_q, grad_k, cos, sin, not ctx.backward)
    return dq, dk, None, None, None


rope_qk_op.register_autograd(_backward, setup_context=_setup_context)

if triton_available():
    from tracetrain.kernels import triton_kernels as _tk

    @rope_qk_op.register_kernel("cuda")
    def _(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos.contiguous(), sin.contiguous()
        return _tk.rope(q, cos, sin, backward), _tk.rope(k, cos, sin, backward)


def fused_rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for `models.llama.apply_rope_qk` (the `Attention.rope_fn` seam)."""
    if torch.compiler.is_compiling():  # a compiled block: Inductor fuses the plain ops (kernels/apply.py)
        return apply_rope_qk(q, k, cos, sin)
    return rope_qk_op(q, k, cos, sin, False)
