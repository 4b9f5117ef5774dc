"""train/optim.py `AdamW` (its CUDA step is kernels/adamw_triton.py) against torch's fused AdamW on a GPU:
the same parameters and moments over several steps with weight decay groups, a gradient divisor (the
clip factor) and a skipped step (found_inf), and checkpoints that load into either. On the CPU (and
without Triton) the class is torch's fused AdamW; a CPU test also runs its own step with the kernel's
math written in torch ops, so the code around the kernel is checked on every torch the tests run on."""

from __future__ import annotations

import math
import sys
import types

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


def _update_in_torch(p, g, m, v, step, *, lr, beta1, beta2, weight_decay, eps, grad_scale, found_inf):
    """kernels/adamw_triton.py's math in torch ops (the kernel needs Triton and CUDA)."""
    if found_inf is not None and float(found_inf) != 0:
        return
    g = g / grad_scale if grad_scale is not None else g
    bias_correction1, bias_correction2 = 1 - beta1 ** float(step), 1 - beta2 ** float(step)
    p.sub_(lr * weight_decay * p)
    m.mul_(beta1).add_((1 - beta1) * g)
    v.mul_(beta2).add_((1 - beta2) * g * g)
    p.sub_((lr / bias_correction1) * m / (v.sqrt() / math.sqrt(bias_correction2) + eps))


def test_the_step_around_the_kernel_counts_steps_and_skips_like_torch(monkeypatch):
    """On the CPU, with the kernel's math in torch ops: state creation, step counting, the skipped step and
    the divisor are handled as torch's fused AdamW handles them (runs on the torch the tests run on)."""
    monkeypatch.setitem(sys.modules, "tracetrain.kernels.adamw_triton", types.SimpleNamespace(adamw_update=_update_in_torch))
    monkeypatch.setattr(AdamW, "_triton_applies", lambda self: True)
    (ours, ours_opt, updated), (ref, ref_opt, _) = _run(AdamW, "cpu"), _run(torch.optim.AdamW, "cpu")
    assert updated == [True, True, True, False, True, True]
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)
    for (s1, m1, v1), (s2, m2, v2) in zip(_state(ours_opt), _state(ref_opt)):
        assert s1 == s2 == 5.0
        torch.testing.assert_close(m1, m2, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-9)


@needs_gpu
def test_triton_step_follows_torchs_fused_adamw():
    (ours, ours_opt, updated), (ref, ref_opt, _) = _run(AdamW, "cuda"), _run(torch.optim.AdamW, "cuda")
    assert updated == [True, True, True, False, True, True]  # found_inf skips the update on the device
    for a, b, start in zip(ours, ref, _params("cuda")):
        assert float((a - start).abs().max().detach()) > 1e-3  # five updates moved every parameter
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)
    for (s1, m1, v1), (s2, m2, v2) in zip(_state(ours_opt), _state(ref_opt)):
        assert s1 == s2 == 5.0  # the skipped step is not counted
        # ulp-level differences (FMA contraction, float32 bias corrections) near zero crossings of exp_avg
        torch.testing.assert_close(m1, m2, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-9)


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
