"""bf16 GEMM rates by layout on the training step's shapes: is any of the three products slow as written?

For a linear Y = X W^T with X (tokens, in) and W (out, in) row-major, the step runs three products:
forward X @ W.t(), input gradient dY @ W, weight gradient dY.t() @ X. cuBLAS picks a kernel per layout;
the same product can be asked for in a transposed form ((W.t() @ dY.t()).t(), ...). This prints TFLOP/s for
each form (median of 20 timed calls after 5 warm-up), on the llama2-7b and llama3.2-1b shapes at 8192
tokens, so a slow layout shows up before it is looked for in a profile.

  python3 benchmarks/gemm_layouts.py        # on a CUDA GPU; writes gemm_layouts_<gpu>.json under $OUT or results/
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, median, write_result  # noqa: E402

TOKENS = 8192
SHAPES = {  # (in, out) of the linears of one block
    "llama2-7b q/k/v/o": (4096, 4096),
    "llama2-7b gate/up": (4096, 11008),
    "llama2-7b down": (11008, 4096),
    "llama3.2-1b q/o": (2048, 2048),
    "llama3.2-1b k/v": (2048, 512),
    "llama3.2-1b gate/up": (2048, 8192),
    "llama3.2-1b down": (8192, 2048),
}


def rate(fn, flops: float) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return flops / median(times) / 1e12


def main() -> None:
    dev = torch.device("cuda")
    rows = []
    for name, (d_in, d_out) in SHAPES.items():
        x = torch.randn(TOKENS, d_in, device=dev, dtype=torch.bfloat16)
        w = torch.randn(d_out, d_in, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(TOKENS, d_out, device=dev, dtype=torch.bfloat16)
        flops = 2 * TOKENS * d_in * d_out
        forms = {
            "forward X @ W.t()": lambda: x @ w.t(),
            "forward (W @ X.t()).t()": lambda: (w @ x.t()).t(),
            "input grad dY @ W": lambda: dy @ w,
            "input grad (W.t() @ dY.t()).t()": lambda: (w.t() @ dy.t()).t(),
            "weight grad dY.t() @ X": lambda: dy.t() @ x,
            "weight grad (X.t() @ dY).t()": lambda: (x.t() @ dy).t(),
        }
        for form, fn in forms.items():
            tf = rate(fn, flops)
            rows.append({"shape": name, "in": d_in, "out": d_out, "tokens": TOKENS, "form": form, "tflops": tf})
            print(f"{name:22} {form:34} {tf:7.1f} TFLOP/s", flush=True)
        del x, w, dy
    gpu = torch.cuda.get_device_name(0).replace(" ", "-")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    print(f"wrote {write_result(f'gemm_layouts_{gpu}.json', {**environment(), 'rows': rows}, out)}")


if __name__ == "__main__":
    main()
