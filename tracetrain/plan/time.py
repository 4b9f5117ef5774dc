"""Step time of one GPU: compute, memory-bound work, exposed communication, offload and pipeline bubble.
This module times one micro-batch; step.py assembles the step (communication, per-step work, bubble).

compute      every GEMM of the step by shape (m, n, k): forward; backward dgrad when the input needs a
             gradient, wgrad when the weight trains; full recomputation repeats the checkpointed
             blocks' forward. time = 2mnk / (peak * gemm_efficiency(m, n, k)), never less than its
             bytes at HBM speed (LoRA's rank-r matmuls are bandwidth-bound). The FLOPs sum to
             accounting.training_flops_per_token (tested).
attention    accounting.attention_forward_flops per token (causal: half the square); backward 2x
             forward, each at attention_efficiency(head_dim, seq_len), cuDNN's fused kernel counted the
             same way; FlashAttention-2 (sdpa_kernel = "fa2", torch before 2.11) at SDPA_FA2_RELATIVE of it.
             fp32 with GQA runs SDPA's math path (score matrix). FlexAttention (train.attention = flex)
             at FLEX_*_RELATIVE of flash. Full recomputation runs the forward again.
speed path   train.compile: traffic.compiled_block (Inductor's fused regions) instead of the eager op
             walk; train.fused_kernels: the Triton norm / RoPE / SwiGLU ops (traffic.kernels_block);
             train.fused_ce: the loss's memory-bound work is the chunked row kernel plus the head's
             weight-sized passes (traffic.fused_ce_weight_bytes); its GEMMs are the same three.
memory-bound traffic.py's bytes / (HBM bandwidth * HBM_EFFICIENCY) + KERNEL_FIXED_S per kernel; plus
             KERNEL_GAP_S of idle GPU between any two kernels (eager mode).
per step     autocast weight casts, weight-grad casts and accumulation, AdamW, grad clipping (bytes
             per parameter, traffic.py), over the same bandwidth.
communication (ring collectives; bus bytes = 2(n-1)/n x size for all-reduce, (n-1)/n for all-gather and
             reduce-scatter; bandwidth from `Links` x NCCL_EFFICIENCY, hierarchical across nodes (NVLink
             inside, k NICs of the group's k ranks per node across: collective_time.py), mesh order
             [pp, dp_replicate, dp_shard, cp, tp] outermost first, as torchtitan). Overlap is partial:
             communication behind compute costs max(0, comm - compute) plus the HBM traffic its NCCL
             kernels make meanwhile (2 bytes per wire byte for gathers, 3 for reductions) at memory speed
             (step.hidden_cost); every call adds COLLECTIVE_LATENCY_S:
  DP / HSDP        all-reduce over dp_replicate of the fp32 gradient shard the reduce-scatter leaves
                   (1 / (dp_shard cp) of the gradients at every ZeRO stage; all of them for plain DDP),
                   once per step, behind DP_OVERLAP x the last backward
  FSDP (ZeRO-3)    all-gather bf16 weights in forward and again in backward, reduce-scatter fp32 grads,
                   per micro-batch and block, each behind the compute of its pass; the first gather of
                   each pass and the last reduce-scatter are exposed, and FSDP2's copy-out (4 bytes per
                   parameter and gather) and copy-in (6 per trained parameter) are memory-bound passes
  ZeRO-1/2         all-gather of every unit's weights in the step's first forward, behind it (the
                   first unit's exposed); reduce-scatter of fp32 grads behind backward (ZeRO-2 every
                   micro-batch, ZeRO-1 once); FSDP2's copy-in/out as for ZeRO-3
  pipeline + DP    pipelining reduces every FSDP stage once after the schedule: the reduce-scatter
                   and HSDP all-reduce are exposed, and the gradients accumulate unsharded in fp32
                   (step.accumulation_bytes; the memory model holds the same buffer)
  TP               per block and pass: 2 all-reduces (or all-gather + reduce-scatter with SP, same bytes)
                   of T x d activations, not overlapped (no async TP)
  PP               send/recv of T x d activations per micro-batch and stage boundary, plus the bubble:
                   the busy time is stretched by 1 / (1 - (pp - 1) / (v m + pp - 1)) (v = 1 unless interleaved)
  CP               all-gather of the whole sequence's K/V per block and forward (recomputed ones too),
                   reduce-scatter of their gradients in backward, exposed (parallel/context_parallel.py
                   is not a ring); attention at the query chunk's length s / (2 cp)
  EP               all-to-all dispatch and combine of T x top_k x d per MoE block and pass, exposed
fp8          LoRA (kernels/fp8.py, bases quantised once): block GEMMs at the FP8 peak. Full fine-tuning
             (torchao): bf16 peak x FP8_TORCHAO_SPEEDUP[recipe], from torchao's published tensorwise
             and rowwise runs. The lm_head stays bf16 in both.
offload      optimizer: bf16 grads to the host and their fp32 accumulation on the CPU (overlapped with
             backward), CPU AdamW at the node's cpu_adam_gb_s shared by its GPUs over ~30 bytes per
             param, bf16 weights back chunk by chunk behind the update (mostly hidden);
             activations: offloaded bytes each way over the host link, overlapped with compute when
             "streamed", serial on the compute stream with "save_on_cpu".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tracetrain.models.accounting import attention_forward_flops, training_flops_per_token
from tracetrain.models.qlora import NF4_BITS_PER_PARAM
from tracetrain.plan import activations as act
from tracetrain.plan import traffic as tr
from tracetrain.plan.activations import Numerics
from tracetrain.plan.inputs import Hardware, PlanInput
from tracetrain.plan.params import cast_params, nf4_params, stage_params, trainable_params

# Constants of the hardware-efficiency model. Set from kernel-time profiles of the real trainer on one
# H200 (benchmarks/plan_accuracy.py --profile: GEMM, attention and memory-bound kernel time measured
# separately for llama3.2-1b full FT, llama2-7b LoRA, a 4-layer llama2-7b full FT, llama3.2-1b LoRA);
# the FLOPs and bytes they divide are first-principles counts (accounting.py, traffic.py).
# Large bf16 GEMMs reach ~77% of the dense datasheet peak (cuBLAS on Hopper at 700 W; 750-800 TFLOP/s
# measured on the H200 for 2k-8k dimensions).
GEMM_MAX_EFFICIENCY = 0.77
# A GEMM dimension of this size runs at half the saturated rate (tile quantisation, too few CTAs,
# pipeline fill): LoRA's rank-16 matmuls run far below peak (and are bandwidth-bound anyway).
GEMM_HALF_DIM = 32.0
# Flash attention (FA2 in PyTorch's SDPA) as a fraction of the dense peak for long sequences and large
# heads, counting causal FLOPs at half the square (accounting.py) and backward as 2x forward. It falls
# with the head dimension, x hd / (hd + ATTENTION_HALF_HEAD_DIM), and with short sequences (the
# diagonal blocks and launch waves), x s / (s + ATTENTION_HALF_SEQ): hd 128 at s 2048 -> 0.46 forward.
ATTENTION_FWD_EFFICIENCY = 0.79
ATTENTION_BWD_EFFICIENCY = 0.59
ATTENTION_HALF_HEAD_DIM = 48.0
ATTENTION_HALF_SEQ = 512.0
# The curve above is cuDNN's fused attention, the kernel SDPA runs on Hopper with torch 2.11 (its
# `check_prefer_cudnn_attention` puts cuDNN first on sm90 once the bundled cuDNN is newer than 9.15;
# pytorch/pytorch#138522 had made it opt-in after the 2.5 bugs): on an H100 the trainer's default SDPA and
# forced cuDNN run alike (benchmarks/speed_checks.check_attention: 0.274 vs 0.277 ms forward, 4 x 32 heads
# x 2048 x 128). It matches the FlashAttention-3 paper's H100 SXM cuDNN figures (Shah et al. 2024,
# arXiv:2407.08608, fig. 5, causal forward, hd 128: 484 / 529 / 539 TFLOP/s at 2k / 8k / 16k; fig. 6
# backward: 465 / 518 / 516 at 2.5x the forward FLOPs), to within 10% (tests/plan/test_plan_published.py). Earlier
# torch (and torchtitan's and torchao's published H100 runs of Dec 2024 and early 2025) ran
# FlashAttention-2, which the same figures put at 0.62 of cuDNN in both passes from 2k tokens on
# (forward 298 / 333 / 335, backward 291 / 318 / 322): `PlanInput.sdpa_kernel = "fa2"`.
SDPA_FA2_RELATIVE = 0.62
# FlexAttention's speed relative to flash SDPA on a causal mask without documents, measured on an H100
# (benchmarks/speed.py --attention, 7B shapes: forward 0.274 vs 0.427 ms, backward 0.876 vs 1.078 ms).
# With packed documents flex skips the masked blocks: the plan, which does not know the document
# lengths, stays at the causal cost (an upper bound).
FLEX_FWD_RELATIVE = 0.64
FLEX_BWD_RELATIVE = 0.81
# PyTorch's eager elementwise/reduction kernels (broadcasts, strided RoPE halves, fp32 math) move data
# at ~2/3 of the datasheet HBM bandwidth; each kernel also costs a fixed ~2.5 us (tiny (tokens, 1)
# reductions, ramp-up and tail), and the GPU idles ~2 us between consecutive kernels in eager mode.
HBM_EFFICIENCY = 0.66
KERNEL_FIXED_S = 2.5e-6
KERNEL_GAP_S = 2.0e-6
# Share of a backward pass that DP gradient communication can hide under (buckets start late).
DP_OVERLAP = 0.8
# FP8 full fine-tuning through torchao (Float8Linear: weights, activations and gradients quantised
# every step): speed of the blocks' GEMMs, quantisation included, over the same GEMMs in bf16. Not the
# datasheet's 2x: from torchao's published end-to-end table (docs/source/workflows/training.md,
# "NVIDIA H100": Llama3-8B, 8 x H100, FSDP2, compile, batch 1 x 8192, per-op SAC), bf16 6,150 tokens/s,
# tensorwise (float8 all-gather) 7,689.5, rowwise 6,768: the step saved, 20.0% and 9.1%, divided by the
# GEMM share this planner gives that run in bf16 on its FlashAttention-2 (0.529) is the GEMM time saved
# (38% and 17%). LoRA's frozen bases (kernels/fp8.py, quantised once) keep the FP8 peak: measured there,
# rowwise and tensorwise run alike (docs/planner.md, FP8).
FP8_TORCHAO_SPEEDUP: dict[str, float] = {"tensorwise": 1 / (1 - 0.200 / 0.529), "rowwise": 1 / (1 - 0.091 / 0.529)}
# Bytes a CPU AdamW step touches per fp32 parameter: read p, g, m, v; write p, m, v; bf16 copy out.
CPU_ADAM_BYTES_PER_PARAM = 30.0
# Bytes the offload worker touches per parameter and micro-batch to accumulate a bf16 grad into fp32.
CPU_ACCUMULATE_BYTES_PER_PARAM = 10.0


def gemm_efficiency(m: float, n: float, k: float) -> float:
    """Fraction of peak a GEMM (m x k) @ (k x n) reaches: GEMM_MAX_EFFICIENCY times x / (x + GEMM_HALF_DIM)
    for each dimension, so an 8192 x 4096 x 4096 GEMM gets ~76%, one with n = 16 (LoRA rank) 25%."""
    s = 1.0
    for x in (m, n, k):
        s *= x / (x + GEMM_HALF_DIM)
    return GEMM_MAX_EFFICIENCY * s


def attention_efficiency(head_dim: int, seq_len: float, backward: bool) -> float:
    """Fraction of peak the flash kernels reach (see the constants above)."""
    base = ATTENTION_BWD_EFFICIENCY if backward else ATTENTION_FWD_EFFICIENCY
    return base * head_dim / (head_dim + ATTENTION_HALF_HEAD_DIM) * seq_len / (seq_len + ATTENTION_HALF_SEQ)


@dataclass(frozen=True)
class Gemm:
    name: str
    m: float
    n: float
    k: float
    weight_trains: bool
    input_needs_grad: bool = True


def block_gemms(inp: PlanInput, tokens: float) -> list[Gemm]:
    """GEMMs of one block's forward on one GPU (m = tokens on this GPU, tp-sharded n or k)."""
    a, tp = inp.model, inp.tp
    d, q, kv, f = a.dim, a.q_dim, a.n_kv_heads * a.head_dim, a.ffn_dim
    full = inp.mode == "full"
    shapes = {
        "q_proj": (q / tp, d),
        "k_proj": (kv / tp, d),
        "v_proj": (kv / tp, d),
        "o_proj": (d, q / tp),
        "gate_proj": (f / tp, d),
        "up_proj": (f / tp, d),
        "down_proj": (d, f / tp),
    }
    out = []
    for name, (n, k) in shapes.items():
        m = tokens
        if inp.num_experts and name in ("gate_proj", "up_proj", "down_proj"):
            m = tokens * inp.top_k  # every token visits top_k experts (balanced routing)
        out.append(Gemm(name, m, n, k, full))
        if name in inp.lora_targets and not full:
            r = inp.lora_rank
            out += [Gemm(name + ".lora_A", m, r, k, True), Gemm(name + ".lora_B", m, n, r, True)]
    return out


