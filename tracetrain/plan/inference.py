"""Generation memory and decode speed, in-GPU or offloaded KV cache (tracetrain.models.kv_cache).

Memory (bytes; `kv` = `kv_cache_bytes_per_token`, B = batch, C = context, L = layers, W = gpu_window):
  in-GPU cache      GPU: weights + B C kv                        CPU: 0
  offloaded cache   GPU: weights + B min(W, C) kv (the window) + 2 B C kv / L (two staging layers)
                    CPU: B C kv (pinned: every position of every layer)
Prefill activations, the prefill mask and the logits are not counted: with chunked prefill they scale
with the chunk, not the context.

Decode speed: a decode step is memory-bound. It reads every matmul weight once (shared by the batch)
and every cached position of every row. Offloaded, the positions older than the window also cross
PCIe host-to-device every step (fetch), and land in a staging buffer (one more HBM write each); the
window is copied device-to-device (read + write). Fetches overlap compute layer by layer (double
buffering), so the step takes the longer of the two: max(HBM bytes / HBM bandwidth, PCIe bytes / host
link bandwidth). Both are peak figures: the estimate is an upper bound on tokens/s.

Prefill speed (`plan_prefill`): one no-grad forward of the whole prompt (models/prefill.py), timed with the
training planner's forward (plan/time.py): every projection as a GEMM of batch x prompt rows at
`gemm_efficiency`, causal attention at `attention_efficiency` for the prompt's length, the memory-bound
work of each block (traffic.py: the eager op walk, or Inductor's fused regions for the compiled prefill)
at HBM_EFFICIENCY of the bandwidth plus a fixed cost per kernel, the gap between eager kernels, the K/V
written into the cache, and the output head on the last position only. The last block's attention,
output projection and MLP run for the last position alone (`last_position_block`): its q/k/v
projections count every position, the rest one row per prompt, its memory-bound work as a whole block's. Weights and activations in the
compute dtype (no autocast), nothing trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tracetrain.models.accounting import attention_forward_flops, kv_cache_bytes, num_matmul_params, num_params
from tracetrain.models.llama import ModelArgs
from tracetrain.plan import traffic as tr
from tracetrain.plan.activations import Numerics
from tracetrain.plan.inputs import Hardware, device_spec
from tracetrain.plan.time import HBM_EFFICIENCY, KERNEL_FIXED_S, KERNEL_GAP_S, Gemm, attention_efficiency, gemm_time


@dataclass(frozen=True)
class GenerationPlan:
    """Bytes where generation keeps them, and the decode-step estimate."""

    weight_bytes: int  # on the GPU
    gpu_cache_bytes: int  # the whole cache, or (offload) the window plus two staging layers
    cpu_cache_bytes: int  # pinned host memory (offload only)
    gpu_bytes: int  # weights + GPU cache
    gpu_memory_bytes: int  # the GPU's memory
    fits: bool  # gpu_bytes <= gpu_memory_bytes (activations not counted)
    hbm_bytes_per_step: int  # device memory traffic of one decode step
    pcie_bytes_per_step: int  # host-to-device bytes of one decode step
    decode_step_s: float
    decode_tokens_per_s: float  # batch / decode_step_s
    bound: Literal["hbm", "pcie"]


def plan_generation(
    args: ModelArgs,
    batch: int,
    context: int,
    dtype_bytes: int,
    gpu: str = "h100-sxm",
    offload: bool = False,
    gpu_window: int = 0,
) -> GenerationPlan:
    """Memory and decode speed for `batch` sequences whose cache holds `context` positions.

    `dtype_bytes`: bytes per weight and per cached value (2 for bf16). `gpu`: a short name such as
    "h100-sxm" or "h200", or a device name. `gpu_window` counts only with `offload`.
    """
    spec, links = device_spec(gpu)
    weight_bytes = num_params(args) * dtype_bytes
    cache = kv_cache_bytes(args, batch, context, dtype_bytes)
    window = kv_cache_bytes(args, batch, min(gpu_window, context), dtype_bytes) if offload else cache
    staging = 2 * cache // args.n_layers if offload else 0
    fetched = cache - window if offload else 0
    hbm = num_matmul_params(args) * dtype_bytes + cache + fetched + (2 * window if offload else 0)
    hbm_s, pcie_s = hbm / (spec.hbm_tb_s * 1e12), fetched / (links.host_gb_s * 1e9)
    step_s = max(hbm_s, pcie_s)
    gpu_cache = window + staging
    memory = int(spec.memory_gib * 2**30)
    return GenerationPlan(
        weight_bytes=weight_bytes,
        gpu_cache_bytes=gpu_cache,
        cpu_cache_bytes=cache if offload else 0,
        gpu_bytes=weight_bytes + gpu_cache,
        gpu_memory_bytes=memory,
        fits=weight_bytes + gpu_cache <= memory,
        hbm_bytes_per_step=hbm,
        pcie_bytes_per_step=fetched,
        decode_step_s=step_s,
        decode_tokens_per_s=batch / step_s,
        bound="pcie" if pcie_s > hbm_s else "hbm",
    )


@dataclass(frozen=True)
class PrefillPlan:
    """Seconds of one prefill forward by kind, and the prompt tokens per second it gives."""

    seconds: dict[str, float]  # GEMM, attention, memory-bound, launch gaps, cache write
    tokens: int  # batch x prompt length

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s


def plan_prefill(
    args: ModelArgs,
    batch: int,
    prompt_len: int,
    dtype_bytes: int = 2,
    gpu: str = "h100-sxm",
    mode: Literal["eager", "compiled", "fused"] = "eager",
    last_block: bool = True,
) -> PrefillPlan:
    """Time of one prefill forward of `batch` unpadded prompts of `prompt_len` tokens from position 0 (the
    module docstring). `mode`: the prefill's path (models/prefill.py): the eager forward, the compiled one,
    or the eager one with the fused Triton norm / RoPE / SwiGLU kernels (train.fused_kernels = 'on'). Dense
    and MoE blocks (top_k experts per token, balanced). `last_block`: the last block runs its attention, output
    projection and MLP for the last position alone (models/prefill.py `last_position_block`, since 2026-12-07);
    False models the prefill before it, which ran the whole last block."""
    spec, _ = device_spec(gpu)
    peak = (spec.bf16_tflops if dtype_bytes <= 2 else spec.fp32_tflops) * 1e12
    hw = Hardware(
        spec.name, spec.memory_gib * 2**30, peak, spec.bf16_tflops * 1e12, spec.hbm_tb_s * 1e12, 0.0, 0.0, 0.0, 0.0, 0.0
    )
    bw = hw.hbm_bytes_s * HBM_EFFICIENCY
    c = dtype_bytes
    nm = Numerics(full=False, autocast=False, c=c, w=c, x=c, a=c, targets=frozenset(), rank=0)
    tokens = batch * prompt_len
    d, q, kv = args.dim, args.q_dim, args.n_kv_heads * args.head_dim
    seconds = {"GEMM": 0.0, "attention": 0.0, "memory-bound": 0.0, "launch gaps": 0.0, "cache write": 0.0}
    blocks = {
        "eager": tr.block_forward,
        "compiled": lambda a, n: tr.compiled_block(a, n, False),
        "fused": lambda a, n: tr.kernels_block(a, n, False),
    }
    block = blocks[mode](args, nm)
    for layer in range(args.n_layers):
        moe = args.is_moe_layer(layer)
        # The last block runs its output projection and MLP for the last position of each row alone
        # (models/prefill.py `last_position_block`); its q, k and v projections see every position.
        alone = last_block and layer == args.n_layers - 1 and prompt_len > 1
        out_rows = batch if alone else tokens
        f, rows = (args.expert_ffn_dim, out_rows * args.experts_top_k) if moe else (args.ffn_dim, out_rows)
        gemms = [
            Gemm("q", tokens, q, d, False, False),
            Gemm("k", tokens, kv, d, False, False),
            Gemm("v", tokens, kv, d, False, False),
            Gemm("o", out_rows, d, q, False, False),
            Gemm("gate", rows, f, d, False, False),
            Gemm("up", rows, f, d, False, False),
            Gemm("down", rows, d, f, False, False),
        ]
        if moe:
            gemms.append(Gemm("router", out_rows, args.num_experts, d, False, False))
        seconds["GEMM"] += sum(gemm_time(g, hw, c)[0] for g in gemms)
        seconds["launch gaps"] += (len(gemms) + 1 + block.kernels) * KERNEL_GAP_S
        seconds["cache write"] += 4 * c * kv * tokens / bw + 2 * KERNEL_FIXED_S  # read k, v; write them
    # Every block's causal attention over the prompt but the last's (its share: the average block's), which
    # attends from one position per row (a read of that layer's keys and values, memory-bound).
    whole = args.n_layers - 1 if last_block and prompt_len > 1 else args.n_layers
    attention = attention_forward_flops(args, prompt_len) * tokens * whole / args.n_layers
    seconds["attention"] = attention / (hw.bf16_flops * attention_efficiency(args.head_dim, prompt_len, False))
    if whole < args.n_layers:
        seconds["attention"] += 2 * c * kv * tokens / bw + KERNEL_FIXED_S
    outside = tr.outside_forward(args, nm, first=True, last=False)  # embedding lookup, rotary tables
    memory = block * args.n_layers + outside  # the last block's as a whole one: a bound (its MLP half runs once)
    seconds["memory-bound"] = memory.bytes_per_token * tokens / bw + memory.kernels * KERNEL_FIXED_S
    # The last position of each row: final norm and the head's GEMM (a weight read, memory-bound).
    head = Gemm("lm_head", batch, args.vocab_size, d, False, False)
    seconds["GEMM"] += gemm_time(head, hw, c)[0]
    return PrefillPlan(seconds, tokens)
