"""FP8 (train.fp8): quantisation math, the frozen-weight FP8 matmul against a float32 reference, the
transform on a tiny LoRA model, and clear refusals. On CPU, `torch._scaled_mm` runs float8 through
oneDNN (torch >= 2.7); where it does not, the GEMM tests skip and say so. The torchao (full fine-tune)
tests skip when torchao is not installed (it is an optional extra, not in `dev`)."""

from __future__ import annotations

import re
import sys
import warnings

import pytest
import torch
from helpers_fp8 import ARGS, BWD_TOL, FP8_FLOOR, FWD_TOL, _lora_model, _tokens, needs_scaled_mm, rel
from torch import nn

from tracetrain.config import load_config
from tracetrain.errors import ConfigError
from tracetrain.kernels.fp8 import (
    E4M3,
    E5M2,
    RECIPES,
    Float8FrozenLinear,
    amax_to_scale,
    check_fp8_device,
    probe_amax,
    quantize,
    quantize_weight,
    to_float8_frozen,
)
from tracetrain.kernels.fp8_apply import apply_fp8
from tracetrain.models.llama import ModelArgs, Transformer
from tracetrain.train.assemble import build_model

try:
    import torchao.float8  # noqa: F401
    HAVE_TORCHAO = True
except ImportError:
    HAVE_TORCHAO = False


# ------------------------------------------------------------------------------------- quantisation

def test_tensorwise_scale_maps_amax_to_fp8_max_and_round_trips_within_half_an_ulp():
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)) * 3
    for dtype, mantissa_bits in ((E4M3, 3), (E5M2, 2)):
        q, inv = quantize(x, dtype)
        fp8_max = torch.finfo(dtype).max
        assert inv.shape == () and float(1 / inv) == pytest.approx(fp8_max / float(x.abs().max()), rel=1e-6)
        assert float(q.float().abs().max()) == fp8_max  # the amax element lands exactly on the top
        scaled = x * (1 / inv)
        normal = scaled.abs() >= torch.finfo(dtype).smallest_normal
        err = (q.float() - scaled).abs()
        assert bool((err[normal] <= 2.0 ** -(mantissa_bits + 1) * scaled.abs()[normal] * (1 + 1e-6)).all())
        assert rel(q.float() * inv, x) < 2.0 ** -(mantissa_bits + 1)


def test_rowwise_scales_are_per_row_powers_of_two_that_never_saturate():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 32).unsqueeze(1)
    q, inv = quantize(x, E4M3, rowwise=True)
    scale = 1 / inv
    assert inv.shape == (32, 1)
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of two
    top = x.abs().amax(dim=1, keepdim=True) * scale
    assert bool((top <= 448).all()) and bool((top > 224).all())  # rounded down, by less than 2x
    assert rel(q.float() * inv, x) < 2 ** -4
    # A single tensorwise scale loses the small rows that per-row scales keep.
    qt, inv_t = quantize(x, E4M3)
    assert rel(qt[:4].float() * inv_t, x[:4]) > 10 * rel(q[:4].float() * inv[:4], x[:4])


def test_zero_tensor_gives_finite_scale_and_zeros():
    q, inv = quantize(torch.zeros(4, 16), E4M3)
    assert torch.isfinite(inv) and not q.float().any()


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_amax_gives_nan_scale_not_a_clamped_one(bad):
    assert torch.isnan(amax_to_scale(torch.tensor(bad).abs(), E4M3))
    x = torch.randn(8, 16)
    x[3, 5] = bad
    q, inv = quantize(x, E4M3)
    assert not torch.isfinite(q.float()).all()  # the cast alone would turn inf into 448 on CPU
    q, inv = quantize(x, E4M3, rowwise=True)
    assert not torch.isfinite(q[3].float()).all() and torch.isfinite(q[0].float()).all()


