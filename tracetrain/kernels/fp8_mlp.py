"""A frozen SwiGLU feed-forward in FP8 with two GEMMs forward, two backward (opt-in: `apply_fp8(..., fused_mlp=True)`).

As three `Float8FrozenLinear`s (fp8.py), a frozen MLP costs three forward and three input-gradient GEMMs,
and its activation and its quantisation are separate passes over (tokens, ffn) tensors: compiled, Inductor
takes each row's amax in a looped two-pass reduction over the 11008 columns of a 7B MLP (the SwiGLU
backward + quantise-dY kernel measured 500 us per layer on an H100 where one pass over its bytes takes
~250 us). Here, for an MLP whose three projections are plain frozen linears (no LoRA on them):

    forward    x --quantise--> [x_q @ W13^T] -> gu (tokens, 2 ffn) = [gate | up]     one GEMM for gate and up
               gu --swiglu_quant--> h_q, h_inv       h = silu(gate) * up, quantised in the same pass
               [h_q @ W2^T] -> y (tokens, dim)
    backward   dy --quantise--> [dy_q @ W2] -> dh (tokens, ffn)
               dh, gu --swiglu_bwd_quant--> dgu_q, dgu_inv    [dgate | dup], one scale per row of both
               [dgu_q @ W13] -> dx (tokens, dim)             gate's and up's input gradients summed by the GEMM

W13 = cat(gate.weight, up.weight) (2 ffn, dim). Only gu is saved for backward (x and h are not): one
(tokens, 2 ffn) activation where the eager MLP saves gate, up and silu(gate). The two row kernels are
custom ops (opaque to torch.compile) with a pure-PyTorch default, the reference, and Triton kernels for
CUDA (fp8_triton.py, checked against these twins by benchmarks/fp8_triton_check.py).

Scaling is as fp8.py's: rowwise = one power-of-two scale per row, E4M3 both ways; tensorwise = one scale
per tensor, E5M2 gradients (a tensor-wide amax needs a second pass, so tensorwise h and dgu are not single-
pass). Differences from the three-linear path: the input-gradient weight W13^T is quantised per input
channel across gate and up together, and dgate and dup share one scale per row (they were two tensors).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tracetrain.kernels import triton_available
from tracetrain.kernels.fp8 import (
    E4M3,
    E5M2,
    FAST_ACCUM_FORWARD,
    Recipe,
    fp8_compatible,
    fp8_matmul,
    quantize,
    quantize_weight,
    scaled_matmul,
)
from tracetrain.models.llama import FeedForward

# ------------------------------------------------------------------------------------ the row kernels


def swiglu_quant_reference(
    gu: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = silu(gate) * up in float32 from gu (tokens, 2 ffn) = [gate | up], quantised as `quantize` does.

    Returns h_q (tokens, ffn) in `fp8_dtype` and its inverse scale, (tokens, 1) rowwise or () tensorwise.
    Written op for op as the Triton kernel computes it (silu as g * sigmoid(g)), so the two agree bitwise.
    """
    gate, up = gu.float().chunk(2, dim=-1)
    h = gate * torch.sigmoid(gate) * up  # (tokens, ffn) float32
    return quantize(h, fp8_dtype, rowwise=rowwise)


