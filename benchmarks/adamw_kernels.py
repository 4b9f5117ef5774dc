"""One AdamW step over llama3.2-1b's parameters (float32, the shapes of the real model, built on the meta
device and materialised empty): torch's fused AdamW as the trainer runs it (clip factor as grad_scale,
found_inf) against train/optim.py `AdamW` (the Triton kernel), median of CUDA-event timings, and the
bandwidth of the bytes each must move (32 and 28 bytes a parameter). GPU only.

    python3 benchmarks/adamw_kernels.py [--preset llama3.2-1b] [--steps 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, median, time_steps, write_result

from tracetrain.kernels import adamw_triton
from tracetrain.models.llama import Transformer
from tracetrain.models.presets import PRESETS
from tracetrain.train.optim import AdamW

CONFIGS = [(1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3.2-1b")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="")
    ap.add_argument("--sweep", action="store_true", help="also time other (BLOCK, num_warps) of the kernel")
    a = ap.parse_args()
    with torch.device("meta"):
        model = Transformer(PRESETS[a.preset])
    shapes = [p.shape for p in model.parameters()]
    numel = sum(s.numel() for s in shapes)
    rows = []
    variants = [("torch fused AdamW", torch.optim.AdamW, 32, None), ("tracetrain AdamW (Triton)", AdamW, 28, None)]
    variants += [(f"  Triton BLOCK={b} warps={w}", AdamW, 28, (b, w)) for b, w in CONFIGS if a.sweep]
    for name, cls, bytes_per, config in variants:
        if config:
            adamw_triton.BLOCK, adamw_triton.WARPS = config
        params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        opt = cls(groups, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
        opt.grad_scale = torch.tensor(1.5, device="cuda")
        opt.found_inf = torch.tensor(0.0, device="cuda")
        ms = median(time_steps(opt.step, warmup=3, steps=a.steps)) * 1e3
        rows.append({"optimizer": name, "ms": ms, "bytes_per_param": bytes_per,
                     "tb_per_s": bytes_per * numel / ms / 1e9})
        print(f"{name:28s} {ms:7.2f} ms  {bytes_per * numel / ms / 1e9:5.2f} TB/s ({bytes_per} B x {numel:,} params)",
              flush=True)
        del params, opt
        torch.cuda.empty_cache()
    result = {**environment(), "preset": a.preset, "params": numel, "rows": rows}
    write_result(a.out or f"adamw_kernels_{torch.cuda.get_device_name().replace(' ', '-')}.json", result)


if __name__ == "__main__":
    main()
