"""Memory-bound work of one micro-batch: HBM bytes read + written by every op that is not a matmul or
attention, derived op by op from `models/llama.py`, `models/lora.py` and `train/step.py` (the same walk
as activations.py; the notation d, kv, f, V, c, w, x, a is defined there). Bytes per token unless said.

Forward, per block:
  RMSNorm x 2          pow 8d + mean 4d + (x * rstd) 8d + (weight * h) 2x*d, + 2(x+4)d when x != 4 (float() and back)
  input casts          (x + c)d for each linear whose input autocast casts (x != c), per linear
  RoPE on q (w = d) and k (w = kv)   40w fp32 work + 18w of casts when c = 2
  residual adds x 2    (2x + c)d
  SwiGLU               silu 2c*f + mul 3c*f
  LoRA per adapter     (* scaling) 2a*o + (out + update) 3c*o, o = output width
Backward, per block (only what needs a gradient runs):
  RMSNorm x 2          68d of fp32 work + 2x*d (grad * weight) + 4x*d weight grad [full only]
                       + 2(x+4)d of casts when x != 4; the residual's two grads add: 3x*d
  input grads          each cast linear casts its input grad back (c + x)d; n consumers of a tensor add
                       their n - 1 extra grads (3g*width each, g the grad's dtype)
  RoPE                 28w + 3c*w (add of the two halves) + 18w of casts when c = 2
  SwiGLU               mul backward 6c*f + silu backward 3c*f
  LoRA per adapter     (* scaling) 2a*o
Outside the blocks: embedding 2x*d, final RMSNorm, lm_head input cast, loss forward (c+4)V + 8V
(fp32 copy, log_softmax), loss backward 4V + 12V + (4+c)V (nll grad, log_softmax grad, cast back).

Per step and parameter (not per token): autocast weight casts 6 bytes per cast weight and forward,
fp32 weight-grad casts 6 (bf16 -> fp32), accumulation into .grad 12 from the second micro-batch on,
fused AdamW 28 (read p, g, m, v; write p, m, v), foreach AdamW ~80 (eight passes), grad-norm clipping 12
(4, the norm alone, where the clip factor is folded into the fused update: one process, no loss scaler).
The test in tests/plan/test_plan_time.py checks the per-token totals against every aten op of a real
forward + backward on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracetrain.models.llama import ModelArgs
from tracetrain.plan.activations import GATE_UP, QKV, Numerics

OUT_WIDTH = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Traffic:
    """HBM bytes per token and kernel launches per micro-batch of some memory-bound work."""

    bytes_per_token: float
    kernels: float

    def __add__(self, o: Traffic) -> Traffic:
        return Traffic(self.bytes_per_token + o.bytes_per_token, self.kernels + o.kernels)

    def __mul__(self, k: float) -> Traffic:
        return Traffic(self.bytes_per_token * k, self.kernels * k)


def _widths(args: ModelArgs) -> dict[str, int]:
    d, kv, f = args.dim, args.n_kv_heads * args.head_dim, args.ffn_dim
    return {"q_proj": d, "k_proj": kv, "v_proj": kv, "o_proj": d, "gate_proj": f, "up_proj": f, "down_proj": d}


def _inputs(args: ModelArgs) -> dict[str, int]:
    d, f = args.dim, args.ffn_dim
    return {n: (f if n == "down_proj" else d) for n in OUT_WIDTH}


def norm_forward(d: int, nm: Numerics) -> Traffic:
    casts = 2 * (nm.x + 4) * d if nm.x != 4 else 0
    return Traffic(20 * d + 2 * nm.x * d + casts, 7 + (2 if nm.x != 4 else 0))


def norm_backward(d: int, nm: Numerics) -> Traffic:
    casts = 2 * (nm.x + 4) * d if nm.x != 4 else 0
    weight_grad = 4 * nm.x * d if nm.full else 0
    return Traffic(68 * d + 2 * nm.x * d + weight_grad + casts, 11 + (2 if nm.full else 0) + (2 if nm.x != 4 else 0))


def rope(width: int, nm: Numerics, backward: bool) -> Traffic:
    casts = 18 * width if nm.c != 4 else 0
    if backward:
        return Traffic(28 * width + 3 * nm.c * width + casts, 5 + (3 if nm.c != 4 else 0))
    return Traffic(40 * width + casts, 5 + (3 if nm.c != 4 else 0))


def _consumers(nm: Numerics, linears: tuple[str, ...]) -> list[int]:
    """For each consumer of a shared input: the dtype width it casts the input to (0 = no cast)."""
    out = []
    for name in linears:
        out.append(nm.c if (nm.autocast and nm.x != nm.c) else 0)  # the linear itself (base when LoRA)
        if name in nm.targets:
            out.append(nm.a if nm.x != nm.a else 0)  # its adapter's lora_A
    return out


def input_casts(nm: Numerics, linears: tuple[str, ...], width: int, src: int, backward: bool) -> Traffic:
    """Casts of a shared input (dtype `src`) for its consumers, and in backward the casts back plus
    the sum of the consumers' input gradients."""
    casts = [c for c in _consumers(nm, linears) if c]
    if not backward:
        return Traffic(sum((src + c) * width for c in casts), len(casts))
    n = len(_consumers(nm, linears))
    grad = src if casts else nm.c
    return Traffic(sum((c + src) * width for c in casts) + (n - 1) * 3 * grad * width, len(casts) + n - 1)


