"""The fused FP8 MLP (kernels/fp8_mlp.py): its two row ops (PyTorch twins) against float64, the whole MLP
against the same MLP of three `Float8FrozenLinear`s and against float32, the `apply_fp8` swap on a tiny
LoRA model, re-quantisation after a weight change, and a compiled block. The GEMM tests need float8
`torch._scaled_mm` on the CPU (as test_fp8.py's). The Triton twins of the row ops are checked on a GPU by
benchmarks/fp8_triton_check.py (Triton is not installed on the test machines)."""

from __future__ import annotations

import copy
import dataclasses
import shutil

import pytest
import torch
import torch.nn.functional as F
from helpers_fp8 import ARGS, BWD_TOL, FP8_FLOOR, FWD_TOL, _lora_model, _tokens, needs_scaled_mm, rel
from torch import nn
from torch.library import opcheck

from tracetrain.kernels.apply import apply_compile
from tracetrain.kernels.fp8 import E4M3, E5M2, RECIPES, Float8FrozenLinear, to_float8_frozen
from tracetrain.kernels.fp8_apply import apply_fp8
from tracetrain.kernels.fp8_mlp import (
    Float8FrozenFeedForward,
    fp8_mlp_eligible,
    swiglu_bwd_quant,
    swiglu_quant,
    to_float8_frozen_mlp,
)
from tracetrain.models.llama import FeedForward, ModelArgs, Transformer
from tracetrain.models.lora import apply_lora

MLP_ARGS = ModelArgs(dim=64, ffn_dim=160)  # both multiples of 16
ROWS, FFN = 16, 80
# Per-element FP8 rounding: half a step of the mantissa (E4M3: 3 bits, E5M2: 2) of the value, or half the
# subnormal step (E4M3 2^-9, E5M2 2^-16) below the normal range, in units of the scaled value.
HALF_STEP = {E4M3: (2.0 ** -4, 2.0 ** -10), E5M2: (2.0 ** -3, 2.0 ** -17)}
# The MLP chains two FP8 GEMMs each way, so its error vs float32 is above one linear's FWD_TOL / BWD_TOL
# (measured: 6.1-6.5% forward both recipes, 6.3% backward rowwise, 9.1-9.6% backward tensorwise (E5M2),
# for the fused and the three-linear MLP alike).
MLP_FWD_TOL, MLP_BWD_TOL = {"tensorwise": 0.09, "rowwise": 0.09}, {"tensorwise": 0.13, "rowwise": 0.09}


def _gu(seed: int = 0) -> torch.Tensor:
    """[gate | up] (ROWS, 2 FFN), rows spanning four decades; in half of the rows up is 1000x smaller."""
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(ROWS, 2 * FFN, generator=g) * torch.logspace(-2, 2, ROWS).unsqueeze(1)
    gu[::2, FFN:] *= 1e-3
    return gu


def _dh(seed: int = 1) -> torch.Tensor:
    return torch.randn(ROWS, FFN, generator=torch.Generator().manual_seed(seed))


def _check_quantised(q: torch.Tensor, inv: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, rowwise: bool) -> None:
    """q * inv is `ref` (float64) rounded to `dtype` under the scale `quantize` picks from ref's amax."""
    fp8_max = torch.finfo(dtype).max
    assert q.dtype == dtype and q.shape == ref.shape and inv.dtype == torch.float32
    amax = ref.abs().amax(dim=-1, keepdim=True) if rowwise else ref.abs().amax()
    scale = (1 / inv).double()
    if rowwise:  # one power-of-two scale per row: amax lands in (fp8_max / 2, fp8_max]
        assert inv.shape == (ref.shape[0], 1)
        assert torch.equal(scale, torch.exp2(torch.floor(torch.log2(fp8_max / amax))))
        assert bool((amax * scale <= fp8_max).all()) and bool((amax * scale > fp8_max / 2).all())
    else:
        assert inv.shape == () and float(scale) == pytest.approx(fp8_max / float(amax), rel=1e-6)
        assert float(q.float().abs().max()) == fp8_max
    rel_step, subnormal_step = HALF_STEP[dtype]
    err = (q.double() * inv.double() - ref).abs()
    bound = rel_step * ref.abs() * (1 + 1e-5) + subnormal_step / scale
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max()):.3g}"


# ---------------------------------------------------------------------------------------- row ops

@pytest.mark.parametrize("recipe", RECIPES)
def test_swiglu_quant_is_silu_gate_times_up_rounded_to_fp8(recipe):
    gu = _gu()
    gate, up = gu.double().chunk(2, dim=-1)
    q, inv = swiglu_quant(gu, E4M3, recipe == "rowwise")
    _check_quantised(q, inv, F.silu(gate) * up, E4M3, recipe == "rowwise")


