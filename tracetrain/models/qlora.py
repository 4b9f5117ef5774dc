"""QLoRA's frozen base: `nn.Linear` weights stored in 4-bit NF4 with double-quantised scales (`lora.base_quant`).

The format is the QLoRA paper's and torchao's `NF4Tensor` (`to_nf4(w, block_size=64, scaler_block_size=256)`),
value for value (tests/models/test_qlora.py compares with torchao when it is installed):

- the weight, flattened, is cut into blocks of 64; each block is divided by its absolute maximum and every
  value is stored as the index (4 bits, two per byte) of the nearest of the 16 NF4 levels;
- the per-block maxima ("scalers") are quantised again (double quantisation): their mean is subtracted and
  each run of 256 is stored as int8 with one float32 factor per run, plus the one float32 mean.

Memory: 4 bits + 8 / 64 + 32 / (64 * 256) = 4.127 bits per weight (`NF4_BITS_PER_PARAM`, which the planner
reads), against 16 in bf16. Without double quantisation the scalers alone would cost 32 / 64 = 0.5 bits.

Compute: `NF4Linear` dequantises its weight to the compute dtype (the LoRA base dtype: bf16 on GPUs) inside
the matmul, an op of its own (`tracetrain::nf4_linear`) whose backward dequantises again from the 4-bit
codes it saved: the 16-bit weight only ever exists for one projection at a time. On a GPU the
dequantisation is one kernel before each GEMM (`nf4_dequantise`: Triton's one-pass kernel from
kernels/nf4_triton.py when Triton is installed, else a compiled one). The frozen base has no gradient.

The base is pure PyTorch: no bitsandbytes or torchao is needed to train, merge or export. Every frozen
`nn.Linear` of the blocks is quantised (LoRA bases and projections without adapters, as PEFT and unsloth
do); the embedding, `lm_head`, norms and MoE experts stay in the base dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from tracetrain.errors import ConfigError

BLOCK_SIZE = 64  # weights per absmax block
SCALER_BLOCK_SIZE = 256  # absmax values per double-quantisation block
NF4_BITS_PER_PARAM = 4 + 8 / BLOCK_SIZE + 32 / (BLOCK_SIZE * SCALER_BLOCK_SIZE)
# Bytes per weight `quantise_nf4` holds at once, beyond the codes: the weight in its dtype (2), its float32
# copy (4), the scaled copy (4), the int32 level indices (4) and their uint8 copy (1). The planner's build phase.
NF4_QUANTISE_BYTES_PER_PARAM = 15

# The 16 NF4 levels (quantiles of a unit normal, rescaled to [-1, 1]) as QLoRA and torchao round them.
NF4_LEVELS: tuple[float, ...] = (
    -1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0,
)  # fmt: skip


def nf4_shapes(numel: int) -> tuple[int, int]:
    """(number of 64-blocks, number of 256-scaler blocks) of a weight of `numel` elements."""
    if numel % BLOCK_SIZE:
        raise ValueError(f"an NF4 weight needs a multiple of {BLOCK_SIZE} elements, got {numel}")
    n_blocks = numel // BLOCK_SIZE
    return n_blocks, -(-n_blocks // SCALER_BLOCK_SIZE)


def _levels(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(NF4_LEVELS, device=device, dtype=dtype)


@torch.no_grad()
def quantise_nf4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 (numel/2,), scaler codes int8 (scaler blocks * 256,), scaler factors float32 (scaler
    blocks,), scaler mean float32 ()) of `weight`, computed in float32. An all-zero block stays exact."""
    n_blocks, n_scaler_blocks = nf4_shapes(weight.numel())
    blocks = weight.detach().float().reshape(n_blocks, BLOCK_SIZE)
    absmax = blocks.abs().amax(dim=1)  # (n_blocks,)
    mean = absmax.mean()
    centred = torch.zeros(n_scaler_blocks * SCALER_BLOCK_SIZE, device=weight.device)  # padded with zeros
    centred[:n_blocks] = absmax - mean
    runs = centred.view(n_scaler_blocks, SCALER_BLOCK_SIZE)
    run_max = runs.abs().amax(dim=1)
    factors = torch.where(run_max > 0, 256 / (2 * run_max), torch.ones_like(run_max))  # as torchao: 256 / (2 max)
    scaler_codes = (runs * factors[:, None]).round().clamp(-128, 127).to(torch.int8).reshape(-1)
    # The codes use the exact absmax (as torchao); an all-zero block divides by 1 and stores level 0.0.
    scaled = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]
    levels = _levels(weight.device, torch.float32)
    midpoints = (levels[1:] + levels[:-1]) / 2
    index = torch.bucketize(scaled.reshape(-1), midpoints, out_int32=True).to(torch.uint8)  # nearest, ties lower
    codes = (index[0::2] << 4) | index[1::2]
    return codes, scaler_codes, factors, mean


