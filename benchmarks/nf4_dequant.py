"""NF4 dequantisation on one GPU: the compiled PyTorch kernel, the Triton kernel and bitsandbytes' (#30).

For every projection shape of llama3-8b and llama3-70b (q, k, v, o, gate, up, down):

- one dequantisation (4-bit codes -> bf16 weight) per implementation: `compiled` (torch.compile of
  `dequantise_nf4`, QLoRA's CUDA path before the Triton kernel), `triton` (kernels/nf4_triton.py, the path
  now) and `bnb` (bitsandbytes' `dequantize_4bit` of the same weight quantised by bitsandbytes, NF4 blocks
  of 64 with double quantisation: what unsloth's 4-bit layers run), when bitsandbytes is importable (here,
  or from the peers' packages: --peersite, or .peers/peersite.tgz as benchmarks/qlora.py unpacks it);
  microseconds per call and GB/s of the bytes each call must move (codes, scaler codes and factors read,
  the weight written). `equal` says whether each of ours is bit-identical to eager `dequantise_nf4`;
- one `tracetrain::nf4_linear` forward + backward (input gradient only, as QLoRA's frozen base) on
  `--tokens` rows, with the Triton kernel and with the compiled one, next to a bf16 `F.linear` of the
  same shape: what the 4-bit base costs per projection.

Each time: CUDA events, median of `--steps` calls after `--warmup`. The summary prices one training step's
dequantisations per model (2 per projection and step; 3 for the 70B case, whose blocks are recomputed).

    PYTHONPATH=. python3 benchmarks/nf4_dequant.py                # ~2 minutes on an H200
    PYTHONPATH=. python3 benchmarks/nf4_dequant.py --sweep        # also the Triton kernel's programs size

Writes nf4_dequant_<gpu>.json under benchmarks/results (and a copy under $OUT when set).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, median, time_steps, write_result

from tracetrain.kernels.nf4_triton import BLOCKS_PER_PROGRAM, dequantise_nf4_triton
from tracetrain.models.presets import get_preset
from tracetrain.models.qlora import (
    BLOCK_SIZE,
    NF4_BITS_PER_PARAM,
    NF4Linear,
    compiled_dequantise_nf4,
    dequantise_nf4,
    nf4_dequantise,
    nf4_linear,
)

# Dequantisations of each projection per training step: forward and backward; with every block recomputed
# (the 70B case of benchmarks/qlora.py), the recomputed forward too.
DEQUANTS_PER_STEP = {"llama3-8b": 2, "llama3-70b": 3}


def projection_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """(out, in) of each block projection of `preset`."""
    a = get_preset(preset)
    kv = a.n_kv_heads * a.head_dim
    return {"q": (a.q_dim, a.dim), "k": (kv, a.dim), "v": (kv, a.dim), "o": (a.dim, a.q_dim),
            "gate": (a.ffn_dim, a.dim), "up": (a.ffn_dim, a.dim), "down": (a.dim, a.ffn_dim)}  # fmt: skip


def bitsandbytes(peersite_dir: str):
    """bitsandbytes.functional, importable here or from the peers' packages (appended to the path, after
    ours); None when neither has it."""
    try:
        import bitsandbytes.functional as bnbf
    except ImportError:
        from qlora import peersite

        site = peersite(peersite_dir)
        if site is None:
            return None
        sys.path.append(site)
        try:
            import bitsandbytes.functional as bnbf
        except ImportError:
            return None
    return bnbf


def timed_us(fn: Callable[[], object], warmup: int, steps: int) -> float:
    return median(time_steps(fn, warmup, steps)) * 1e6


def dequant_row(shape: tuple[int, int], bnbf, warmup: int, steps: int, sweep: bool) -> dict:
    """Times and bit-equality of one projection's dequantisation, each implementation."""
    out_f, in_f = shape
    weight = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02
    q = NF4Linear(torch.nn.Linear(in_f, out_f, bias=False, device="meta"), torch.bfloat16)
    q.to_empty(device="cuda")
    q.quantise_(weight)
    args = q.quantised()
    numel = out_f * in_f
    moved = numel * NF4_BITS_PER_PARAM / 8 + numel * 2  # codes + scalers read, bf16 weight written
    ref = dequantise_nf4(*args, shape, torch.bfloat16)
    compiled = compiled_dequantise_nf4()
    row: dict = {"shape": list(shape), "bytes_per_call": moved}
    row["equal_compiled"] = torch.equal(compiled(*args, shape, torch.bfloat16), ref)
    row["equal_triton"] = torch.equal(dequantise_nf4_triton(*args, out_f, in_f, torch.bfloat16), ref)
    impls: dict[str, Callable[[], object]] = {
        "compiled": lambda: compiled(*args, shape, torch.bfloat16),
        "triton": lambda: dequantise_nf4_triton(*args, out_f, in_f, torch.bfloat16),
    }
    if sweep:
        for blocks in (16, 32, 128, 256):
            impls[f"triton_b{blocks}"] = lambda b=blocks: dequantise_nf4_triton(*args, out_f, in_f, torch.bfloat16, b)
    if bnbf is not None:
        packed, state = bnbf.quantize_4bit(weight, blocksize=BLOCK_SIZE, compress_statistics=True, quant_type="nf4")
        impls["bnb"] = lambda: bnbf.dequantize_4bit(packed, state)
        row["bnb_max_abs_diff_vs_ours"] = float((bnbf.dequantize_4bit(packed, state).float() - ref.float()).abs().max())
    for name, fn in impls.items():
        us = timed_us(fn, warmup, steps)
        row[f"{name}_us"], row[f"{name}_gbps"] = us, moved / us / 1e3
    return row