@pytest.mark.parametrize("recipe", RECIPES)
def test_swiglu_bwd_quant_is_the_float64_gradient_with_one_scale_per_row(recipe):
    gu, dh = _gu(), _dh()
    gate, up = gu.double().chunk(2, dim=-1)
    gate.requires_grad_(), up.requires_grad_()
    dgate, dup = torch.autograd.grad(F.silu(gate) * up, (gate, up), dh.double())
    dtype = E4M3 if recipe == "rowwise" else E5M2  # as the MLP's backward uses them
    q, inv = swiglu_bwd_quant(dh, gu, dtype, recipe == "rowwise")
    # The scale comes from the amax of [dgate | dup] together: in the rows where up is small, dgate is
    # small too and its own amax would give a larger scale.
    _check_quantised(q, inv, torch.cat([dgate, dup], dim=-1), dtype, recipe == "rowwise")


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("backward", [False, True], ids=["swiglu_quant", "swiglu_bwd_quant"])
def test_non_finite_value_gives_a_nan_scale_to_its_row_only(bad, backward):
    gu, dh = _gu(), _dh()

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        return swiglu_bwd_quant(dh, gu, E4M3, True) if backward else swiglu_quant(gu, E4M3, True)

    clean_q, clean_inv = run()
    if backward:
        dh[3, 7] = bad
    else:
        gu[3, 7] = bad  # in gate
    q, inv = run()
    assert inv.isnan().flatten().tolist() == [row == 3 for row in range(ROWS)]
    assert not torch.isfinite(q[3].float()).any()
    keep = torch.arange(ROWS) != 3
    assert torch.equal(q[keep].view(torch.uint8), clean_q[keep].view(torch.uint8))
    assert torch.equal(inv[keep], clean_inv[keep])


@pytest.mark.parametrize("op,args", [(swiglu_quant, lambda: (_gu(), E4M3, True)),
                                     (swiglu_quant, lambda: (_gu(), E4M3, False)),
                                     (swiglu_bwd_quant, lambda: (_dh(), _gu(), E4M3, True)),
                                     (swiglu_bwd_quant, lambda: (_dh(), _gu(), E5M2, False))],
                         ids=["fwd_rowwise", "fwd_tensorwise", "bwd_rowwise", "bwd_tensorwise"])
def test_custom_op_registration(op, args):
    opcheck(op, args())  # schema, fake kernel (shapes, dtypes), tracing by AOT autograd


# ------------------------------------------------------------------------------------------- the MLP

def _mlps(recipe: str) -> tuple[FeedForward, FeedForward, Float8FrozenFeedForward]:
    """(float32 reference, the same MLP as three Float8FrozenLinears, the fused MLP)."""
    torch.manual_seed(0)
    ref = FeedForward(MLP_ARGS).requires_grad_(False)
    unfused = copy.deepcopy(ref)
    for linear in (unfused.gate_proj, unfused.up_proj, unfused.down_proj):
        to_float8_frozen(linear, recipe)  # type: ignore[arg-type]
    return ref, unfused, to_float8_frozen_mlp(copy.deepcopy(ref), recipe)  # type: ignore[arg-type]


def _run(mlp: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    y = mlp(x)
    y.backward(g)
    return y.detach(), x.grad


@needs_scaled_mm
@pytest.mark.parametrize("recipe", RECIPES)
def test_fused_mlp_matches_the_unfused_fp8_mlp_and_float32(recipe):
    ref, unfused, fused = _mlps(recipe)
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(2))
    g = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(3))
    (y_ref, dx_ref), (y_unf, dx_unf), (y, dx) = (_run(m, x, g) for m in (ref, unfused, fused))
    assert y.shape == y_ref.shape and y.dtype == torch.float32
    assert FP8_FLOOR < rel(y, y_ref) < MLP_FWD_TOL[recipe] and FP8_FLOOR < rel(dx, dx_ref) < MLP_BWD_TOL[recipe]
    # No less accurate than the three-linear path (the shared scales could have cost precision) ...
    assert rel(y, y_ref) < 1.05 * rel(y_unf, y_ref) and rel(dx, dx_ref) < 1.05 * rel(dx_unf, dx_ref)
    # ... and close to it: rowwise, the forward is the same computation (the fused weight has the same
    # per-output-channel scales); the backward differs by its shared scales (W13^T, dgate|dup).
    assert rel(y, y_unf) < (1e-3 if recipe == "rowwise" else FWD_TOL[recipe])
    assert rel(dx, dx_unf) < BWD_TOL[recipe]
    assert all(p.grad is None for p in fused.parameters())  # frozen: no weight-gradient GEMM
    with torch.autocast("cpu", torch.bfloat16):
        yb = fused(x)
    assert yb.dtype == torch.bfloat16 and rel(yb, y_ref) < MLP_FWD_TOL[recipe]