def swiglu_bwd_quant_reference(
    dh: torch.Tensor, gu: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[dgate | dup] (tokens, 2 ffn) for h = silu(gate) * up and its gradient dh (tokens, ffn), quantised.

    dgate = dh * up * sig * (1 + gate * (1 - sig)), dup = dh * silu(gate), float32; one scale per row of the
    concatenation (rowwise) or per tensor. Inverse scale (tokens, 1) or ().
    """
    gate, up = gu.float().chunk(2, dim=-1)
    g = dh.float()
    sig = torch.sigmoid(gate)
    dgate = g * up * sig * (1 + gate * (1 - sig))
    dup = g * (gate * sig)
    return quantize(torch.cat([dgate, dup], dim=-1), fp8_dtype, rowwise=rowwise)


@torch.library.custom_op("tracetrain::swiglu_quant", mutates_args=())
def swiglu_quant(gu: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up from gu = [gate | up] (tokens, 2 ffn), quantised to `fp8_dtype` in one pass (rowwise)."""
    return swiglu_quant_reference(gu, fp8_dtype, rowwise)


@swiglu_quant.register_fake
def _(gu: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, cols = gu.shape
    inv_shape = (tokens, 1) if rowwise else ()
    return gu.new_empty((tokens, cols // 2), dtype=fp8_dtype), gu.new_empty(inv_shape, dtype=torch.float32)


@torch.library.custom_op("tracetrain::swiglu_bwd_quant", mutates_args=())
def swiglu_bwd_quant(
    dh: torch.Tensor, gu: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[dgate | dup] (tokens, 2 ffn) from dh (tokens, ffn) and gu, quantised with one scale per row."""
    return swiglu_bwd_quant_reference(dh, gu, fp8_dtype, rowwise)


@swiglu_bwd_quant.register_fake
def _(dh: torch.Tensor, gu: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    inv_shape = (gu.shape[0], 1) if rowwise else ()
    return gu.new_empty(gu.shape, dtype=fp8_dtype), gu.new_empty(inv_shape, dtype=torch.float32)


if triton_available():
    from tracetrain.kernels import fp8_triton as _ft

    swiglu_quant.register_kernel("cuda")(_ft.swiglu_quant)
    swiglu_bwd_quant.register_kernel("cuda")(_ft.swiglu_bwd_quant)


# ---------------------------------------------------------------------------------------- the MLP


class _Float8FeedForward(torch.autograd.Function):
    """down(silu(gate(x)) * up(x)) with frozen, pre-quantised weights: the diagram in the module docstring."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w13: torch.Tensor,
        w13_inv: torch.Tensor,
        w13t: torch.Tensor,
        w13t_inv: torch.Tensor,
        w2: torch.Tensor,
        w2_inv: torch.Tensor,
        w2t: torch.Tensor,
        w2t_inv: torch.Tensor,
        recipe: Recipe,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        rowwise = recipe == "rowwise"
        x2 = x.reshape(-1, x.shape[-1])  # (tokens, dim)
        gu = fp8_matmul(x2, E4M3, w13, w13_inv, recipe, out_dtype, FAST_ACCUM_FORWARD)  # (tokens, 2 ffn)
        h_q, h_inv = swiglu_quant(gu, E4M3, rowwise)  # (tokens, ffn)
        y = scaled_matmul(h_q, h_inv, w2, w2_inv, recipe, out_dtype, FAST_ACCUM_FORWARD)  # (tokens, dim)
        ctx.save_for_backward(gu, w13t, w13t_inv, w2t, w2t_inv)  # one activation; the rest are buffers
        ctx.recipe, ctx.x_dtype = recipe, x.dtype
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gu, w13t, w13t_inv, w2t, w2t_inv = ctx.saved_tensors
        rowwise = ctx.recipe == "rowwise"
        grad_dtype = E4M3 if rowwise else E5M2
        dy = grad_out.reshape(-1, grad_out.shape[-1])  # (tokens, dim)
        dh = fp8_matmul(dy, grad_dtype, w2t, w2t_inv, ctx.recipe, gu.dtype, fast_accum=False)  # (tokens, ffn)
        dgu_q, dgu_inv = swiglu_bwd_quant(dh, gu, grad_dtype, rowwise)  # (tokens, 2 ffn)
        dx = scaled_matmul(dgu_q, dgu_inv, w13t, w13t_inv, ctx.recipe, ctx.x_dtype, fast_accum=False)  # (tokens, dim)
        return (dx.view(*grad_out.shape[:-1], dx.shape[-1]), *([None] * 10))


class Float8FrozenFeedForward(FeedForward):
    """A frozen `FeedForward` run by `_Float8FeedForward`. Swapped in by class: same parameters and state dict.

    gate_proj, up_proj and down_proj stay plain bf16 `nn.Linear`s (merge, export and checkpoints use them;
    their own forwards are not called). The FP8 copies are non-persistent buffers: `fp8_w13` (2 ffn, dim)
    and `fp8_w13t` (dim, 2 ffn) for gate|up, `fp8_w2` and `fp8_w2t` for down, each with an `_inv` scale.
    """

    fp8_recipe: Recipe
    _fp8_source: tuple[tuple[int, int], ...]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # compiled blocks: `apply_fp8`'s block pre-hook does this
            self.refresh_if_stale()
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        return _Float8FeedForward.apply(
            x,
            self.fp8_w13,
            self.fp8_w13_inv,
            self.fp8_w13t,
            self.fp8_w13t_inv,
            self.fp8_w2,
            self.fp8_w2_inv,
            self.fp8_w2t,
            self.fp8_w2t_inv,
            self.fp8_recipe,
            out_dtype,
        )

    def quantized_weights(self) -> dict[str, torch.Tensor]:
        """The buffers' values from the current bf16 weights: W13 and W2 through `quantize_weight`."""
        w13 = torch.cat([self.gate_proj.weight.detach(), self.up_proj.weight.detach()])  # (2 ffn, dim)
        out = {}
        for prefix, weight in (("w13", w13), ("w2", self.down_proj.weight)):
            for key, value in quantize_weight(weight, self.fp8_recipe).items():  # w, w_inv, wt, wt_inv
                out["fp8_" + key.replace("w", prefix, 1)] = value
        return out

    def _source(self) -> tuple[tuple[int, int], ...]:
        return tuple((p.weight._version, p.weight.data_ptr()) for p in (self.gate_proj, self.up_proj, self.down_proj))

    @torch.no_grad()
    def refresh_if_stale(self) -> bool:
        """Re-quantise when any of the three bf16 weights changed since the last time; True if it did.

        As `Float8FrozenLinear.refresh_if_stale`: eager only, buffers updated in place.
        """
        if self._source() == self._fp8_source:
            return False
        for name, value in self.quantized_weights().items():
            getattr(self, name).copy_(value)
        self._fp8_source = self._source()
        return True

    def extra_repr(self) -> str:
        return f"fp8={self.fp8_recipe}, fused gate|up"


def fp8_mlp_eligible(mlp: nn.Module) -> bool:
    """The fused path applies: a `FeedForward` whose gate, up and down projections are all plain, frozen,
    bias-free `nn.Linear`s (none adapted by LoRA) with dims that are multiples of 16."""
    if not isinstance(mlp, FeedForward) or isinstance(mlp, Float8FrozenFeedForward):
        return False
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    return all(
        type(p) is nn.Linear and p.bias is None and not p.weight.requires_grad and fp8_compatible(p)
        for p in projections
    )


def to_float8_frozen_mlp(mlp: FeedForward, recipe: Recipe) -> Float8FrozenFeedForward:
    """Swap an eligible `mlp`'s class to `Float8FrozenFeedForward` in place and quantise its weights."""
    assert fp8_mlp_eligible(mlp), "only a FeedForward of plain frozen linears is fused"
    mlp.__class__ = Float8FrozenFeedForward
    fused: Float8FrozenFeedForward = mlp  # type: ignore[assignment]  # __class__ was swapped on the line above; mypy keeps the FeedForward type
    fused.fp8_recipe = recipe
    for name, value in fused.quantized_weights().items():
        fused.register_buffer(name, value, persistent=False)
    fused._fp8_source = fused._source()
    return fused
