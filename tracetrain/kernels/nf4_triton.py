"""QLoRA's NF4 dequantisation in one Triton pass (imported only when Triton is): packed 4-bit codes,
int8 scaler codes, float32 scaler factors and mean in, the 16-bit weight out.

`models/qlora.py::dequantise_nf4` states the math; this kernel is its value-for-value twin: per absmax
block of 64 weights, scale = int8 code / factor (an IEEE division, `div_rn`, as PyTorch's) + mean, then
each weight = NF4 level * scale, all in float32 and rounded once to the output dtype. Bit-identical output
(tests/train/test_nf4_triton.py runs it in Triton's CPU interpreter; benchmarks/nf4_dequant.py checks it on the
GPU and times it next to the compiled PyTorch kernel and bitsandbytes'). Any change must keep both in step.

Layout: one program per `blocks_per_program` absmax blocks; the block's 32 code bytes are one row of a
(blocks, 32) tile, the two 4-bit halves of each byte are looked up in the 16-entry level table (L1-resident)
and interleaved (high nibble first, as the codes were packed) into a (blocks, 64) tile stored contiguously.
Reads 0.5 + 1/64 bytes and writes 2 bytes per weight: the memory-bound floor.

Importing this module registers the kernel as `tracetrain::nf4_dequantise`'s CUDA implementation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tracetrain.models.qlora import BLOCK_SIZE, SCALER_BLOCK_SIZE, nf4_dequantise

BLOCKS_PER_PROGRAM = 64  # absmax blocks per program: 4,096 weights (benchmarks/nf4_dequant.py --sweep)


@triton.jit
def _nf4_dequant_kernel(
    CODES,
    SCALER_CODES,
    SCALER_FACTORS,
    SCALER_MEAN,
    LEVELS,
    OUT,
    n_blocks,
    BLOCKS: tl.constexpr,
    HALF: tl.constexpr,
    SCALER_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    block = pid * BLOCKS + tl.arange(0, BLOCKS)  # (BLOCKS,) absmax block indices
    in_range = block < n_blocks
    scaler_code = tl.load(SCALER_CODES + block, mask=in_range, other=0).to(tl.float32)
    factor = tl.load(SCALER_FACTORS + block // SCALER_BLOCK, mask=in_range, other=1.0)
    scale = tl.div_rn(scaler_code, factor) + tl.load(SCALER_MEAN)  # (BLOCKS,) the block's absmax
    byte = block[:, None] * HALF + tl.arange(0, HALF)[None, :]  # (BLOCKS, 32)
    codes = tl.load(CODES + byte, mask=in_range[:, None], other=0).to(tl.int32)
    high = tl.load(LEVELS + (codes >> 4)) * scale[:, None]  # even weights
    low = tl.load(LEVELS + (codes & 15)) * scale[:, None]  # odd weights
    values = tl.reshape(tl.join(high, low), (BLOCKS, 2 * HALF))  # (BLOCKS, 64), pairs interleaved
    out = block[:, None] * (2 * HALF) + tl.arange(0, 2 * HALF)[None, :]
    tl.store(OUT + out, values.to(OUT.dtype.element_ty), mask=in_range[:, None])  # GPUs: round to nearest even


def dequantise_nf4_triton(
    codes: torch.Tensor,
    sc: torch.Tensor,
    sf: torch.Tensor,
    sm: torch.Tensor,
    lv: torch.Tensor,
    out_features: int,
    in_features: int,
    dtype: torch.dtype,
    blocks_per_program: int = BLOCKS_PER_PROGRAM,
) -> torch.Tensor:
    """The (out_features, in_features) weight in `dtype`, equal bit for bit to `dequantise_nf4`'s.
    Arguments as `tracetrain::nf4_dequantise` (codes uint8 (numel/2,), scaler codes int8, factors and
    mean float32, levels the 16 NF4 levels in float32), all contiguous on one device."""
    numel = out_features * in_features
    assert codes.numel() * 2 == numel, f"{codes.numel()} code bytes for a {out_features} x {in_features} weight"
    out = torch.empty((out_features, in_features), dtype=dtype, device=codes.device)
    n_blocks = numel // BLOCK_SIZE
    grid = (triton.cdiv(n_blocks, blocks_per_program),)
    _nf4_dequant_kernel[grid](
        codes,
        sc,
        sf,
        sm,
        lv,
        out,
        n_blocks,
        BLOCKS=blocks_per_program,
        HALF=BLOCK_SIZE // 2,
        SCALER_BLOCK=SCALER_BLOCK_SIZE,
    )
    return out


@nf4_dequantise.register_kernel("cuda")
def _(codes, sc, sf, sm, lv, out_features, in_features, dtype):
    return dequantise_nf4_triton(codes, sc, sf, sm, lv, out_features, in_features, dtype)