def block_gemm_peak(inp: PlanInput, hw: Hardware) -> float:
    """FLOP/s the blocks' GEMMs run at before gemm_efficiency: the precision's peak, except FP8 full
    fine-tuning (torchao's dynamic scaling), whose speed over bf16 is the published end-to-end factor
    of its recipe (FP8_TORCHAO_SPEEDUP)."""
    if inp.precision == "fp8" and inp.mode == "full":
        return hw.bf16_flops * FP8_TORCHAO_SPEEDUP[inp.fp8_recipe]
    return hw.peak_flops


def gemm_time(g: Gemm, hw: Hardware, width: int, peak_flops: float | None = None) -> tuple[float, float, float]:
    """(forward seconds, backward seconds, FLOPs of both) of one GEMM at `peak_flops` (default: the
    precision's peak)."""
    peak = peak_flops or hw.peak_flops

    def one(m: float, n: float, k: float) -> float:
        compute = 2 * m * n * k / (peak * gemm_efficiency(m, n, k))
        memory = (m * k + k * n + m * n) * width / (hw.hbm_bytes_s * HBM_EFFICIENCY)
        return max(compute, memory)

    fwd = one(g.m, g.n, g.k)
    bwd = (one(g.m, g.k, g.n) if g.input_needs_grad else 0.0) + (one(g.n, g.k, g.m) if g.weight_trains else 0.0)
    flops = 2 * g.m * g.n * g.k * (1 + g.input_needs_grad + g.weight_trains)
    return fwd, bwd, flops


