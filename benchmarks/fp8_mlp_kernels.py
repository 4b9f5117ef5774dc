"""Where the time of one frozen FP8 SwiGLU MLP goes (llama2-7b shape, forward + backward, compiled): the
three `Float8FrozenLinear`s (the default FP8 path) against `Float8FrozenFeedForward` (kernels/fp8_mlp.py),
each GPU kernel's total time per call from the torch profiler. GPU only.

    python3 benchmarks/fp8_mlp_kernels.py [--tokens 8192 --dim 4096 --ffn 11008] [--out result.json]
"""

from __future__ import annotations

import argparse
import collections
import copy
import json

import torch
from common import environment

from tracetrain.kernels.fp8 import to_float8_frozen
from tracetrain.kernels.fp8_mlp import to_float8_frozen_mlp
from tracetrain.models.llama import FeedForward, ModelArgs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--recipe", default="rowwise")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.manual_seed(0)
    base = FeedForward(ModelArgs(dim=a.dim, ffn_dim=a.ffn)).cuda().to(torch.bfloat16).requires_grad_(False)
    unfused = copy.deepcopy(base)
    for linear in (unfused.gate_proj, unfused.up_proj, unfused.down_proj):
        to_float8_frozen(linear, a.recipe)
    fused = to_float8_frozen_mlp(copy.deepcopy(base), a.recipe)
    x = torch.randn(a.tokens, a.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(a.tokens, a.dim, device="cuda", dtype=torch.bfloat16)
    result = {**environment(), "shape": vars(a), "variants": {}}
    for name, mlp in (("three_fp8_linears", unfused), ("fused_mlp", fused)):
        compiled = torch.compile(mlp, fullgraph=True)

        def step(m=compiled) -> None:
            x.grad = None
            m(x).backward(dy)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(a.calls):
                step()
            torch.cuda.synchronize()
        totals: dict[str, float] = collections.defaultdict(float)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                totals[ev.name] += ev.device_time_total / a.calls
        rows = sorted(totals.items(), key=lambda kv: -kv[1])
        total = sum(totals.values())
        print(f"== {name}: {total:.0f} us of kernels per forward + backward")
        for kname, us in rows[:14]:
            print(f"  {us:8.0f} us  {kname[:110]}")
        result["variants"][name] = {"kernel_us_per_call": total, "kernels": [{"name": k, "us": u} for k, u in rows]}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
