"""Triton kernels for CUDA, and the launchers the custom ops register (imported only when Triton is).

All arithmetic is in float32 whatever the storage dtype; every kernel reads its inputs once and
writes its outputs once (the memory-bound floor). Layout notes are on each launcher. The pure-PyTorch
twins of these kernels, which the CPU tests check, are in rmsnorm.py / rope.py / swiglu.py /
fused_ce.py: any change here must keep both in step (benchmarks/speed.py compares them on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _row_warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def _num_programs(device: torch.device) -> int:
    """Persistent-style grid for row reductions: a few programs per SM (4 on CPU, Triton's interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count * 4


# ---------------------------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    # Round the normalised value to the input dtype before scaling, as the eager module does.
    xhat = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (xhat * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    G,
    X,
    W,
    RSTD,
    DX,
    DW_PARTIAL,
    stride_g,
    stride_x,
    stride_dx,
    n_rows,
    n_cols,
    rows_per_program,
    HAS_DW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, rows_per_program):
        row = (pid * rows_per_program + i).to(tl.int64)
        in_range = row < n_rows  # the last program may have fewer rows
        rmask = mask & in_range
        g = tl.load(G + row * stride_g + cols, mask=rmask, other=0.0).to(tl.float32)
        x = tl.load(X + row * stride_x + cols, mask=rmask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row, mask=in_range, other=0.0)
        xhat = x * rstd
        gw = g * w
        # dx = rstd * (g*w - xhat * mean(g*w*xhat))
        dx = rstd * (gw - xhat * (tl.sum(gw * xhat, axis=0) / n_cols))
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=rmask)
        if HAS_DW:
            dw += g * xhat.to(X.dtype.element_ty).to(tl.float32)
    if HAS_DW:
        tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=mask)


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, dim) contiguous rows -> y (rows, dim) in promote(x, weight) dtype, rstd (rows,) fp32."""
    rows, dim = x.shape
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(dim)
    _rms_norm_fwd_kernel[(rows,)](
        x, weight, y, rstd, x.stride(0), y.stride(0), dim, eps, BLOCK=block, num_warps=_row_warps(block)
    )
    return y, rstd


def rms_norm_bwd(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, compute_dw: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (rows, dim) in x's dtype; dw (dim,) in weight's dtype, or an empty tensor if not asked for."""
    rows, dim = x.shape
    dx = torch.empty_like(x)
    num_programs = min(rows, _num_programs(x.device))
    rows_per_program = triton.cdiv(rows, num_programs)
    num_programs = triton.cdiv(rows, rows_per_program)
    partial = torch.empty((num_programs, dim) if compute_dw else (0,), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(dim)
    _rms_norm_bwd_kernel[(num_programs,)](
        grad,
        x,
        weight,
        rstd,
        dx,
        partial,
        grad.stride(0),
        x.stride(0),
        dx.stride(0),
        rows,
        dim,
        rows_per_program,
        HAS_DW=compute_dw,
        BLOCK=block,
        num_warps=_row_warps(block),
    )
    dw = partial.sum(0).to(weight.dtype) if compute_dw else weight.new_empty(0)
    return dx, dw


# ------------------------------------------------------------------------------------------------- RoPE


@triton.jit
def _rope_kernel(
    X,
    OUT,
    COS,
    SIN,
    seq_len,
    n_heads,
    sx_b,
    sx_h,
    sx_s,
    so_b,
    so_h,
    so_s,
    sc_b,
    sc_s,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    token = tl.program_id(0)
    b = (token // seq_len).to(tl.int64)
    s = (token % seq_len).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    dmask = d < HALF
    mask = (heads < n_heads) & dmask
    cs = b * sc_b + s * sc_s + d
    cos1 = tl.load(COS + cs, mask=dmask, other=0.0)
    cos2 = tl.load(COS + cs + HALF, mask=dmask, other=0.0)
    sin1 = tl.load(SIN + cs, mask=dmask, other=0.0)
    sin2 = tl.load(SIN + cs + HALF, mask=dmask, other=0.0)
    xp = X + b * sx_b + s * sx_s + heads * sx_h + d
    x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose of the rotation
        o1 = x1 * cos1 + x2 * sin2
        o2 = x2 * cos2 - x1 * sin1
    else:  # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
        o1 = x1 * cos1 - x2 * sin1
        o2 = x2 * cos2 + x1 * sin2
    op = OUT + b * so_b + s * so_s + heads * so_h + d
    tl.store(op, o1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(op + HALF, o2.to(OUT.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """x (batch, heads, seq, head_dim), any strides with a unit last stride; cos/sin (batch, seq, head_dim)
    float32. One program per token handles all its heads. The output keeps x's strides."""
    batch, heads, seq, head_dim = x.shape
    assert x.stride(-1) == 1 and cos.stride(-1) == 1 and cos.stride() == sin.stride()
    out = torch.empty_like(x)
    half = head_dim // 2
    _rope_kernel[(batch * seq,)](
        x,
        out,
        cos,
        sin,
        seq,
        heads,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        cos.stride(0),
        cos.stride(1),
        HALF=half,
        BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(half),
        BACKWARD=backward,
        num_warps=4,
    )
    return out


# ----------------------------------------------------------------------------------------------- SwiGLU


@triton.jit
def _swiglu_fwd_kernel(GATE, UP, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, (g * tl.sigmoid(g) * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(GRAD, GATE, UP, DGATE, DUP, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(GRAD + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GATE + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DUP + offs, (dy * silu).to(DUP.dtype.element_ty), mask=mask)
    tl.store(DGATE + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DGATE.dtype.element_ty), mask=mask)


_EW_BLOCK = 2048


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up contiguous, same shape and dtype -> silu(gate) * up."""
    out = torch.empty_like(gate)
    n = gate.numel()
    _swiglu_fwd_kernel[(triton.cdiv(n, _EW_BLOCK),)](gate, up, out, n, BLOCK=_EW_BLOCK, num_warps=8)
    return out


def swiglu_bwd(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    _swiglu_bwd_kernel[(triton.cdiv(n, _EW_BLOCK),)](grad, gate, up, dgate, dup, n, BLOCK=_EW_BLOCK, num_warps=8)
    return dgate, dup


# ------------------------------------------------------------------------------------ cross-entropy rows


@triton.jit
def _ce_rows_kernel(
    LOGITS, LABELS, LOSS, stride_row, n_cols, ignore_index, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    label = tl.load(LABELS + row)
    # Pass 1: online max and sum of exp, in float32, per lane. The running max starts finite so that a
    # lane that only ever sees masked (-inf) columns keeps exp(m - m_new) = 1 instead of NaN.
    m = tl.full([BLOCK], -1e30, tl.float32)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        acc = acc * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    row_max = tl.max(m, axis=0)
    lse = row_max + tl.log(tl.sum(acc * tl.exp(m - row_max), axis=0))
    valid = label != ignore_index
    safe_label = tl.where(valid, label, 0)
    target = tl.load(base + safe_label).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - target, 0.0))
    if WRITE_GRAD:
        # Pass 2: d loss / d logits = softmax - onehot (0 for ignored rows), written over the logits.
        scale = tl.where(valid, 1.0, 0.0)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            cmask = cols < n_cols
            x = tl.load(base + cols, mask=cmask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse) - tl.where(cols == safe_label, 1.0, 0.0)
            tl.store(base + cols, (p * scale).to(LOGITS.dtype.element_ty), mask=cmask)


def ce_rows_(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, write_grad: bool) -> torch.Tensor:
    """Per-row cross-entropy of logits (rows, vocab), unit column stride; returns loss (rows,) fp32.
    With write_grad, the logits are overwritten by d(sum of losses)/d logits, in their own dtype."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _ce_rows_kernel[(rows,)](
        logits, labels, loss, logits.stride(0), vocab, ignore_index, WRITE_GRAD=write_grad, BLOCK=4096, num_warps=16
    )
    return loss
