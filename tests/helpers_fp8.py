"""The FP8 tests' shared pieces (tests/train/test_fp8.py, test_fp8_mlp.py): the error budget, the tiny LoRA
model and tokens, and the skip where `torch._scaled_mm` has no float8 kernel."""

from __future__ import annotations

import pytest
import torch

from tracetrain.kernels.fp8 import E4M3
from tracetrain.models.llama import ModelArgs, Transformer
from tracetrain.models.lora import LoRALinear, apply_lora


def _scaled_mm_runs_here() -> bool:
    try:
        a = torch.ones(16, 16).to(E4M3)
        torch._scaled_mm(a, a.t(), torch.tensor(1.0), torch.tensor(1.0), out_dtype=torch.float32)
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError):
        return False


needs_scaled_mm = pytest.mark.skipif(
    not _scaled_mm_runs_here(), reason=f"torch._scaled_mm has no float8 kernel on this CPU build ({torch.__version__})"
)


# FP8 error budget. E4M3 keeps 3 mantissa bits: a value rounds by at most 2^-4 of itself; a dot product
# of two such operands lands near 3-4% relative error (measured 3.7%); E5M2 (2 bits) gradients near 6%.
FWD_TOL, BWD_TOL = {"tensorwise": 0.06, "rowwise": 0.06}, {"tensorwise": 0.10, "rowwise": 0.06}


FP8_FLOOR = 5e-3  # below this the layer did not quantise at all (a silent bf16 fallback)


ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=100)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def _lora_model(args: ModelArgs = ARGS) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    apply_lora(model, rank=4, alpha=8.0, dropout=0.0, targets=["q_proj", "v_proj"])
    with torch.no_grad():  # B = 0 at init would hide the adapter path
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(0, 0.05)
    return model


def _tokens() -> torch.Tensor:
    return torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(7))