def lora(args: ModelArgs, nm: Numerics, backward: bool) -> Traffic:
    widths = _widths(args)
    total = Traffic(0.0, 0)
    for name in nm.targets:
        o = widths[name]
        cast = (nm.a + nm.c) * o if nm.a != nm.c else 0
        if backward:
            total += Traffic(2 * nm.a * o + cast, 1 + (1 if cast else 0))
        else:
            total += Traffic(2 * nm.a * o + cast + 3 * nm.c * o, 2 + (1 if cast else 0))
    return total


def block_forward(args: ModelArgs, nm: Numerics) -> Traffic:
    d, kv, f = args.dim, args.n_kv_heads * args.head_dim, args.ffn_dim
    t = norm_forward(d, nm) * 2
    t += input_casts(nm, QKV, d, nm.x, False) + input_casts(nm, GATE_UP, d, nm.x, False)
    t += input_casts(nm, ("o_proj",), d, nm.c, False) + input_casts(nm, ("down_proj",), f, nm.c, False)
    t += rope(d, nm, False) + rope(kv, nm, False)
    t += Traffic(2 * (2 * nm.x + nm.c) * d, 2)
    t += Traffic(5 * nm.c * f, 2)
    return t + lora(args, nm, False)


def block_backward(args: ModelArgs, nm: Numerics, *, first_lora_block: bool = False) -> Traffic:
    """Backward of one block; in block 0 of a LoRA model the first norm and the q/k/v input
    gradients do not run (its input needs no gradient)."""
    d, kv, f = args.dim, args.n_kv_heads * args.head_dim, args.ffn_dim
    t = norm_backward(d, nm) * (1 if first_lora_block else 2)
    if not first_lora_block:
        t += input_casts(nm, QKV, d, nm.x, True)
    t += input_casts(nm, GATE_UP, d, nm.x, True)
    t += input_casts(nm, ("o_proj",), d, nm.c, True) + input_casts(nm, ("down_proj",), f, nm.c, True)
    t += rope(d, nm, True) + rope(kv, nm, True)
    t += Traffic(3 * nm.x * d * (1 if first_lora_block else 2), 1 if first_lora_block else 2)
    t += Traffic(9 * nm.c * f, 3)
    return t + lora(args, nm, True)


def compiled_block(args: ModelArgs, nm: Numerics, backward: bool) -> Traffic:
    """A torch.compile'd block: Inductor fuses each region between matmuls / attention into one kernel
    that reads its inputs and writes its outputs once (activations.py lists what it saves).
    Forward: norm 1 (x*d in, c*d out), RoPE on q and k (c(d + kv) in and out), o_proj's input copy
    (c*d each way), residual + norm 2 (x*d + c*d in, x*d + c*d out), SwiGLU (2cf in, cf out), residual
    (x*d + c*d in, x*d out): 6 kernels. Backward: SwiGLU (cf + 2cf in, 2cf out), norm 2 recomputed from
    its input with the residual grad (x*d + 2c*d + x*d in, x*d out), the copy (2c*d), RoPE (2c(d + kv)),
    norm 1 likewise with three q/k/v input grads (x*d + 3c*d + x*d in, x*d out) and the norm-weight
    reductions: 8 kernels. LoRA's scale-and-add fuses into these; its traffic is counted as eager."""
    d, kv, f = args.dim, args.n_kv_heads * args.head_dim, args.ffn_dim
    x, c = nm.x, nm.c
    if backward:
        total = 5 * c * f + (3 * x + 2 * c) * d + 2 * c * d + 2 * c * (d + kv) + (3 * x + 3 * c) * d
        return Traffic(total, 8) + lora(args, nm, True)
    total = (x + c) * d + 2 * c * (d + kv) + 2 * c * d + (2 * x + 2 * c) * d + 3 * c * f + (2 * x + c) * d
    return Traffic(total, 6) + lora(args, nm, False)


