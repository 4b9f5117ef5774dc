"""GPU check of the Hugging Face families added for issue #30 (Qwen3, Qwen3-MoE, Mixtral, Mistral's window).

For each family: a small random transformers model (saved, then loaded by tracetrain), its fp32 logits
as the reference, and the bf16 logits of transformers and of tracetrain, eager and with the fused
Triton kernels (RMSNorm, which then also runs Qwen3's q/k norms, RoPE, SwiGLU). tracetrain's error
against the fp32 reference should be about transformers' own bf16 error (ratio near 1, < 2 passes).

    PYTHONPATH=. python3 benchmarks/arch_checks.py        # about 1 minute on one H200

Prints a table and writes benchmarks/results/arch_checks_<device>.json (a copy under $OUT when set).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402

from tracetrain.models.hf import load_hf_config, load_hf_weights  # noqa: E402
from tracetrain.models.llama import Transformer  # noqa: E402

SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=4096, max_position_embeddings=4096)
FAMILIES = {
    "qwen3": ("Qwen3Config", {"head_dim": 128}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 128, "num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 256, "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "mistral_window": ("MistralConfig", {"sliding_window": 256}),
}


def _error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    return ((logits.float() - reference).abs().max() / reference.abs().max()).item()


def check(name: str, folder: Path, device: torch.device, fused: bool) -> dict:
    config_cls, overrides = FAMILIES[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_cls)(**SHAPE, **overrides))
    hf.save_pretrained(folder)
    x = torch.randint(0, SHAPE["vocab_size"], (2, 1024), generator=torch.Generator().manual_seed(1)).to(device)
    hf = hf.to(device).eval()
    with torch.no_grad():
        reference = hf(x).logits.float()
        hf_bf16 = hf.to(torch.bfloat16)(x).logits
    model = Transformer(load_hf_config(folder))
    load_hf_weights(model, folder)
    model = model.to(device, torch.bfloat16).eval()
    model.rope_inv_freq.data = model.rope_inv_freq.float()
    row = {"family": name, "hf_bf16_error": _error(hf_bf16, reference)}
    with torch.no_grad():
        row["tracetrain_bf16_error"] = _error(model(x), reference)
        if fused:
            from tracetrain.kernels.apply import apply_fused_kernels

            row["fused_kernels_swapped"] = apply_fused_kernels(model)
            row["tracetrain_fused_error"] = _error(model(x), reference)
    worst = max(v for k, v in row.items() if k.startswith("tracetrain_"))
    row["ratio_to_hf"] = worst / max(row["hf_bf16_error"], 1e-6)
    row["ok"] = row["ratio_to_hf"] < 2.0
    return row


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in FAMILIES:
            rows.append(check(name, Path(tmp) / name, device, fused=device.type == "cuda"))
            r = rows[-1]
            print(f"{name:<16} hf bf16 {r['hf_bf16_error']:.2e}  ours {r['tracetrain_bf16_error']:.2e}  "
                  f"fused {r.get('tracetrain_fused_error', float('nan')):.2e}  ratio {r['ratio_to_hf']:.2f}  "
                  f"{'ok' if r['ok'] else 'FAIL'}")
    env = environment()
    out = os.environ.get("OUT")
    path = write_result(f"arch_checks_{env['device'].replace(' ', '-')}.json", {**env, "rows": rows},
                        Path(out) if out else None)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
