"""train/optim.py `AdamW` (its step is the Triton kernel of kernels/adamw_triton.py) against torch's fused
AdamW: the same parameters and moments over several steps with weight decay groups, a gradient divisor
(the clip factor) and a skipped step (found_inf), and checkpoints that load into either. The kernel itself
runs on a GPU, and on the CPU under the Triton interpreter (TRITON_INTERPRET=1, in a child process: Triton
reads it when a kernel is first compiled) wherever Triton is installed. Without Triton the class is
torch's fused AdamW, which a CPU test checks too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tracetrain.kernels import triton_available
from tracetrain.train.optim import AdamW

SHAPES = [(64, 96), (2048 + 3,), (17,), (300, 7)]  # sizes that are not multiples of the kernel's block
needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton")


def _params(device: str) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in SHAPES]


def _optimizer(cls: type, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]
    return cls(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)


def _run(cls: type, device: str, steps: int = 6) -> tuple[list[torch.Tensor], torch.optim.Optimizer, list[bool]]:
    params = _params(device)
    opt = _optimizer(cls, params)
    g = torch.Generator().manual_seed(1)
    updated = []
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device) * (10.0 if step == 2 else 1.0)
        opt.grad_scale = torch.tensor(2.5 if step in (2, 4) else 1.0, device=device)  # the clip divisor
        opt.found_inf = torch.tensor(1.0 if step == 3 else 0.0, device=device)  # step 3 is skipped
        before = params[0].detach().clone()
        opt.step()
        updated.append(not torch.equal(before, params[0]))
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in params], opt, updated


def _state(opt: torch.optim.Optimizer) -> list[tuple[float, torch.Tensor, torch.Tensor]]:
    return [(float(s["step"]), s["exp_avg"], s["exp_avg_sq"]) for s in opt.state.values()]


def test_on_the_cpu_it_is_torchs_fused_adamw():
    (ours, _, updated), (ref, _, _) = _run(AdamW, "cpu"), _run(torch.optim.AdamW, "cpu")
    assert updated == [True, True, True, False, True, True]
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


def _kernel_follows_torch(device: str) -> None:
    """The kernel's steps against torch's fused AdamW on `device` (raises AssertionError if not)."""
    params = _params(device)
    probe = _optimizer(AdamW, params)
    for p in params:
        p.grad = torch.ones_like(p)
    assert probe._triton_applies() is True, "the update would not run in the Triton kernel here"
    (ours, ours_opt, updated), (ref, ref_opt, _) = _run(AdamW, device), _run(torch.optim.AdamW, device)
    assert updated == [True, True, True, False, True, True]  # found_inf skips the update on the device
    for a, b, start in zip(ours, ref, _params(device)):
        assert float((a - start).abs().max().detach()) > 1e-3  # five updates moved every parameter
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)
    for (s1, m1, v1), (s2, m2, v2) in zip(_state(ours_opt), _state(ref_opt)):
        assert s1 == s2 == 5.0  # the skipped step is not counted
        # ulp-level differences (FMA contraction, float32 bias corrections) near zero crossings of exp_avg
        torch.testing.assert_close(m1, m2, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-9)
    # The kernel leaves the gradient undivided (torch's fused kernel would leave grad / grad_scale).
    probe.grad_scale = torch.tensor(4.0, device=device)
    probe.found_inf = torch.tensor(0.0, device=device)
    probe.step()
    assert all(bool((p.grad == 1).all()) for p in params)


@pytest.mark.skipif(not triton_available(), reason="needs Triton (it comes with CUDA builds of torch)")
def test_the_kernel_under_the_triton_interpreter_follows_torchs_fused_adamw():
    tests = str(Path(__file__).resolve().parent)
    code = f"import sys; sys.path.insert(0, {tests!r}); import test_adamw_triton as t; t._kernel_follows_torch('cpu')"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_without_the_interpreter_cpu_parameters_take_torchs_step():
    params = _params("cpu")
    opt = _optimizer(AdamW, params)
    for p in params:
        p.grad = torch.ones_like(p)
    assert os.environ.get("TRITON_INTERPRET", "0") == "0" and opt._triton_applies() is False


@needs_gpu
def test_triton_step_follows_torchs_fused_adamw():
    _kernel_follows_torch("cuda")


@needs_gpu
def test_the_update_runs_in_the_triton_kernel_and_leaves_the_gradient_undivided():
    params = _params("cuda")
    opt = _optimizer(AdamW, params)
    assert opt._triton_applies() is True
    for p in params:
        p.grad = torch.ones_like(p)
    opt.grad_scale = torch.tensor(4.0, device="cuda")
    opt.found_inf = torch.tensor(0.0, device="cuda")
    opt.step()
    assert all(bool((p.grad == 1).all()) for p in params)  # torch's kernel would leave 0.25 here


@needs_gpu
def test_checkpoints_move_between_it_and_torchs_adamw():
    _, ours_opt, _ = _run(AdamW, "cuda", steps=3)
    params = _params("cuda")
    torch_opt = _optimizer(torch.optim.AdamW, params)
    torch_opt.load_state_dict(ours_opt.state_dict())
    back = _optimizer(AdamW, _params("cuda"))
    back.load_state_dict(torch_opt.state_dict())
    for (s1, m1, v1), (s2, m2, v2) in zip(_state(ours_opt), _state(back)):
        assert s1 == s2 and torch.equal(m1, m2) and torch.equal(v1, v2)
