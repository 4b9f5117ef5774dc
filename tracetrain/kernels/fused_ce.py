"""Fused lm_head + cross-entropy, chunk of tokens by chunk: the full (tokens, vocab) logits never exist.

The eager loss (`train/step.py: loss_sum`) materialises the logits in bf16, a float32 copy, the float32
log-softmax and, in backward, a float32 and a bf16 gradient of the same size: for llama3.2-1b at
batch 4 x 2048 (vocab 128,256) that is ~2 GB per bf16 copy and ~4 GB per float32 one, the largest
activations of the step. Here, for each chunk of `chunk_tokens` rows:

  logits = h_chunk @ W^T                 bf16 (chunk, vocab), float32 accumulation in the GEMM
  loss_rows, grad = CE rows              float32 log-sum-exp; grad = softmax - onehot written over
                                         the logits buffer in place (Triton: 2 reads + 1 write)
  grad_h[chunk] = grad @ W               (chunk, dim)
  grad_W += grad^T @ h_chunk             float32 accumulator (only when W is trained; on CUDA the
                                         GEMM accumulates into it in float32, `_accumulate_weight_grad`)

The gradients are computed in the forward pass (with d loss = 1) and scaled by the incoming gradient in
backward, so the lm_head GEMMs run three times, as in the eager step, not four. Logits are rounded to
bf16 before the float32 statistics exactly as the eager path (`logits.float()` of a bf16 matmul).
A frozen lm_head (LoRA) skips the weight gradient GEMM entirely.

Peak extra memory: one (chunk, vocab) bf16 buffer (chunk 4096 x 128,256 = 1 GiB) plus, when trained,
the float32 weight gradient (it is the parameter's gradient anyway).

Adaptive chunk (`adaptive=True`, config `train.fused_ce_adaptive`): at the longest contexts the step
runs a few hundred MiB from the limit, where that 1 GiB buffer decides between fitting and not. Each
call then reads free device memory (the driver's free bytes plus what the caching allocator holds
unused: no sync) and shrinks the chunk so that its logits take at most half of it
(`adaptive_chunk_tokens`); it never grows past `chunk_tokens`, so a run with memory to spare is unchanged.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from tracetrain.devices import free_device_bytes
from tracetrain.kernels import triton_available
from tracetrain.labels import IGNORE_INDEX

DEFAULT_CHUNK_TOKENS = 4096


def ce_rows_torch_(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, write_grad: bool) -> torch.Tensor:
    """Pure PyTorch twin of the Triton row kernel: loss (rows,) float32; with write_grad the logits are
    overwritten by d(sum of row losses)/d logits = softmax - onehot (zero rows for ignored labels)."""
    lf = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays float64 (tests)
    lse = torch.logsumexp(lf, dim=-1)  # (rows,)
    valid = labels != ignore_index
    safe = labels.clamp(min=0).unsqueeze(1)
    loss = torch.where(valid, lse - lf.gather(1, safe).squeeze(1), 0.0)
    if write_grad:
        grad = torch.exp(lf - lse.unsqueeze(1))
        grad.scatter_add_(1, safe, torch.full_like(lse, -1.0).unsqueeze(1))
        logits.copy_(grad * valid.unsqueeze(1))
    return loss


def ce_rows_(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, write_grad: bool) -> torch.Tensor:
    if logits.is_cuda and triton_available():
        from tracetrain.kernels import triton_kernels

        return triton_kernels.ce_rows_(logits, labels, ignore_index, write_grad)
    return ce_rows_torch_(logits, labels, ignore_index, write_grad)


def _chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    ignore_index: int,
    compute_dtype: torch.dtype,
    need_h: bool,
    need_w: bool,
):
    """Summed loss, and (when asked) d loss / d hidden in compute dtype and d loss / d weight in float32
    (float64 for float64 inputs, which the tests use)."""
    num_tokens = hidden.shape[0]
    h, w = hidden.to(compute_dtype), weight.to(compute_dtype)  # (tokens, dim), (vocab, dim)
    losses = torch.empty(num_tokens, dtype=torch.promote_types(compute_dtype, torch.float32), device=hidden.device)
    grad_h = torch.empty_like(h) if need_h else None
    grad_w = None
    for start in range(0, num_tokens, chunk_tokens):
        end = min(start + chunk_tokens, num_tokens)
        h_chunk = h[start:end]
        logits = h_chunk @ w.t()  # (chunk, vocab) in compute dtype
        losses[start:end] = ce_rows_(logits, labels[start:end], ignore_index, write_grad=need_h or need_w)
        if need_h:
            torch.mm(logits, w, out=grad_h[start:end])  # type: ignore[index]  # grad_h is allocated whenever need_h, the only case that writes it
        if need_w:
            grad_w = _accumulate_weight_grad(grad_w, logits.t(), h_chunk, losses.dtype)
    return losses.sum(), grad_h, grad_w


def _accumulate_weight_grad(
    acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, acc_dtype: torch.dtype
) -> torch.Tensor:
    """acc + a @ b in `acc_dtype` (float32): a (vocab, chunk), b (chunk, dim), both in compute dtype.

    On CUDA with bf16/fp16 operands the GEMM writes float32 itself and adds into the accumulator in its
    epilogue (`out_dtype`, beta = 1): no half-precision (vocab, dim) product, no separate add pass (for
    the 1B head each is a 1 GiB float32 read and write per chunk), and the sum is not rounded to bf16
    per chunk. Elsewhere (CPU, float32/64 tests) a plain GEMM and an add.
    """
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and acc_dtype == torch.float32:
        if acc is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    part = a @ b
    return part.to(acc_dtype) if acc is None else acc.add_(part)


CHUNK_MULTIPLE = 256  # an adaptive chunk is a multiple of this (GEMM-friendly), and at least this


def adaptive_chunk_tokens(free_bytes: int, vocab: int, max_chunk: int, bytes_per_logit: int = 2) -> int:
    """The chunk whose (chunk, vocab) logits take at most half of `free_bytes`, rounded down to a multiple
    of CHUNK_MULTIPLE, between CHUNK_MULTIPLE and `max_chunk` (half: the row statistics, the chunk's
    slice of d hidden and the allocator's rounding need the rest)."""
    fit = free_bytes // 2 // max(1, vocab * bytes_per_logit)
    return max(CHUNK_MULTIPLE, min(max_chunk, fit // CHUNK_MULTIPLE * CHUNK_MULTIPLE))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_tokens: int,
        ignore_index: int,
        compute_dtype: torch.dtype,
    ) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are chosen explicitly here
            loss, grad_h, grad_w = _chunked(
                hidden, weight, labels, chunk_tokens, ignore_index, compute_dtype, need_h, need_w
            )
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        dh = (grad_h * grad_loss).to(hidden_dtype) if grad_h is not None else None
        dw = (grad_w * grad_loss).to(weight_dtype) if grad_w is not None else None
        return dh, dw, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = IGNORE_INDEX,
    adaptive: bool = False,
) -> torch.Tensor:
    """sum over tokens of cross_entropy(hidden @ weight^T, labels), ignoring `ignore_index`.

    hidden (tokens, dim), weight (vocab, dim), labels (tokens,) -> () float32. The matmuls run in the
    autocast dtype when autocast is on (as `lm_head` would), else in hidden's dtype. `adaptive` (CUDA):
    at most `chunk_tokens` per chunk, fewer when free memory is short (module docstring).
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    device_type = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    if adaptive and hidden.is_cuda:
        elem = torch.empty((), dtype=compute_dtype).element_size()
        chunk_tokens = adaptive_chunk_tokens(free_device_bytes(hidden.device), weight.shape[0], chunk_tokens, elem)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, labels, chunk_tokens, ignore_index, compute_dtype)
    with torch.autocast(device_type, enabled=False):
        return _chunked(hidden, weight, labels, chunk_tokens, ignore_index, compute_dtype, False, False)[0]


def apply_fused_ce(model: nn.Module, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, adaptive: bool = False) -> None:
    """Give `model` (a Transformer) the fused lm_head + cross-entropy: its forward with `labels` then
    returns the summed loss, `chunk_tokens` rows of logits at a time (`adaptive`: fewer when free GPU
    memory is short). Parameters are untouched."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    model.fused_loss = functools.partial(fused_linear_cross_entropy, chunk_tokens=chunk_tokens, adaptive=adaptive)  # type: ignore[assignment]  # nn.Module attributes are typed Tensor | Module in torch's stubs