@needs_scaled_mm
def test_fused_mlp_saves_only_gate_up_for_backward():
    _, _, fused = _mlps("rowwise")
    buffers = {b.data_ptr() for b in fused.buffers()}
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in buffers:
            saved.append((tuple(t.shape), t.dtype))
        return t

    x = torch.randn(2, 12, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fused(x)
    assert saved == [((24, 2 * MLP_ARGS.ffn_dim), torch.float32)]  # gu: no x, no h
    y.sum().backward()
    assert x.grad is not None


@needs_scaled_mm
def test_weight_change_requantises_all_three_weights_in_place():
    ref, _, fused = _mlps("rowwise")
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    buffers = dict(fused.named_buffers())
    assert not fused.refresh_if_stale()
    state = {k: v * (-3.0 if k.startswith("down") else 1.0) for k, v in ref.state_dict().items()}
    state["gate_proj.weight"] = state["gate_proj.weight"].flip(0)  # gate changes too: W13 must follow
    fused.load_state_dict(state)  # e.g. a checkpoint loaded into the bf16 weights
    ref.load_state_dict(state)
    assert rel(fused(x), ref(x)) < MLP_FWD_TOL["rowwise"]
    assert all(b is buffers[n] for n, b in fused.named_buffers())  # in place: compiled graphs keep them
    assert not fused.refresh_if_stale()


def test_eligibility():
    mlp = FeedForward(MLP_ARGS).requires_grad_(False)
    assert fp8_mlp_eligible(mlp)
    assert not fp8_mlp_eligible(FeedForward(ModelArgs(dim=64, ffn_dim=72)).requires_grad_(False))  # ffn % 16
    assert not fp8_mlp_eligible(FeedForward(MLP_ARGS))  # trained weights
    assert not fp8_mlp_eligible(nn.Linear(64, 64))


# ---------------------------------------------------------------------------------------- transform

def _loss_and_adapter_grads(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    loss = model(_tokens()).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


@needs_scaled_mm
@pytest.mark.parametrize("recipe", RECIPES)
def test_apply_fp8_fuses_the_unadapted_mlps_and_keeps_the_state_dict(recipe):
    ref, unfused, fused = _lora_model(), _lora_model(), _lora_model()
    keys = list(fused.state_dict())
    assert apply_fp8(unfused, recipe, fused_mlp=False) == apply_fp8(fused, recipe, fused_mlp=True) == 7 * ARGS.n_layers
    assert list(fused.state_dict()) == keys  # the FP8 copies are non-persistent buffers
    assert all(type(b.mlp) is Float8FrozenFeedForward and type(b.mlp.down_proj) is nn.Linear for b in fused.layers)
    assert sum(isinstance(m, Float8FrozenLinear) for m in fused.modules()) == 4 * ARGS.n_layers
    assert not any(isinstance(m, Float8FrozenFeedForward) for m in unfused.modules())
    assert sum(isinstance(m, Float8FrozenLinear) for m in unfused.modules()) == 7 * ARGS.n_layers
    (loss_ref, g_ref), (loss_unf, g_unf), (loss, g) = (_loss_and_adapter_grads(m) for m in (ref, unfused, fused))
    assert abs(loss.item() - loss_ref.item()) < 0.02 * abs(loss_ref.item())
    assert abs(loss.item() - loss_unf.item()) < 0.01 * abs(loss_unf.item())
    assert rel(g, g_ref) < BWD_TOL[recipe] and rel(g, g_unf) < BWD_TOL[recipe]


@needs_scaled_mm
def test_an_adapted_mlp_projection_keeps_the_per_linear_path():
    torch.manual_seed(0)
    model = Transformer(ARGS)
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=["q_proj", "gate_proj"])
    assert apply_fp8(model, "rowwise", fused_mlp=True) == 7 * ARGS.n_layers
    mlp = model.layers[0].mlp
    assert type(mlp) is FeedForward and type(mlp.up_proj) is Float8FrozenLinear
    assert type(mlp.gate_proj.base) is Float8FrozenLinear


@needs_scaled_mm
def test_model_forward_requantises_after_a_checkpoint_load():
    model = _lora_model()
    apply_fp8(model, "rowwise", fused_mlp=True)
    mlp = model.layers[1].mlp
    state = model.state_dict()
    state["layers.1.mlp.up_proj.weight"] = -state["layers.1.mlp.up_proj.weight"]
    model.load_state_dict(state)
    source = mlp._fp8_source
    model(_tokens())
    assert mlp._fp8_source != source and not mlp.refresh_if_stale()


@needs_scaled_mm
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                    reason="torch.compile's CPU backend needs a C++ compiler")
def test_compiled_block_runs_the_fused_mlp_and_its_pre_hook_requantises():
    one_layer = dataclasses.replace(ARGS, n_layers=1)  # one block graph to compile, not two
    eager, compiled = _lora_model(one_layer), _lora_model(one_layer)
    for model in (eager, compiled):
        apply_fp8(model, "rowwise", fused_mlp=True)
    apply_compile(compiled)  # fullgraph=True: a graph break raises
    for step in range(2):
        (loss_eager, g_eager), (loss, g) = (_loss_and_adapter_grads(m) for m in (eager, compiled))
        assert abs(loss.item() - loss_eager.item()) < 1e-3 * abs(loss_eager.item()), step
        assert rel(g, g_eager) < 2e-2, step
        # Inside the compiled graph the MLP skips its own staleness check: only the block's pre-hook
        # (eager) can see that the weights changed.
        state = eager.state_dict()
        state["layers.0.mlp.down_proj.weight"] = -3 * state["layers.0.mlp.down_proj.weight"]
        for model in (eager, compiled):
            model.zero_grad()
            model.load_state_dict(state)
