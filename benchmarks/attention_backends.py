"""Causal attention per SDPA backend on one GPU: which kernel do prefill and long-context training run (#32)?

For each shape (the attention of a block of llama2-7b, 32 query and 32 key/value heads, and llama3-8b, 32 and
8, head dim 128, bf16, a prompt from position 0: causal, no mask tensor) and each way SDPA can run it:
`default` (no backend forced: what the trainer, the prefill and Hugging Face's "sdpa" run; on Hopper with
torch 2.11 that is meant to be cuDNN, plan/time.py), FLASH_ATTENTION (FlashAttention-2), CUDNN_ATTENTION
(cuDNN's fused attention) and EFFICIENT_ATTENTION (memory-efficient):

- `fwd`: the forward alone (prefill), milliseconds and TFLOP/s (causal: half the score matrix, 4 b h s^2 d / 2);
- `fwd+bwd`: forward and backward (training; backward counted at 2.5x the forward's FLOPs);
- `max_abs_diff`: the output's largest difference from the default's on the same inputs.

Grouped-query shapes run with `enable_gqa=True`; a backend that refuses it runs with the key/value heads
repeated, and the row says so (`gqa: expanded`, the repeat included in the time). A backend that cannot run a
shape says why. CUDA events, median of `--steps` calls after `--warmup`. The default's time next to the
forced backends' says which kernel SDPA picked and whether another one would be faster.

    PYTHONPATH=. python3 benchmarks/attention_backends.py          # about 40 s on an H100

Writes attention_backends_<gpu>.json under benchmarks/results (and a copy under $OUT when set).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, median, time_steps, write_result

BACKENDS: dict[str, SDPBackend | None] = {
    "default": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}
MODELS = {"llama2-7b": (32, 32), "llama3-8b": (32, 8)}  # query heads, key/value heads
# (model, batch, sequence, passes): prefill at 4k (batch 1 and 16) and 32k; training at 32k and 64k.
SHAPES = [
    ("llama2-7b", 1, 4096, "fwd"),
    ("llama2-7b", 16, 4096, "fwd"),
    ("llama2-7b", 1, 32768, "fwd"),
    ("llama3-8b", 1, 4096, "fwd"),
    ("llama3-8b", 16, 4096, "fwd"),
    ("llama3-8b", 1, 32768, "fwd"),
    ("llama3-8b", 1, 32768, "fwd+bwd"),
    ("llama3-8b", 1, 65536, "fwd+bwd"),
]
HEAD_DIM = 128


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: SDPBackend | None, expand: bool
) -> torch.Tensor:
    with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
        if q.shape[1] == k.shape[1]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if expand:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def measure(model: str, batch: int, seq: int, passes: str, warmup: int, steps: int) -> list[dict]:
    heads, kv_heads = MODELS[model]
    gen = torch.Generator(device="cuda").manual_seed(0)
    grad = passes == "fwd+bwd"

    def rand(h: int) -> torch.Tensor:
        x = torch.randn(batch, h, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        return x.requires_grad_(grad)

    q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
    flops = 4 * batch * heads * seq * seq * HEAD_DIM / 2 * (3.5 if grad else 1.0)
    reference = None
    rows = []
    for name, backend in BACKENDS.items():
        row = {"model": model, "batch": batch, "seq": seq, "passes": passes, "backend": name}
        expand = False
        for expand in (False, True) if kv_heads != heads else (False,):
            try:
                out = attention(q, k, v, backend, expand)
                break
            except RuntimeError as e:
                row["error"] = str(e).strip().splitlines()[0][:200]
        else:
            rows.append(row)
            print(f"{model:10s} b{batch:<3d} {seq:6d} {passes:8s} {name:10s} cannot run: {row['error']}", flush=True)
            continue
        row.pop("error", None)
        if kv_heads != heads:
            row["gqa"] = "expanded" if expand else "enable_gqa"
        out = out.detach().float()
        if reference is None:
            reference = out
        row["max_abs_diff"] = float((out - reference).abs().max())
        del out
        dout = torch.randn(batch, heads, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen)

        def call(backend: SDPBackend | None = backend, expand: bool = expand, dout: torch.Tensor = dout) -> None:
            y = attention(q, k, v, backend, expand)
            if grad:
                y.backward(dout)

        if grad:
            call()  # the first backward allocates the gradients
        with torch.no_grad() if not grad else torch.enable_grad():
            ms = median(time_steps(call, warmup, steps)) * 1e3
        for t in (q, k, v):
            t.grad = None
        row.update(ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1))
        rows.append(row)
        print(
            f"{model:10s} b{batch:<3d} {seq:6d} {passes:8s} {name:10s} {row.get('gqa', ''):10s} "
            f"{ms:9.3f} ms {row['tflops']:7.1f} TFLOP/s  diff {row['max_abs_diff']:.2e}",
            flush=True,
        )
    torch.cuda.empty_cache()
    return rows


def _key(row: dict) -> str:
    return f"{row['model']} b{row['batch']} {row['seq']} {row['passes']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_backends.py measures CUDA kernels: run it on a GPU machine")
    rows = []
    for shape in SHAPES:
        rows += measure(*shape, args.warmup, args.steps)
    env = environment()
    best = {}
    for r in rows:
        if "ms" in r:
            key = _key(r)
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    print("\nfastest per shape:")
    for key, r in best.items():
        default = [x["ms"] for x in rows if x["backend"] == "default" and "ms" in x and _key(x) == key]
        speedup = f"{default[0] / r['ms']:.2f}x the default" if default else "the default did not run"
        print(f"  {key:32s} {r['backend']:10s} {speedup}")
    payload = {"env": env, "warmup": args.warmup, "steps": args.steps, "head_dim": HEAD_DIM, "rows": rows}
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    name = f"attention_backends_{env['device'].replace(' ', '-')}.json"
    print(f"wrote {write_result(name, payload, out)}")


if __name__ == "__main__":
    main()