@pytest.mark.parametrize("recipe", RECIPES)
def test_weight_layouts_and_scale_shapes(recipe):
    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(2))
    qw = quantize_weight(w, recipe)
    assert qw["w"].shape == (48, 32) and qw["wt"].shape == (32, 48)
    assert qw["w"].is_contiguous() and qw["wt"].is_contiguous()
    assert qw["w"].dtype == qw["wt"].dtype == E4M3
    if recipe == "tensorwise":
        assert qw["w_inv"].shape == qw["wt_inv"].shape == ()
        assert torch.equal(qw["wt"].view(torch.uint8), qw["w"].t().contiguous().view(torch.uint8))
    else:  # per output channel (forward), per input channel (input gradient)
        assert qw["w_inv"].shape == (1, 48) and qw["wt_inv"].shape == (1, 32)
    assert rel(qw["w"].float() * qw["w_inv"].reshape(-1, 1) if recipe == "rowwise" else qw["w"].float() * qw["w_inv"], w) < 2 ** -4
    assert rel(qw["wt"].float() * qw["wt_inv"].reshape(-1, 1) if recipe == "rowwise" else qw["wt"].float() * qw["wt_inv"], w.t()) < 2 ** -4


# ------------------------------------------------------------------------------------- the FP8 GEMMs

def _pair(recipe: str, bias: bool = False, seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    ref = nn.Linear(64, 96, bias=bias).requires_grad_(False)
    lin = nn.Linear(64, 96, bias=bias).requires_grad_(False)
    lin.load_state_dict(ref.state_dict())
    return to_float8_frozen(lin, recipe), ref


@needs_scaled_mm
@pytest.mark.parametrize("recipe", RECIPES)
def test_forward_equals_the_dequantised_product(recipe):
    """Layouts and scales: `_scaled_mm` must compute exactly (float32 accumulation) what the dequantised
    operands multiply to."""
    lin, _ = _pair(recipe)
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(3))
    xq, x_inv = quantize(x, E4M3, rowwise=recipe == "rowwise")
    w_deq = lin.fp8_w.float() * (lin.fp8_w_inv.reshape(-1, 1) if recipe == "rowwise" else lin.fp8_w_inv)
    expected = (xq.float() * x_inv) @ w_deq.t()
    assert rel(lin(x), expected) < (1e-5 if recipe == "tensorwise" else 4e-3)  # rowwise: via a bf16 output


@needs_scaled_mm
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("bias", [False, True])
def test_forward_and_input_gradient_within_fp8_tolerance(recipe, bias):
    lin, ref = _pair(recipe, bias)
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(4), requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y, yr = lin(x), ref(xr)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    y.backward(g)
    yr.backward(g)
    assert y.shape == yr.shape and y.dtype == torch.float32
    assert FP8_FLOOR < rel(y, yr) < FWD_TOL[recipe]
    assert FP8_FLOOR < rel(x.grad, xr.grad) < BWD_TOL[recipe]
    assert lin.weight.grad is None  # frozen: no weight-gradient GEMM
    with torch.autocast("cpu", torch.bfloat16):
        yb = lin(x)
    assert yb.dtype == torch.bfloat16 and rel(yb, yr) < FWD_TOL[recipe]


@needs_scaled_mm
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_input_reaches_the_output_and_the_gradient(bad):
    lin, _ = _pair("tensorwise")
    x = torch.randn(4, 64, requires_grad=True)
    y = lin(x.detach().index_put((torch.tensor([1]), torch.tensor([7])), torch.tensor(bad)))
    assert not torch.isfinite(y).all()
    y = lin(x)
    g = torch.ones_like(y)
    g[0, 0] = bad
    y.backward(g)
    assert not torch.isfinite(x.grad).all()


@needs_scaled_mm
@pytest.mark.parametrize("recipe", RECIPES)
def test_compiles_without_graph_breaks(recipe):
    lin, _ = _pair(recipe)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(6), requires_grad=True)
    eager = lin(x)
    eager.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    compiled = torch.compile(lambda t: lin(t), fullgraph=True, backend="aot_eager")  # fullgraph: breaks raise
    out = compiled(x)
    out.sum().backward()
    assert torch.equal(out, eager) and torch.equal(x.grad, grad)


@needs_scaled_mm
def test_weight_change_is_requantised_once_in_place():
    lin, ref = _pair("rowwise")
    x = torch.randn(8, 64)
    buffer = lin.fp8_w
    assert not lin.refresh_if_stale()
    with torch.no_grad():
        lin.weight.mul_(-3.0)  # e.g. a checkpoint loaded into the bf16 weight
        ref.weight.mul_(-3.0)
    assert rel(lin(x), ref(x)) < FWD_TOL["rowwise"]
    assert lin.fp8_w is buffer  # updated in place: compiled graphs keep their input
    assert not lin.refresh_if_stale()


# ---------------------------------------------------------------------------------------- transform