def linear_row(shape: tuple[int, int], tokens: int, warmup: int, steps: int) -> dict:
    """nf4_linear forward + input-gradient backward (Triton and compiled dequantisation) against bf16."""
    out_f, in_f = shape
    q = NF4Linear(torch.nn.Linear(in_f, out_f, bias=False, device="meta"), torch.bfloat16)
    q.to_empty(device="cuda")
    q.quantise_(torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 0.02)
    weight = q.weight
    x = torch.randn(tokens, in_f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, out_f, device="cuda", dtype=torch.bfloat16)

    def nf4_step() -> None:
        torch.autograd.grad(nf4_linear(x, *q.quantised(), out_f), x, grad)

    def bf16_step() -> None:
        torch.autograd.grad(F.linear(x, weight), x, grad)

    row = {"nf4_triton_ms": timed_us(nf4_step, warmup, steps) / 1e3}
    with nf4_dequantise.set_kernel_enabled("cuda", False):  # the default: the compiled kernel
        row["nf4_compiled_ms"] = timed_us(nf4_step, warmup, steps) / 1e3
    row["bf16_ms"] = timed_us(bf16_step, warmup, steps) / 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama3-8b,llama3-70b")
    ap.add_argument("--tokens", type=int, default=8192, help="rows of the nf4_linear input (batch x seq)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sweep", action="store_true", help="also time the Triton kernel at other program sizes")
    ap.add_argument("--peersite", default="/tmp/peersite")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("nf4_dequant.py needs a CUDA GPU")
    bnbf = bitsandbytes(a.peersite)
    env = environment()
    rows = []
    for preset in a.models.split(","):
        for name, shape in projection_shapes(preset).items():
            row = {"model": preset, "projection": name, **dequant_row(shape, bnbf, a.warmup, a.steps, a.sweep)}
            row.update(linear_row(shape, a.tokens, a.warmup, a.steps))
            rows.append(row)
            print(f"{preset} {name} {shape}: done", flush=True)
    payload = {**env, "tokens": a.tokens, "steps": a.steps, "blocks_per_program": BLOCKS_PER_PROGRAM,
               "bitsandbytes": getattr(sys.modules.get("bitsandbytes"), "__version__", None),
               "rows": rows, "per_step": per_step(rows)}  # fmt: skip
    report(payload)
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    device = env["device"].replace(" ", "-")
    print(f"wrote {write_result(f'nf4_dequant_{device}.json', payload, out)}")


def per_step(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Milliseconds of dequantisation per training step and model, each implementation, and the same for
    the whole nf4_linear forward + backward over bf16's (what the 4-bit base adds to a step)."""
    out: dict[str, dict[str, float]] = {}
    for preset in dict.fromkeys(r["model"] for r in rows):
        n_layers, calls = get_preset(preset).n_layers, DEQUANTS_PER_STEP.get(preset, 2)
        mine = [r for r in rows if r["model"] == preset]
        totals = {f"{k[:-3]}_ms": sum(r[k] for r in mine) * n_layers * calls / 1e3
                  for k in mine[0] if k.endswith("_us")}  # fmt: skip
        for impl in ("triton", "compiled"):
            totals[f"nf4_{impl}_over_bf16_ms"] = n_layers * sum(r[f"nf4_{impl}_ms"] - r["bf16_ms"] for r in mine)
        out[preset] = totals
    return out


def report(payload: dict) -> None:
    rows = payload["rows"]
    impls = [k[:-3] for k in rows[0] if k.endswith("_us")]
    width = {i: max(12, len(i) + 4) for i in impls}
    head = "".join(f"{i + ' us':>{width[i]}}{'GB/s':>7}" for i in impls)
    print(
        f"\n{'model':<11}{'proj':<5}{'shape':>13}{head}{'eq c/t':>8}  fwd+bwd ms: {'triton':>8}{'compiled':>9}{'bf16':>8}"
    )
    for r in rows:
        cells = "".join(f"{r[i + '_us']:>{width[i]}.1f}{r[i + '_gbps']:>7.0f}" for i in impls)
        eq = f"{'y' if r['equal_compiled'] else 'N'}/{'y' if r['equal_triton'] else 'N'}"
        shape = "x".join(map(str, r["shape"]))
        print(f"{r['model']:<11}{r['projection']:<5}{shape:>13}{cells}{eq:>8}"
              f"{'':14}{r['nf4_triton_ms']:>8.3f}{r['nf4_compiled_ms']:>9.3f}{r['bf16_ms']:>8.3f}")  # fmt: skip
    print("\nper training step (all projections x layers x dequantisations per step), ms:")
    for preset, totals in payload["per_step"].items():
        print(f"  {preset}: " + ", ".join(f"{k} {v:.1f}" for k, v in totals.items()))
    bad = [f"{r['model']} {r['projection']}" for r in rows if not r["equal_triton"]]
    print("Triton kernel bit-identical to dequantise_nf4: " + ("yes, every shape" if not bad else f"NO: {bad}"))


if __name__ == "__main__":
    main()
