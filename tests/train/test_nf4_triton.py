"""The Triton NF4 dequantisation (kernels/nf4_triton.py) against `dequantise_nf4`, bit for bit.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, in a child process: the variable is
read when the kernel is defined). The interpreter rounds float32 to bfloat16 by truncation, not as a GPU
does, so here the float32 values (what the kernel computes before its one rounding) and the float16
output are compared; the bfloat16 output is compared on a GPU (below, and benchmarks/nf4_dequant.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO

from tracetrain.models.qlora import NF4Linear, dequantise_nf4

NO_TRITON = "triton is not installed (pip install triton: the kernel then runs in Triton's CPU interpreter)"
# Shapes: whole programs, a partial last program, a last scaler run shorter than 256 blocks.
SHAPES = [(128, 256), (64, 320), (96, 448), (256, 4160)]

CHILD = """
import json, sys, torch
from tracetrain.models.qlora import NF4Linear, dequantise_nf4
from tracetrain.kernels.nf4_triton import dequantise_nf4_triton
out = []
for o, i in json.loads(sys.argv[1]):
    torch.manual_seed(o + i)
    q = NF4Linear(torch.nn.Linear(i, o, bias=False), torch.bfloat16)
    q.codes[:8] = 0x0F  # the extreme levels, both nibble orders
    q.codes[8:16] = 0xF0
    for dtype in (torch.float32, torch.float16):
        ref = dequantise_nf4(*q.quantised(), q.shape, dtype)
        got = dequantise_nf4_triton(*q.quantised(), o, i, dtype, blocks_per_program=16)
        out.append([o, i, str(dtype), got.shape == ref.shape and torch.equal(got, ref)])
print(json.dumps(out))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason=NO_TRITON)
def test_triton_dequantisation_equals_the_reference_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(SHAPES)], capture_output=True, text=True, env=env, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 2 * len(SHAPES)
    assert all(equal for *_, equal in rows), [r for r in rows if not r[-1]]


@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="needs a CUDA GPU and triton (the registered kernel is CUDA's)",
)
@pytest.mark.parametrize("shape", SHAPES)
def test_registered_cuda_kernel_is_bit_identical_and_drives_nf4_linear(shape: tuple[int, int]) -> None:
    import tracetrain.kernels.nf4_triton  # noqa: F401  # registers the CUDA kernel
    from tracetrain.models.qlora import nf4_dequantise, nf4_linear

    torch.manual_seed(0)
    q = NF4Linear(torch.nn.Linear(shape[1], shape[0], bias=False), torch.bfloat16).cuda()
    ref = dequantise_nf4(*q.quantised(), q.shape, torch.bfloat16)
    assert torch.equal(nf4_dequantise(*q.quantised(), *q.shape, torch.bfloat16), ref)
    x = torch.randn(3, shape[1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = nf4_linear(x, *q.quantised(), shape[0])
    (grad,) = torch.autograd.grad(y.float().square().sum(), x)
    x_ref = x.detach().requires_grad_(True)
    y_ref = torch.nn.functional.linear(x_ref, ref)
    (grad_ref,) = torch.autograd.grad(y_ref.float().square().sum(), x_ref)
    assert torch.equal(y, y_ref) and torch.equal(grad, grad_ref)