def dequantise_nf4(
    codes: torch.Tensor,
    scaler_codes: torch.Tensor,
    scaler_factors: torch.Tensor,
    scaler_mean: torch.Tensor,
    levels: torch.Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The weight of `shape` in `dtype` (values computed in float32, rounded once); `levels` = NF4_LEVELS
    as a float32 tensor on the codes' device (a buffer: building it here would copy from the host per call)."""
    n_blocks = codes.numel() * 2 // BLOCK_SIZE
    scalers = (scaler_codes.view(-1, SCALER_BLOCK_SIZE).float() / scaler_factors[:, None]).reshape(-1)
    scalers = scalers[:n_blocks] + scaler_mean  # (n_blocks,)
    pairs = torch.stack((levels[(codes >> 4).long()], levels[(codes & 15).long()]), dim=-1)  # (numel/2, 2)
    return (pairs.view(n_blocks, BLOCK_SIZE) * scalers[:, None]).view(shape).to(dtype)


@functools.cache
def compiled_dequantise_nf4() -> Callable[..., torch.Tensor]:
    """`dequantise_nf4` compiled (one generated kernel for every shape): `nf4_dequantise`'s CUDA path
    where Triton's own kernel (kernels/nf4_triton.py) is not registered. Built at first use."""
    return torch.compile(dequantise_nf4, dynamic=True)


# The dequantisation is an op of its own so that a kernel can be registered for a device without models/
# importing it: kernels/nf4_triton.py registers its one-pass Triton kernel for CUDA (train/assemble.py
# imports it for a QLoRA run); this default is the compiled kernel on a GPU and eager PyTorch elsewhere.
@torch.library.custom_op("tracetrain::nf4_dequantise", mutates_args=())
def nf4_dequantise(
    codes: torch.Tensor,
    sc: torch.Tensor,
    sf: torch.Tensor,
    sm: torch.Tensor,
    lv: torch.Tensor,
    out_features: int,
    in_features: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The (out_features, in_features) weight in `dtype`, as `dequantise_nf4`."""
    fn = compiled_dequantise_nf4() if codes.is_cuda else dequantise_nf4
    return fn(codes, sc, sf, sm, lv, (out_features, in_features), dtype)


@nf4_dequantise.register_fake
def _(codes, sc, sf, sm, lv, out_features, in_features, dtype):
    return codes.new_empty((out_features, in_features), dtype=dtype)


# The 4-bit matmul is one opaque op for torch.compile: inside a compiled block, the partitioner would
# otherwise keep the dequantised weight from forward to backward (it is materialised in the backward),
# 2 bytes per weight, the whole model's worth. As an op with its own backward it saves only the codes.
@torch.library.custom_op("tracetrain::nf4_linear", mutates_args=())
def nf4_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    sc: torch.Tensor,
    sf: torch.Tensor,
    sm: torch.Tensor,
    lv: torch.Tensor,
    out_features: int,
) -> torch.Tensor:
    """x @ dequant(W)^T, W of shape (out_features, x.shape[-1]), in x's dtype."""
    return F.linear(x, nf4_dequantise(codes, sc, sf, sm, lv, out_features, x.shape[-1], x.dtype))


@nf4_linear.register_fake
def _(x, codes, sc, sf, sm, lv, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("tracetrain::nf4_linear_grad_input", mutates_args=())
def nf4_linear_grad_input(
    grad: torch.Tensor,
    codes: torch.Tensor,
    sc: torch.Tensor,
    sf: torch.Tensor,
    sm: torch.Tensor,
    lv: torch.Tensor,
    in_features: int,
) -> torch.Tensor:
    """grad @ dequant(W): the weight dequantised again, never saved from the forward."""
    return grad @ nf4_dequantise(codes, sc, sf, sm, lv, grad.shape[-1], in_features, grad.dtype)


@nf4_linear_grad_input.register_fake
def _(grad, codes, sc, sf, sm, lv, in_features):
    return grad.new_empty((*grad.shape[:-1], in_features))


def _setup_context(ctx, inputs, output):
    x, *quantised, _ = inputs
    ctx.save_for_backward(*quantised)
    ctx.in_features = x.shape[-1]


def _backward(ctx, grad):
    return nf4_linear_grad_input(grad, *ctx.saved_tensors, ctx.in_features), None, None, None, None, None, None


nf4_linear.register_autograd(_backward, setup_context=_setup_context)


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is held in NF4 (see module docstring); `weight` dequantises.

    The buffers are the state dict (`codes`, `scaler_codes`, `scaler_factors`, `scaler_mean`): a checkpoint
    of a randomly initialised QLoRA base stores the 4-bit values exactly. Built on the meta device by
    `quantise_frozen_linears`; `models/build.py::materialize_parts` fills each weight in full precision,
    one at a time, and calls `quantise_` with it.
    """

    codes: torch.Tensor
    levels: torch.Tensor
    scaler_codes: torch.Tensor
    scaler_factors: torch.Tensor
    scaler_mean: torch.Tensor

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = dtype  # compute dtype of the dequantised weight (the LoRA base dtype)
        device = linear.weight.device
        n_blocks, n_scaler_blocks = nf4_shapes(linear.weight.numel())
        self.register_buffer("codes", torch.empty(n_blocks * BLOCK_SIZE // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scaler_codes", torch.empty(n_scaler_blocks * SCALER_BLOCK_SIZE, dtype=torch.int8, device=device))  # fmt: skip
        self.register_buffer("scaler_factors", torch.empty(n_scaler_blocks, device=device))
        self.register_buffer("scaler_mean", torch.empty((), device=device))
        self.register_buffer("levels", _levels(device, torch.float32), persistent=False)  # filled again by quantise_
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)
        if not linear.weight.is_meta:
            self.quantise_(linear.weight)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @torch.no_grad()
    def quantise_(self, weight: torch.Tensor) -> None:
        """Store `weight` (out, in), any dtype and device, quantised into this module's buffers."""
        assert tuple(weight.shape) == self.shape, f"{tuple(weight.shape)} != {self.shape}"
        for buf, value in zip(
            (self.codes, self.scaler_codes, self.scaler_factors, self.scaler_mean),
            quantise_nf4(weight.to(self.codes.device)),
        ):
            buf.copy_(value)
        self.levels.copy_(_levels(self.levels.device, torch.float32))

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight (out, in) in the compute dtype: a new tensor (merges and exports read it)."""
        return dequantise_nf4(*self.quantised(), self.shape, self.dtype)

    def quantised(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scaler codes, scaler factors, scaler mean, levels): what dequantisation reads."""
        return (self.codes, self.scaler_codes, self.scaler_factors, self.scaler_mean, self.levels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        else:
            x = x.to(self.dtype)
        out = nf4_linear(x, *self.quantised(), self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4, compute={self.dtype}"


def quantise_frozen_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Every frozen `nn.Linear` of `model.layers` becomes an `NF4Linear` (on meta: no values yet), in place.

    Run after `apply_lora` (the adapted bases are `.base` then). Returns the number of weights quantised.
    """
    count = 0
    for block in model.layers:  # type: ignore[union-attr]  # nn.Module attributes are typed Tensor | Module
        frozen = [(n, m) for n, m in block.named_modules() if type(m) is nn.Linear and not m.weight.requires_grad]
        for name, linear in frozen:
            if linear.weight.numel() % BLOCK_SIZE:
                raise ConfigError(
                    f"config key 'lora.base_quant': 'nf4' stores weights in blocks of {BLOCK_SIZE}; {name} has "
                    f"{linear.out_features} x {linear.in_features}; use lora.base_quant = 'none' for this model"
                )
            parent_name, _, leaf = name.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            setattr(parent, leaf, NF4Linear(linear, dtype))
            count += linear.weight.numel()
    return count


@torch.no_grad()
def dequantise_all(model: nn.Module) -> None:
    """Every `NF4Linear` back to a plain frozen `nn.Linear` holding its dequantised weight, in place."""
    for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, NF4Linear)]:
        linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        linear.weight = nn.Parameter(module.weight, requires_grad=False)
        if module.bias is not None:
            linear.bias = module.bias
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, linear)


def nf4_state_keys(module_name: str) -> list[str]:
    """The state-dict keys an `NF4Linear` named `module_name` holds in place of `{module_name}.weight`."""
    return [f"{module_name}.{b}" for b in ("codes", "scaler_codes", "scaler_factors", "scaler_mean")]


def dense_state_dict(model: nn.Module, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with each NF4Linear's buffers replaced by its `weight` entry, in place: a meta
    tensor of the dequantised shape and dtype (names, shapes and sizes for HF checkpoints and exports;
    `models/hf.py::_export_tensor` reads the values from the module, one weight at a time)."""
    nf4 = {name: m for name, m in model.named_modules() if isinstance(m, NF4Linear)}
    state = model.state_dict(keep_vars=keep_vars)
    if not nf4:
        return state
    held = {key for name in nf4 for key in nf4_state_keys(name)}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        module_name, _, leaf = key.rpartition(".")
        if module_name in nf4 and leaf == "codes":
            out[f"{module_name}.weight"] = torch.empty(
                nf4[module_name].shape, dtype=nf4[module_name].dtype, device="meta"
            )
        elif key not in held:
            out[key] = value
    return out
