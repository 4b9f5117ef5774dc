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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tracetrain.models.accounting import kv_cache_bytes, num_matmul_params, num_params
from tracetrain.models.llama import ModelArgs
from tracetrain.plan.inputs import device_spec


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