@dataclass
class MicroBatchTime:
    """Seconds of one micro-batch's forward and backward on one GPU, by kind."""

    forward: dict[str, float] = field(default_factory=dict)
    backward: dict[str, float] = field(default_factory=dict)

    @property
    def forward_s(self) -> float:
        return sum(self.forward.values())

    @property
    def backward_s(self) -> float:
        return sum(self.backward.values())


def _add(d: dict[str, float], k: str, v: float) -> None:
    d[k] = d.get(k, 0.0) + v


def microbatch_time(inp: PlanInput, hw: Hardware, nm: Numerics, stage: int) -> MicroBatchTime:
    """Compute + memory-bound time of one micro-batch through pipeline stage `stage`."""
    a = inp.model
    tokens = inp.micro_batch * inp.seq_len / inp.cp
    sp = stage_params(inp, stage)
    first, last = stage == 0, stage == inp.pp - 1
    t = MicroBatchTime()
    n = sp.num_blocks
    n_ckpt = math.ceil(n / inp.recompute_every) if inp.recompute == "full" else 0
    peak = block_gemm_peak(inp, hw)
    tiled = inp.tiled_mlp_tokens > 0 and inp.tiled_mlp_tokens < tokens  # memory/tiled_mlp.py
    for g in block_gemms(inp, tokens):
        fwd, bwd, _ = gemm_time(g, hw, nm.c, peak)
        _add(t.forward, "GEMM", fwd * n)
        # A tiled MLP's tile runs its forward once more, in its own backward.
        mlp_again = fwd * n if tiled and g.name.split(".")[0] in ("gate_proj", "up_proj", "down_proj") else 0.0
        _add(t.backward, "GEMM", bwd * n + fwd * n_ckpt + mlp_again)
    if last:
        head = Gemm("lm_head", tokens, a.vocab_size / inp.tp, a.dim, inp.mode == "full")
        fwd, bwd, _ = gemm_time(head, hw, nm.c, hw.bf16_flops if inp.precision == "fp8" else None)
        _add(t.forward, "GEMM", fwd)
        _add(t.backward, "GEMM", bwd)
    fwd_a, bwd_a = attention_time(inp, hw, nm, tokens, n)
    _add(t.forward, "attention", fwd_a)
    _add(t.backward, "attention", bwd_a + fwd_a * n_ckpt / max(1, n))
    bw = hw.hbm_bytes_s * HBM_EFFICIENCY
    path, lora_first = act.block_path(inp), first and inp.mode == "lora"
    if path == "compile":
        fwd_b, bwd_b = tr.compiled_block(a, nm, False), tr.compiled_block(a, nm, True)
        first_fix = bwd_b
    elif path == "kernels":
        fwd_b, bwd_b = tr.kernels_block(a, nm, False), tr.kernels_block(a, nm, True)
        first_fix = tr.kernels_block(a, nm, True, first_lora_block=True) if lora_first else bwd_b
    else:
        fwd_b, bwd_b = tr.block_forward(a, nm), tr.block_backward(a, nm)
        first_fix = tr.block_backward(a, nm, first_lora_block=True) if lora_first else bwd_b
    div = inp.tp  # memory-bound work on tp-sharded tensors; SP shards the rest too (approximation: all / tp)
    fused_ce = inp.fused_ce and last
    fwd_t = fwd_b * n + tr.outside_forward(a, nm, first=first, last=last, fused_ce=fused_ce)
    bwd_t = bwd_b * (n - 1) + first_fix + tr.outside_backward(a, nm, last=last, fused_ce=fused_ce)
    if fused_ce:
        chunks = math.ceil(tokens / inp.fused_ce_chunk)
        _add(t.forward, "memory-bound", tr.fused_ce_weight_bytes(a, nm, chunks) / bw + 3 * chunks * KERNEL_FIXED_S)
    if inp.recompute != "none":
        bwd_t += fwd_b * (n_ckpt if inp.recompute == "full" else math.ceil(n / inp.recompute_every))
    _add(t.forward, "memory-bound", fwd_t.bytes_per_token * tokens / div / bw + fwd_t.kernels * KERNEL_FIXED_S)
    _add(t.backward, "memory-bound", bwd_t.bytes_per_token * tokens / div / bw + bwd_t.kernels * KERNEL_FIXED_S)
    # Idle between kernels: every memory-bound kernel, GEMM (forward 1, backward up to 2) and attention call.
    gemms = len(block_gemms(inp, tokens)) * n + (1 if last else 0)
    _add(t.forward, "launch gaps", (fwd_t.kernels + gemms + n) * KERNEL_GAP_S)
    _add(t.backward, "launch gaps", (bwd_t.kernels + 2 * gemms + n) * KERNEL_GAP_S)
    # Weight casts (autocast, once per forward and per recomputed block) and weight-grad casts.
    cast_block, cast_out = cast_params(inp, sp, autocast=nm.autocast, weight_bytes=nm.w)
    casts = cast_block * n + cast_out
    _add(t.forward, "weight casts", 6 * casts / bw)
    wgrad_cast = casts if inp.mode == "full" else 0.0
    _add(t.backward, "weight casts", (6 * wgrad_cast + 6 * cast_block * n_ckpt) / bw)
    # QLoRA: each NF4 weight is dequantised (codes read, 16-bit weight written) per forward, per recomputed
    # forward and once more for its input gradient, per micro-batch.
    nf4 = nf4_params(inp, sp) * (NF4_BITS_PER_PARAM / 8 + nm.c) / bw
    _add(t.forward, "weight casts", nf4)
    _add(t.backward, "weight casts", nf4 * (1 + n_ckpt / max(1, n)))
    return t


