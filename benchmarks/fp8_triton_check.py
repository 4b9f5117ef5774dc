"""The Triton kernels of the fused FP8 MLP (kernels/fp8_triton.py) against their PyTorch twins
(kernels/fp8_mlp.py), byte for byte, and their times; then the whole fused MLP against three
`Float8FrozenLinear`s and bf16. GPU with Triton only. Expected: 0 differing fp8 bytes (a few at most,
from values within an ulp of a rounding tie), max |deq diff| 0 and equal scales.

    python3 benchmarks/fp8_triton_check.py [--tokens 8192 --dim 4096 --ffn 11008] [--no-benchmark]
"""

from __future__ import annotations

import argparse
import copy

import torch
import triton

from tracetrain.kernels.fp8 import E4M3, E5M2, to_float8_frozen
from tracetrain.kernels.fp8_mlp import swiglu_bwd_quant_reference, swiglu_quant_reference, to_float8_frozen_mlp
from tracetrain.kernels.fp8_triton import swiglu_bwd_quant, swiglu_quant
from tracetrain.models.llama import FeedForward, ModelArgs


def _compare(name: str, got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> str:
    """Byte equality of the fp8 values, max |difference| of the dequantised values, scale equality (NaN = NaN)."""
    (q, inv), (q_ref, inv_ref) = got, want
    assert q.shape == q_ref.shape and q.dtype == q_ref.dtype and inv.shape == inv_ref.shape, name
    deq, deq_ref = q.float() * inv, q_ref.float() * inv_ref
    both_nan = deq.isnan() & deq_ref.isnan()
    num_diff = int(((q.view(torch.uint8) != q_ref.view(torch.uint8)) & ~both_nan).sum())
    max_diff = float((deq - deq_ref).abs().masked_fill(both_nan, 0.0).nan_to_num(float("inf")).max())
    scales_equal = torch.equal(inv.isnan(), inv_ref.isnan()) and torch.equal(inv.nan_to_num(), inv_ref.nan_to_num())
    return (
        f"{name}: fp8 bytes differing {num_diff} of {q.numel()}, max |deq diff| {max_diff:.3g}, "
        f"scales equal {scales_equal}"
    )


def _check_mlp(device: str | torch.device, tokens: int, dim: int, ffn: int, recipe: str, benchmark: bool) -> str:
    """The fused MLP against the same MLP as three Float8FrozenLinears and against bf16, forward + backward."""
    torch.manual_seed(0)
    base = FeedForward(ModelArgs(dim=dim, ffn_dim=ffn)).to(device, torch.bfloat16).requires_grad_(False)
    unfused = copy.deepcopy(base)
    for linear in (unfused.gate_proj, unfused.up_proj, unfused.down_proj):
        to_float8_frozen(linear, recipe)  # type: ignore[arg-type]  # recipe is 'rowwise' or 'tensorwise' (the loop in the caller), inferred as str
    fused = to_float8_frozen_mlp(copy.deepcopy(base), recipe)  # type: ignore[arg-type]  # recipe is 'rowwise' or 'tensorwise' (the loop in the caller), inferred as str
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)

    def step(mlp: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        x.grad = None
        y = mlp(x)
        y.backward(dy)
        return y.detach().float(), x.grad.float()  # type: ignore[attr-defined]  # backward ran just above: x.grad exists

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    (y_ref, dx_ref), (y_unf, dx_unf), (y, dx) = step(base), step(unfused), step(fused)
    line = (
        f"mlp {recipe} {tokens}x{dim}x{ffn}: rel err vs bf16, fused y {rel(y, y_ref):.4f} "
        f"dx {rel(dx, dx_ref):.4f}, unfused y {rel(y_unf, y_ref):.4f} dx {rel(dx_unf, dx_ref):.4f}"
    )
    if benchmark:
        variants = (fused, torch.compile(fused, fullgraph=True), unfused, torch.compile(unfused, fullgraph=True))
        times = [triton.testing.do_bench(lambda m=m: step(m)) * 1e3 for m in variants]
        line += ", fwd+bwd us: fused eager {:.0f} compiled {:.0f}, unfused eager {:.0f} compiled {:.0f}".format(*times)
    return line


def check_against_reference(
    device: str | torch.device = "cuda", tokens: int = 8192, dim: int = 4096, ffn: int = 11008, benchmark: bool = True
) -> None:
    """Compare the Triton kernels with their PyTorch twins on `device` (llama2-7b MLP by default); print
    one line per check: bytes, dequantised values and scales, then the time of Triton, eager PyTorch and
    the twin under torch.compile (Inductor's generated kernels, as a compiled block would run it). Last,
    one line per recipe for the whole MLP, fused vs three Float8FrozenLinears: errors against bf16 and
    forward + backward times, eager and compiled.

    An inf in gate row 5 and a NaN in dh row 9 check that only those rows get a NaN scale (rowwise: rows
    [5] forward, [5, 9] backward). Expected: 0 differing bytes (a few at most, from values within an ulp
    of a rounding tie), max |deq diff| 0 and equal scales.
    """
    gen = torch.Generator(device).manual_seed(0)
    gu = (torch.randn(tokens, 2 * ffn, device=device, generator=gen) * 2).to(torch.bfloat16)
    dh = (torch.randn(tokens, ffn, device=device, generator=gen) * 1e-3).to(torch.bfloat16)
    gu[5, 17], dh[9, 3] = float("inf"), float("nan")
    cases = [
        ("swiglu_quant", swiglu_quant, swiglu_quant_reference, (gu,)),
        ("swiglu_bwd_quant", swiglu_bwd_quant, swiglu_bwd_quant_reference, (dh, gu)),
    ]
    for recipe in ("rowwise", "tensorwise"):
        rowwise = recipe == "rowwise"
        for name, kernel, reference, args in cases:
            dtype = E4M3 if rowwise or name == "swiglu_quant" else E5M2  # as _Float8FeedForward uses them
            if not rowwise:  # one non-finite value would make the whole tensor NaN: check finite data
                args = tuple(a.nan_to_num(posinf=0.0) for a in args)
            got = kernel(*args, dtype, rowwise)  # type: ignore[operator]  # Triton / torch.compile objects are untyped
            label = f"{name} {recipe} {'x'.join(map(str, got[0].shape))} {str(dtype).removeprefix('torch.')}"
            line = _compare(label, got, reference(*args, dtype, rowwise))  # type: ignore[operator]  # Triton / torch.compile objects are untyped
            if rowwise:
                line += f", NaN-scale rows {got[1].isnan().flatten().nonzero().flatten().tolist()}"
            if benchmark:
                compiled = torch.compile(reference, fullgraph=True, dynamic=False)  # type: ignore[call-overload]  # Triton / torch.compile objects are untyped
                times = [
                    triton.testing.do_bench(lambda f=f, a=args, d=dtype, r=rowwise: f(*a, d, r)) * 1e3
                    for f in (kernel, reference, compiled)
                ]
                line += ", us: triton {:.0f}, eager {:.0f}, inductor {:.0f}".format(*times)
            print(line, flush=True)
    for recipe in ("rowwise", "tensorwise"):
        print(_check_mlp(device, tokens, dim, ffn, recipe, benchmark), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--no-benchmark", action="store_true", help="compare only, no timing")
    a = ap.parse_args()
    check_against_reference("cuda", a.tokens, a.dim, a.ffn, benchmark=not a.no_benchmark)


if __name__ == "__main__":
    main()