def kernels_block(args: ModelArgs, nm: Numerics, backward: bool, *, first_lora_block: bool = False) -> Traffic:
    """Eager block with the Triton RMSNorm / RoPE / SwiGLU ops (train.fused_kernels): each reads its
    inputs and writes its outputs once (norm: x*d in, x*d out, and back: 3x*d; RoPE: q and k in and out;
    SwiGLU: 2cf in, cf out, and back: 3cf in, 2cf out); linears' input casts and residual adds as eager."""
    d, kv, f = args.dim, args.n_kv_heads * args.head_dim, args.ffn_dim
    eager = block_backward(args, nm, first_lora_block=first_lora_block) if backward else block_forward(args, nm)
    norms = 1 if (backward and first_lora_block) else 2
    if backward:
        old = norm_backward(d, nm) * norms + rope(d, nm, True) + rope(kv, nm, True) + Traffic(9 * nm.c * f, 3)
        new = Traffic(norms * 3 * nm.x * d + 4 * nm.c * (d + kv) + 5 * nm.c * f, norms + 2)
    else:
        old = norm_forward(d, nm) * 2 + rope(d, nm, False) + rope(kv, nm, False) + Traffic(5 * nm.c * f, 2)
        new = Traffic(2 * 2 * nm.x * d + 2 * nm.c * (d + kv) + 3 * nm.c * f, 4)
    return Traffic(
        eager.bytes_per_token - old.bytes_per_token + new.bytes_per_token, eager.kernels - old.kernels + new.kernels
    )


def outside_forward(args: ModelArgs, nm: Numerics, *, first: bool, last: bool, fused_ce: bool = False) -> Traffic:
    d, v = args.dim, args.vocab_size
    t = Traffic(28 * args.head_dim, 6)  # rotary tables
    if first:
        t += Traffic(2 * nm.x * d + 8, 1)
    if last:
        t += norm_forward(d, nm)
        if nm.autocast and nm.x != nm.c:
            t += Traffic((nm.x + nm.c) * d, 1)
        if fused_ce:  # the fused CE's row kernel reads each chunk's logits twice and writes its grad once
            t += Traffic(3 * nm.c * v, 1)
        else:
            t += Traffic((nm.c + 4) * v * (nm.c != 4) + 8 * v, 2 + (nm.c != 4))
    return t


def outside_backward(args: ModelArgs, nm: Numerics, *, last: bool, fused_ce: bool = False) -> Traffic:
    d, v = args.dim, args.vocab_size
    if not last:
        return Traffic(0.0, 0)
    if fused_ce:  # the saved input gradient scaled and cast back (the weight gradient: fused_ce_weight_bytes)
        t = Traffic((2 * nm.c + nm.x) * d, 2)
    else:
        t = Traffic(4 * v + 12 * v + (4 + nm.c) * v * (nm.c != 4), 2 + (nm.c != 4))
    if nm.autocast and nm.x != nm.c:
        t += Traffic((nm.c + nm.x) * d, 1)
    return t + norm_backward(d, nm)


def adamw_bytes_per_param(fused: bool, clip_folded: bool = False) -> float:
    """HBM bytes per fp32 trainable parameter of one AdamW step plus the gradient clipping: the norm and
    the scale (clip_grad_norm_, 12), or only the norm (4) where the trainer folds the clip factor into the
    fused update (train/step.py `fold_clip`: one process, no loss scaler; train/optim.py's kernel)."""
    return (28.0 if fused else 80.0) + (4.0 if fused and clip_folded else 12.0)


def fused_ce_weight_bytes(args: ModelArgs, nm: Numerics, num_chunks: int) -> float:
    """HBM bytes per micro-batch of the fused CE's weight-sized work: casting the head to the compute
    dtype (read w, write c), adding each chunk's bf16 partial into the float32 gradient (read 2 + 4,
    write 4; the first chunk only converts) and scaling it in backward (read 4, write 4)."""
    vd = args.vocab_size * args.dim
    cast = (nm.w + nm.c) * vd if nm.w != nm.c else 0.0
    grad = (10 * num_chunks - 4 + 8) * vd if nm.full else 0.0
    return cast + grad
