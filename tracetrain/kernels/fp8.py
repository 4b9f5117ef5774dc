"""FP8 GEMMs for training (`train.fp8`): frozen LoRA bases through `torch._scaled_mm`, trained layers via torchao.

Two paths, one per kind of weight:

* **Frozen weights** (LoRA: the adapted bases and every other projection of the blocks). The weight never
  changes, so it is quantised to float8_e4m3fn once, in the two layouts `_scaled_mm` wants (it takes its
  first operand row-major and its second column-major):

      forward     Y  = X  @ W^T   second operand W^T (in, out) column-major = W (out, in) row-major, `.t()`
      input grad  dX = dY @ W     second operand W   (out, in) column-major = W^T contiguous, `.t()`

  There is no weight-gradient GEMM (the weight is frozen) and nothing of X is saved for backward, so
  FP8 adds no activation memory. **The bf16 weight moves to host memory** once quantised (on a GPU): the
  step reads only the two FP8 copies (1 byte per parameter each), and the bf16 weight is read only to
  re-quantise, merge, export or checkpoint, all of which work from the host copy. So FP8 LoRA holds
  2 bytes per frozen block parameter on the GPU, as bf16 LoRA does (13 GB for a 7B base), plus the same
  amount of host memory. The copies are re-quantised only when the bf16 weight changes (its version
  counter or storage moves, e.g. a checkpoint was loaded into it); see
  `Float8FrozenLinear.refresh_if_stale`, which quantises on the GPU.

  Opt-in (`fp8_apply.apply_fp8(..., fused_mlp=True)`, Python API only): a block MLP whose gate, up and down
  projections are all plain frozen linears runs as one `Float8FrozenFeedForward` (fp8_mlp.py): gate and
  up in one GEMM, SwiGLU fused with the quantisation of its output, forward and backward. Measured on an
  H100 (7B LoRA, commit cb02d8e) it is slower end to end than the three FP8 linears (27,585 vs 28,463
  tok/s: its row kernels save ~50 us per layer, the fused GEMM shapes lose more), so it is not the
  default (docs/speed.md). `probe_amax` does not see inside it.

* **Trained weights** (full fine-tuning): torchao's `convert_to_float8_training` with its recipe of the
  same name (weights change every step, and torchao handles the weight-gradient GEMM too). torchao is an
  optional dependency: `pip install 'tracetrain[fp8]'`.

Recipes (as torchao's `Float8LinearRecipeName` defines them):

* `tensorwise`: one fp32 scale per tensor; X and W in E4M3, dY in E5M2 (range over precision for
  gradients); cuBLAS kernel. Fast accumulation in the forward GEMM only.
* `rowwise`: one scale per row of X and dY, per output channel of W (forward) and per input channel
  (input grad); everything E4M3; scales rounded down to powers of two (scaling is then exact); CUTLASS
  kernel with bf16 output.

Scaling is dynamic (no amax history): every call takes amax over the tensor (or row) it quantises,
`scale = fp8_max / max(amax, eps)`, multiplies, saturates to +-fp8_max and casts. A value at amax maps to
fp8_max, so nothing saturates unless the amax itself is not finite.

NaN/inf guard. A non-finite amax gives a NaN scale (not a clamped one): NaN flows into the GEMM output,
then into the loss, and the trainer's existing guard (`train.step`: a non-finite loss or gradient norm
skips the update on the device; `train.max_bad_steps` in a row stop the run) handles it as it handles a
bf16 overflow. The FP8 cast itself would hide it: casting inf to float8_e4m3fn saturates to 448 on some
backends. A known class of FP8 NaNs comes from compiled *transposed* fp8 stores (triton-lang/triton#11111,
which torchao works around by patching Inductor's min/max codegen when `convert_to_float8_training` runs):
here the only compiled fp8 stores keep their source layout (X and dY, row-major); the transposed weight
copy is made eagerly, outside any compiled graph.

Accounting: MFU and TFLOP/s count the same model FLOPs as bf16, and the MFU denominator stays the bf16
dense peak (so FP8 and bf16 runs compare on one scale); `fp8_peak_tflops` gives the FP8 peak for reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from tracetrain.errors import ConfigError

Recipe = Literal["tensorwise", "rowwise"]
RECIPES: tuple[str, ...] = ("tensorwise", "rowwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # smallest amax used for a scale (an all-zero tensor stays zero)
ALIGN = 16  # _scaled_mm needs K and N (both GEMMs) to be multiples of 16
FAST_ACCUM_FORWARD = True  # as torchao's recipes: fast accumulation for the output GEMM only
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm89), Hopper (sm90) and later


# ------------------------------------------------------------------------------------- quantisation


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool = False) -> torch.Tensor:
    """`fp8_max / max(amax, EPS)` in float32; NaN where amax is not finite (never a clamped scale)."""
    amax = amax.float()
    scale = torch.finfo(dtype).max / amax.clamp(min=EPS)
    if power_of_2:  # round down: x * scale is exact and amax still fits
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def quantize(x: torch.Tensor, dtype: torch.dtype, rowwise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (rows, cols) in fp8 and the inverse scale that `_scaled_mm` multiplies back in.

    Tensorwise: one scale, inverse scale shape (). Rowwise: one per row (amax over the last dim, scales
    rounded to powers of two as torchao's rowwise recipe does), inverse scale shape (rows, 1).
    """
    amax = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax()
    scale = amax_to_scale(amax, dtype, power_of_2=rowwise)
    fp8_max = torch.finfo(dtype).max
    q = (x.float() * scale).clamp(-fp8_max, fp8_max).to(dtype)  # clamp keeps NaN: inf * 0 stays visible
    return q, scale.reciprocal()