@needs_scaled_mm
@pytest.mark.parametrize("recipe", RECIPES)
def test_lora_model_converts_frozen_block_linears_only(recipe):
    ref, model = _lora_model(), _lora_model()
    keys = set(model.state_dict())
    count = apply_fp8(model, recipe)  # type: ignore[arg-type]
    fp8 = [n for n, m in model.named_modules() if isinstance(m, Float8FrozenLinear)]
    assert count == len(fp8) == 7 * ARGS.n_layers  # 2 LoRA bases + 5 plain projections per block
    assert all(not any(s in n for s in ("lora_A", "lora_B", "lm_head")) for n in fp8)
    assert type(model.lm_head) is nn.Linear and set(model.state_dict()) == keys  # FP8 copies never saved
    tokens = _tokens()
    loss = model(tokens).float().logsumexp(-1).mean()
    loss_ref = ref(tokens).float().logsumexp(-1).mean()
    loss.backward()
    loss_ref.backward()
    assert abs(loss.item() - loss_ref.item()) < 0.02 * abs(loss_ref.item())
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    grads_ref = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert grads.keys() == grads_ref.keys() and len(grads) == 4 * ARGS.n_layers
    assert rel(torch.cat([g.flatten() for g in grads.values()]),
               torch.cat([g.flatten() for g in grads_ref.values()])) < BWD_TOL[recipe]


@needs_scaled_mm
def test_layers_with_odd_dims_stay_bf16_with_one_warning():
    model = _lora_model(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=72, vocab_size=100))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        count = apply_fp8(model, "tensorwise")
    assert count == 4 * 2  # gate/up (out 72) and down (in 72) stay bf16
    assert len([w for w in caught if "multiples of 16" in str(w.message)]) == 1
    assert type(model.layers[0].mlp.down_proj) is nn.Linear


@needs_scaled_mm
def test_probe_reports_amax_scale_and_underflow_per_layer():
    model = _lora_model()
    apply_fp8(model, "tensorwise")
    tokens = _tokens()
    rows = probe_amax(model, lambda: model(tokens).float().logsumexp(-1).mean().backward())
    assert len(rows) == 7 * ARGS.n_layers
    q = next(r for r in rows if r["layer"] == "layers.1.self_attn.q_proj.base")  # block 0's input needs no grad
    w = model.get_submodule(q["layer"]).weight
    assert q["w_amax"] == pytest.approx(float(w.abs().max()))
    assert q["x_scale"] == pytest.approx(448 / q["x_amax"], rel=1e-5)
    assert q["grad_scale"] == pytest.approx(57344 / q["grad_amax"], rel=1e-5)  # E5M2 gradients
    assert all(0 <= r["x_underflow"] < 0.05 for r in rows)


# ----------------------------------------------------------------------------------------- refusals

def test_config_key_and_cpu_refusal():
    assert load_config(None, []).train.fp8 == "none"
    with pytest.raises(ConfigError, match=re.escape("train.fp8")):
        load_config(None, ["--train.fp8=e4m3"])
    cfg = load_config(None, ["--train.fp8=tensorwise", "--model.n_layers=1"])
    with pytest.raises(ConfigError, match=r"config key 'train.fp8': 'tensorwise' needs a CUDA GPU"):
        build_model(cfg, torch.device("cpu"))
    check_fp8_device("none", torch.device("cpu"))  # the default asks for nothing


def test_full_finetune_without_torchao_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as if not installed
    torch.manual_seed(0)
    model = Transformer(ARGS)
    with pytest.raises(ConfigError, match=r"needs torchao: pip install 'tracetrain\[fp8\]'"):
        apply_fp8(model, "tensorwise")


def test_unknown_recipe_is_refused():
    with pytest.raises(ValueError, match="allowed: tensorwise, rowwise"):
        apply_fp8(Transformer(ARGS), "e4m3")  # type: ignore[arg-type]


@pytest.mark.skipif(not HAVE_TORCHAO, reason="torchao is not installed (optional extra: pip install 'tracetrain[fp8]')")
@pytest.mark.parametrize("recipe", RECIPES)
def test_full_finetune_uses_torchao_for_block_linears_not_lm_head(recipe):
    from torchao.float8.float8_linear import Float8Linear
    torch.manual_seed(0)
    model = Transformer(ARGS)
    count = apply_fp8(model, recipe)  # type: ignore[arg-type]
    converted = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert count == len(converted) == 7 * ARGS.n_layers
    assert type(model.lm_head) is nn.Linear
