"""Triton kernels for the fused FP8 MLP's row ops (fp8_mlp.py), imported only when Triton is.

One program per row, the whole row in registers (BLOCK = next power of two of the ffn dim, masked):
SwiGLU forward or backward in float32, the row's amax, a power-of-two scale, and the fp8 store, reading
each input once and writing each output once. Tensorwise scaling needs the tensor's amax before any
value can be cast, so it runs the kernel twice: amax per row, a tiny torch reduction, then the cast.

Each kernel is an op-for-op twin of the PyTorch reference in fp8_mlp.py (`swiglu_quant_reference`,
`swiglu_bwd_quant_reference`), which runs eagerly on CUDA as PyTorch's own kernels do: sigmoid as
1 / (1 + exp(-x)) with libdevice's accurate exp and an IEEE division, the scale as
exp2(floor(log2(fp8_max / max(amax, eps)))) with libdevice's log2/exp2, no FMA contraction
(`enable_fp_fusion=False`), round-to-nearest-even fp8 casts. Any change here must keep both in step;
benchmarks/fp8_triton_check.py compares them byte for byte on the GPU and times both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tracetrain.kernels.fp8 import EPS, amax_to_scale


def _row_warps(block: int) -> int:
    return 32 if block >= 16384 else 16 if block >= 8192 else 8 if block >= 2048 else 4


@triton.jit
def _sigmoid(x):
    return tl.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + libdevice.exp(-x))


@triton.jit
def _abs_max(x):
    """max |x| over the block; a NaN anywhere gives inf (so the scale below becomes NaN, as PyTorch's)."""
    return tl.max(tl.where(x == x, tl.abs(x), float("inf")), axis=0)


@triton.jit
def _pow2_scale(amax, fp8_max, eps):
    """(scale, inverse scale) as `amax_to_scale(amax, power_of_2=True)`: NaN both when amax is not finite."""
    e = tl.floor(libdevice.log2(tl.div_rn(fp8_max, tl.maximum(amax, eps))))
    finite = amax < float("inf")
    return tl.where(finite, libdevice.exp2(e), float("nan")), tl.where(finite, libdevice.exp2(-e), float("nan"))


@triton.jit
def _saturate(x, fp8_max):
    """clamp(x, -fp8_max, fp8_max) that keeps NaN (tl.minimum/maximum may drop it)."""
    return tl.where(x > fp8_max, fp8_max, tl.where(x < -fp8_max, -fp8_max, x))


@triton.jit
def _swiglu_quant_kernel(
    GU,
    Q,
    INV,
    ROW_AMAX,
    SCALE,
    stride_gu,
    stride_q,
    n_cols,
    fp8_max,
    eps,
    ROWWISE: tl.constexpr,
    WRITE_Q: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    h = gate * _sigmoid(gate) * up  # masked lanes: 0
    if WRITE_Q:
        if ROWWISE:
            scale, inv = _pow2_scale(_abs_max(h), fp8_max, eps)
            tl.store(INV + row, inv)
        else:
            scale = tl.load(SCALE)
        tl.store(Q + row * stride_q + cols, _saturate(h * scale, fp8_max).to(Q.dtype.element_ty), mask=mask)
    else:  # tensorwise, first pass
        tl.store(ROW_AMAX + row, _abs_max(h))


@triton.jit
def _swiglu_bwd_quant_kernel(
    DH,
    GU,
    Q,
    INV,
    ROW_AMAX,
    SCALE,
    stride_dh,
    stride_gu,
    stride_q,
    n_cols,
    fp8_max,
    eps,
    ROWWISE: tl.constexpr,
    WRITE_Q: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dh = tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    sig = _sigmoid(gate)
    dgate = dh * up * sig * (1.0 + gate * (1.0 - sig))
    dup = dh * (gate * sig)
    amax = tl.maximum(_abs_max(dgate), _abs_max(dup))  # one scale for the row [dgate | dup]
    if WRITE_Q:
        if ROWWISE:
            scale, inv = _pow2_scale(amax, fp8_max, eps)
            tl.store(INV + row, inv)
        else:
            scale = tl.load(SCALE)
        q_row = Q + row * stride_q
        tl.store(q_row + cols, _saturate(dgate * scale, fp8_max).to(Q.dtype.element_ty), mask=mask)
        tl.store(q_row + n_cols + cols, _saturate(dup * scale, fp8_max).to(Q.dtype.element_ty), mask=mask)
    else:  # tensorwise, first pass
        tl.store(ROW_AMAX + row, amax)


def _launch(
    kernel: triton.JITFunction,
    tensors: tuple[torch.Tensor, ...],
    strides: tuple[int, ...],
    q: torch.Tensor,
    ffn: int,
    rowwise: bool,
) -> torch.Tensor:
    """Run `kernel` over the rows into q; returns the inverse scale, (rows, 1) rowwise or () tensorwise."""
    rows = q.shape[0]
    fp8_max = torch.finfo(q.dtype).max
    block = triton.next_power_of_2(ffn)
    opts = dict(BLOCK=block, num_warps=_row_warps(block), enable_fp_fusion=False)
    if rowwise:
        inv = torch.empty((rows, 1), dtype=torch.float32, device=q.device)
        kernel[(rows,)](
            *tensors, q, inv, inv, inv, *strides, q.stride(0), ffn, fp8_max, EPS, ROWWISE=True, WRITE_Q=True, **opts
        )
        return inv
    row_amax = torch.empty(rows, dtype=torch.float32, device=q.device)
    kernel[(rows,)](
        *tensors,
        q,
        row_amax,
        row_amax,
        row_amax,
        *strides,
        q.stride(0),
        ffn,
        fp8_max,
        EPS,
        ROWWISE=False,
        WRITE_Q=False,
        **opts,
    )
    scale = amax_to_scale(row_amax.amax(), q.dtype)  # () on the device: no host sync
    kernel[(rows,)](
        *tensors,
        q,
        scale,
        row_amax,
        scale,
        *strides,
        q.stride(0),
        ffn,
        fp8_max,
        EPS,
        ROWWISE=False,
        WRITE_Q=True,
        **opts,
    )
    return scale.reciprocal()


def swiglu_quant(gu: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """gu (tokens, 2 ffn), unit column stride -> h_q (tokens, ffn) in fp8_dtype, inverse scale."""
    assert gu.stride(-1) == 1
    ffn = gu.shape[1] // 2
    q = torch.empty((gu.shape[0], ffn), dtype=fp8_dtype, device=gu.device)
    return q, _launch(_swiglu_quant_kernel, (gu,), (gu.stride(0),), q, ffn, rowwise)


def swiglu_bwd_quant(
    dh: torch.Tensor, gu: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """dh (tokens, ffn), gu (tokens, 2 ffn), unit column strides -> [dgate | dup] (tokens, 2 ffn), inverse scale."""
    assert dh.stride(-1) == 1 and gu.stride(-1) == 1
    q = torch.empty(gu.shape, dtype=fp8_dtype, device=gu.device)
    return q, _launch(_swiglu_bwd_quant_kernel, (dh, gu), (dh.stride(0), gu.stride(0)), q, dh.shape[1], rowwise)