def attention_time(inp: PlanInput, hw: Hardware, nm: Numerics, tokens: float, num_blocks: int) -> tuple[float, float]:
    """(forward, backward) seconds of SDPA in `num_blocks` blocks of one micro-batch on one GPU.
    Flash / memory-efficient: FLOPs at attention_efficiency. Math path (fp32 + GQA): the score matrix's
    matmuls at GEMM speed over the full square, plus ~20 (forward) and ~32 (backward) bytes per fp32
    score of masking, softmax and their gradients."""
    a = inp.model
    flops = attention_forward_flops(a, inp.seq_len) / a.n_layers * num_blocks * tokens / inp.tp
    peak = hw.bf16_flops if nm.c == 2 else hw.peak_flops
    if act.attention_backend(a, nm, inp.attention) != "math":
        if inp.attention == "flex":
            fwd_rel, bwd_rel = FLEX_FWD_RELATIVE, FLEX_BWD_RELATIVE
        else:
            fwd_rel = bwd_rel = SDPA_FA2_RELATIVE if inp.sdpa_kernel == "fa2" else 1.0
        # Under CP each rank attends two query chunks of s / (2 cp) tokens to the keys before them
        # (parallel/context_parallel.py): each call runs at its query chunk's length's efficiency.
        seq = inp.seq_len if inp.cp == 1 else inp.seq_len / (2 * inp.cp)
        return (
            flops / (peak * attention_efficiency(a.head_dim, seq, False) * fwd_rel),
            2 * flops / (peak * attention_efficiency(a.head_dim, seq, True) * bwd_rel),
        )
    scores = num_blocks * tokens * inp.seq_len * a.n_heads / inp.tp
    square = 2 * flops / (peak * GEMM_MAX_EFFICIENCY)
    bw = hw.hbm_bytes_s * HBM_EFFICIENCY
    return square + 20 * scores / bw, 2 * square + 32 * scores / bw


def step_flops(inp: PlanInput) -> tuple[float, float]:
    """(model, hardware) FLOPs of one optimizer step on all GPUs, by accounting.py. A MoE block runs
    top_k experts per token where accounting counts one dense MLP: (top_k - 1) x 3df more weights per
    token and layer, plus the d x E router (accounting has no MoE yet). Selective recomputation here
    repeats no matmul (accounting's "selective" counts the attention forward, Megatron's variant)."""
    a = inp.model
    lora = trainable_params(inp) if inp.mode == "lora" else 0
    f = training_flops_per_token(
        a, inp.seq_len, mode=inp.mode, num_lora_params=lora, recompute="full" if inp.recompute == "full" else "none"
    )
    model, hardware = f.model, f.hardware
    if inp.num_experts:
        extra = a.n_layers * ((inp.top_k - 1) * 3 * a.dim * a.ffn_dim + a.dim * inp.num_experts)
        per_weight = 6.0 if inp.mode == "full" else 4.0
        model += per_weight * extra
        hardware += per_weight * extra + (2.0 * extra if inp.recompute == "full" else 0.0)
    tokens = inp.micro_batch * inp.seq_len * inp.num_microbatches * inp.dp
    return model * tokens, hardware * tokens
