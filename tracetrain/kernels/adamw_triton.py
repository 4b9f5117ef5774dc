"""The CUDA AdamW update as one Triton kernel per parameter (imported only when Triton is; see
train/optim.py `AdamW`).

torch's fused AdamW (`_fused_adamw_`), given a gradient divisor (`grad_scale`: the trainer hands it the
clip factor, train/step.py), writes the divided gradient back to memory: 32 bytes a parameter (read
param, grad, exp_avg, exp_avg_sq; write all four). Nothing reads the gradient after the step (it is freed
by `zero_grad`), so this kernel does not store it: 28 bytes a parameter. The math is torch's
`FusedAdamMathFunctor` in ADAMW mode, in float32:

    g = grad / grad_scale                       (when given)
    param = param - lr * weight_decay * param
    exp_avg = beta1 * exp_avg + (1 - beta1) * g
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * g * g
    param = param - lr / (1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^step) + eps)

and nothing changes when `found_inf` is non-zero (read on the device: no host sync). torch takes the
bias corrections in double; here they are float32 (exp2(step * log2(beta))), so results differ from
torch's in the last bits of a step, not in their course (tests/train/test_adamw_triton.py: on a GPU, and
on the CPU under the Triton interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
WARPS = 8


@triton.jit
def _adamw_kernel(
    P,
    G,
    M,
    V,
    STEP,
    GRAD_SCALE,
    FOUND_INF,
    n,
    lr,
    beta1,
    beta2,
    weight_decay,
    eps,
    HAS_SCALE: tl.constexpr,
    HAS_INF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HAS_INF:  # a skipped step reads and writes nothing: no element is in range
        # A scalar select, not `mask & (found_inf == 0)`: the same on the GPU, and the Triton interpreter
        # (TRITON_INTERPRET=1, the CPU test) cannot AND a scalar with a block.
        n = tl.where(tl.load(FOUND_INF) == 0, n, 0)
    mask = offs < n
    p = tl.load(P + offs, mask=mask, other=0.0)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(M + offs, mask=mask, other=0.0)
    v = tl.load(V + offs, mask=mask, other=0.0)
    if HAS_SCALE:
        g = g / tl.load(GRAD_SCALE)
    step = tl.load(STEP)
    bias_correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    bias_correction2 = 1.0 - tl.exp2(step * tl.log2(beta2))
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) / tl.sqrt(bias_correction2) + eps
    p = p - (lr / bias_correction1) * m / denom
    tl.store(P + offs, p, mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)


def adamw_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
) -> None:
    """One AdamW update of a contiguous float32 CUDA parameter in place (`step` already incremented); of a
    CPU one under the Triton interpreter (TRITON_INTERPRET=1)."""
    n = param.numel()
    dummy = step  # pointer arguments the kernel does not read when the flags are off
    _adamw_kernel[(triton.cdiv(n, BLOCK),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        step,
        grad_scale if grad_scale is not None else dummy,
        found_inf if found_inf is not None else dummy,
        n,
        lr,
        beta1,
        beta2,
        weight_decay,
        eps,
        HAS_SCALE=grad_scale is not None,
        HAS_INF=found_inf is not None,
        BLOCK=BLOCK,
        num_warps=WARPS,
    )