def quantize_weight(weight: torch.Tensor, recipe: Recipe) -> dict[str, torch.Tensor]:
    """The frozen weight (out, in) in the layouts and scale shapes the two GEMMs need.

    `w`: (out, in) row-major, used as `w.t()`; `w_inv`: () or (1, out).
    `wt`: (in, out) row-major, used as `wt.t()`; `wt_inv`: () or (1, in).
    """
    w = weight.detach()
    if recipe == "tensorwise":
        q, inv = quantize(w, E4M3)
        return {"w": q, "w_inv": inv, "wt": q.t().contiguous(), "wt_inv": inv.clone()}
    q, inv = quantize(w, E4M3, rowwise=True)  # one scale per output channel
    qt, inv_t = quantize(w.t().contiguous(), E4M3, rowwise=True)  # one scale per input channel
    return {"w": q, "w_inv": inv.reshape(1, -1), "wt": qt, "wt_inv": inv_t.reshape(1, -1)}


def fp8_matmul(
    a: torch.Tensor,
    a_dtype: torch.dtype,
    b_fp8_t: torch.Tensor,
    b_inv: torch.Tensor,
    recipe: Recipe,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """`a (M, K) @ b^T` with `a` quantised now and `b_fp8_t` (N, K) quantised before; returns (M, N)."""
    a_q, a_inv = quantize(a, a_dtype, rowwise=recipe == "rowwise")
    return scaled_matmul(a_q, a_inv, b_fp8_t, b_inv, recipe, out_dtype, fast_accum)


def scaled_matmul(
    a_q: torch.Tensor,
    a_inv: torch.Tensor,
    b_fp8_t: torch.Tensor,
    b_inv: torch.Tensor,
    recipe: Recipe,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """`a_q (M, K) @ b^T` for two operands quantised before (b_fp8_t is (N, K)); returns (M, N) in out_dtype."""
    # The rowwise (CUTLASS) kernel writes bf16 only; other output dtypes are cast from it.
    mm_dtype = torch.bfloat16 if recipe == "rowwise" else out_dtype
    out = torch._scaled_mm(
        a_q, b_fp8_t.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=mm_dtype, use_fast_accum=fast_accum
    )
    return out if out.dtype == out_dtype else out.to(out_dtype)


class _FrozenFloat8Matmul(torch.autograd.Function):
    """Y = X W^T with a frozen, pre-quantised W: forward and input-gradient GEMMs in FP8, no weight grad."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        w_inv: torch.Tensor,
        wt: torch.Tensor,
        wt_inv: torch.Tensor,
        recipe: Recipe,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        ctx.save_for_backward(wt, wt_inv)  # fp8 buffers of the module: no activation is saved
        ctx.recipe, ctx.x_dtype = recipe, x.dtype
        x2 = x.reshape(-1, x.shape[-1])  # (tokens, in)
        y = fp8_matmul(x2, E4M3, w, w_inv, recipe, out_dtype, FAST_ACCUM_FORWARD)  # (tokens, out)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        wt, wt_inv = ctx.saved_tensors
        grad_dtype = E5M2 if ctx.recipe == "tensorwise" else E4M3
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # (tokens, out)
        grad_x = fp8_matmul(g2, grad_dtype, wt, wt_inv, ctx.recipe, ctx.x_dtype, fast_accum=False)  # (tokens, in)
        return grad_x.view(*grad_out.shape[:-1], grad_x.shape[-1]), None, None, None, None, None, None


class Float8FrozenLinear(nn.Linear):
    """A frozen `nn.Linear` whose matmuls run in FP8. Swapped in by class: same parameters and state dict.

    The FP8 copies are non-persistent buffers (`fp8_w`, `fp8_w_inv`, `fp8_wt`, `fp8_wt_inv`), so they
    move with the module and never enter checkpoints.
    """

    fp8_recipe: Recipe
    _fp8_source: tuple[int, int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # compiled blocks: `apply_fp8`'s block pre-hook does this
            self.refresh_if_stale()
        out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        y = _FrozenFloat8Matmul.apply(
            x, self.fp8_w, self.fp8_w_inv, self.fp8_wt, self.fp8_wt_inv, self.fp8_recipe, out_dtype
        )
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @torch.no_grad()
    def refresh_if_stale(self) -> bool:
        """Re-quantise when the bf16 weight changed since the last quantisation; True if it did.

        Dynamo cannot see version counters, which is why this runs eagerly (module forward outside
        compile, or the block pre-hook). Buffers are updated in place so compiled graphs keep them.
        """
        source = (self.weight._version, self.weight.data_ptr())
        if source == self._fp8_source:
            return False
        device = self.get_buffer("fp8_w").device
        weight = self.weight.detach().to(device)  # the bf16 weight lives on the host (see module doc)
        for name, value in quantize_weight(weight, self.fp8_recipe).items():
            getattr(self, f"fp8_{name}").copy_(value)
        self._fp8_source = (self.weight._version, self.weight.data_ptr())
        return True

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_recipe}"


def to_float8_frozen(linear: nn.Linear, recipe: Recipe) -> Float8FrozenLinear:
    """Swap `linear`'s class to `Float8FrozenLinear` in place and quantise its weight; returns it."""
    assert not linear.weight.requires_grad, "only frozen weights are quantised once"
    linear.__class__ = Float8FrozenLinear
    linear.fp8_recipe = recipe  # type: ignore[assignment]  # nn.Module attributes are typed Tensor | Module in torch's stubs
    for name, value in quantize_weight(linear.weight, recipe).items():
        linear.register_buffer(f"fp8_{name}", value, persistent=False)
    if linear.weight.is_cuda:
        # The step never reads the bf16 weight again: keep it on the host, so FP8 costs no GPU memory over
        # bf16 (assigning `.data` keeps the Parameter object, its name and the state dict's keys).
        linear.weight.data = linear.weight.data.to("cpu")
    linear._fp8_source = (linear.weight._version, linear.weight.data_ptr())  # type: ignore[assignment]  # nn.Module attributes are typed Tensor | Module in torch's stubs
    return linear  # type: ignore[return-value]  # __class__ was swapped to Float8FrozenLinear above; mypy keeps the nn.Linear type


def fp8_compatible(linear: nn.Linear) -> bool:
    """`_scaled_mm` needs both GEMM dims K and N (in and out features) to be multiples of 16."""
    return linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0


def fp8_runs_on(device: torch.device) -> bool:
    """True where `train.fp8` can run: a CUDA GPU with FP8 tensor cores (check_fp8_device's rule)."""
    try:
        check_fp8_device("rowwise", device)
    except ConfigError:
        return False
    return True


def check_fp8_device(recipe: str, device: torch.device) -> None:
    """Refuse `train.fp8` where there are no FP8 tensor cores (CPU, or CUDA compute capability < 8.9)."""
    if recipe == "none":
        return
    if device.type != "cuda":
        raise ConfigError(
            f"config key 'train.fp8': {recipe!r} needs a CUDA GPU with FP8 tensor cores "
            f"(compute capability >= 8.9), not {device.type}; use 'none'"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ConfigError(
            f"config key 'train.fp8': {recipe!r} needs compute capability >= 8.9 (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}; use 'none'"
        )


def fp8_peak_tflops(device_name: str) -> float | None:
    """The FP8 dense peak from the device table, for reference next to MFU (which uses the bf16 peak)."""
    from tracetrain.devices import lookup_device

    spec = lookup_device(device_name)
    return spec.fp8_tflops if spec and spec.fp8_tflops > 0 else None


# ------------------------------------------------------------------------------------------- probe


@torch.no_grad()
def _quant_stats(x: torch.Tensor, dtype: torch.dtype, recipe: Recipe) -> dict[str, torch.Tensor]:
    """amax, scale (min over rows for rowwise) and the share of non-zero values that FP8 flushes to zero."""
    x2 = x.reshape(-1, x.shape[-1])
    q, inv = quantize(x2, dtype, rowwise=recipe == "rowwise")
    nonzero = x2 != 0
    flushed = (nonzero & (q.float() == 0)).sum() / nonzero.sum().clamp(min=1)
    return {"amax": x2.abs().amax().float(), "scale": inv.reciprocal().amin(), "underflow": flushed.float()}


def probe_amax(model: nn.Module, run: Callable[[], Any]) -> list[dict[str, Any]]:
    """Run `run()` (a forward and backward) eagerly and report each FP8 layer's amax and scale behaviour.

    One row per `Float8FrozenLinear`: input and output-gradient amax, the scale used, the share of
    non-zero entries that quantise to zero (underflow), and the weight's amax. Compiled blocks run
    eagerly for this call (`torch.compiler.set_stance("force_eager")`) so the hooks see every layer.
    Diagnostic only: it adds a quantisation per tensor and one host sync at the end.
    """
    stats: dict[str, dict[str, torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if not isinstance(module, Float8FrozenLinear):
            continue

        def forward_hook(mod: Float8FrozenLinear, args: tuple, out: torch.Tensor, name: str = name) -> None:
            grad_dtype = E5M2 if mod.fp8_recipe == "tensorwise" else E4M3
            stats[name] = {f"x_{k}": v for k, v in _quant_stats(args[0], E4M3, mod.fp8_recipe).items()}
            stats[name]["w_amax"] = mod.weight.detach().abs().amax().float()
            if out.requires_grad:
                out.register_hook(
                    lambda g: stats[name].update(
                        {f"grad_{k}": v for k, v in _quant_stats(g, grad_dtype, mod.fp8_recipe).items()}
                    )
                )

        handles.append(module.register_forward_hook(forward_hook))
    try:
        with torch.compiler.set_stance("force_eager"):
            run()
    finally:
        for h in handles:
            h.remove()
    return [{"layer": name, **{k: float(v) for k, v in values.items()}} for name, values in stats.items()]
