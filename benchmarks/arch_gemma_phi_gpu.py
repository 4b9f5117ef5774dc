"""Gemma 2, Gemma 3 and Phi-4-mini (longrope) on a CUDA GPU: bf16 logits against transformers', and short
LoRA / full fine-tuning runs through the CLI with the CUDA defaults (compile on; then compile off, where the
fused kernels that apply run), tokens/s and losses. CPU tests check fp32 parity; this checks the GPU paths.

Each model has its preset's widths (gemma2-2b, gemma3-1b, phi4-mini) and `--layers` blocks, random weights
saved by transformers. Run from the checkout root (about 3-5 minutes on one H200):

  PYTHONPATH=. python3 benchmarks/arch_gemma_phi_gpu.py [--layers 6] [--seq 2048] [--steps 20]

Writes benchmarks/results/arch_gemma_phi_gpu.json (and $OUT/ when set). Pass criterion (printed): bf16 logits
fp32 logits within 1e-3 of the logits' spread (max |diff| / std) of transformers', bf16 ones within 3% on
average (a few bf16 steps at the largest logits), every run's losses finite.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result

from tracetrain.models.build import build_on_meta, materialize_parts
from tracetrain.models.hf import hf_config_dict, load_hf_config, open_hf_checkpoint
from tracetrain.models.presets import PRESETS

LONGROPE = {"rope_short_factor": (1.0,) * 48, "rope_long_factor": tuple(1.0 + i / 8 for i in range(48)),
            "rope_original_max_len": 4096, "rope_attention_factor": 1.19, "max_seq_len": 131072}  # fmt: skip


def save_hf(name: str, layers: int, folder: Path) -> None:
    import transformers

    args = dataclasses.replace(PRESETS[name], n_layers=layers, layer_types=PRESETS[name].layer_types[:layers])
    if name == "phi4-mini":
        args = dataclasses.replace(args, **LONGROPE)
    cfg = transformers.AutoConfig.for_model(**hf_config_dict(args, torch.bfloat16, 1, 2, 0))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():  # norms off their initial value, so (1 + weight) and weight differ
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)


@torch.no_grad()
def parity(folder: Path, seq: int, device: str, dtype: torch.dtype) -> dict:
    import transformers

    eager = "eager" if "gemma2" in json.loads((folder / "config.json").read_text())["model_type"] else "sdpa"
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=eager)
    hf = hf.to(device).eval()
    args = load_hf_config(folder)
    ours = build_on_meta(args, dtype)
    materialize_parts([ours], args, torch.device(device), 0, source=open_hf_checkpoint(folder, ours))
    ids = torch.randint(0, 32000, (2, seq), generator=torch.Generator().manual_seed(0)).to(device)
    ref, out = hf(ids).logits.float(), ours.eval()(ids).float()
    diff = (ref - out).abs()
    del hf, ours
    return {"mean_diff_over_std": (diff.mean() / ref.std()).item(), "max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(), "ref_std": ref.std().item(),
            "max_diff_over_std": (diff.max() / ref.std()).item()}  # fmt: skip


def train(folder: Path, out: Path, mode: str, compile_: str, a: argparse.Namespace) -> dict:
    from tracetrain.cli import main

    name = f"{folder.name}-{mode}-compile-{compile_}"
    code = main(["train", f"--model.init_from={folder}", f"--train.mode={mode}", f"--train.compile={compile_}",
                 f"--train.steps={a.steps}", f"--data.seq_len={a.seq}", "--train.micro_batch_size=2",
                 "--data.synthetic_examples=4000", "--train.eval_interval=0", "--train.eval_generate=0",
                 "--checkpoint.save_final=false", "--logging.progress=false", f"--train.output_dir={out}",
                 f"--train.run_name={name}"])  # fmt: skip
    if code != 0:
        return {"run": name, "ok": False, "exit_code": code}
    summary = json.loads((out / name / "summary.json").read_text())
    losses = [json.loads(x)["loss"] for x in (out / name / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    finite = all(abs(v) < float("inf") for v in losses)  # NaN fails the comparison too
    return {"run": name, "ok": finite, "tokens_per_s": summary.get("tokens_per_s"), "first_loss": losses[0],
            "last_loss": losses[-1], "peak_gib": summary.get("mem_peak_alloc_gib")}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20, help="0: logits only (a dry run on a CPU)")
    ap.add_argument("--models", default="gemma2-2b,gemma3-1b,phi4-mini")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    rows, ok = [], True
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            folder = Path(tmp) / name
            save_hf(name, a.layers, folder)
            torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32 matmuls
            row = {"model": name, "layers": a.layers, "fp32": parity(folder, a.seq, a.device, torch.float32),
                   "bf16": parity(folder, a.seq, a.device, torch.bfloat16)}  # fmt: skip
            cases = (("lora", "auto"), ("full", "auto"), ("lora", "off")) if a.steps else ()
            row["runs"] = [train(folder, Path(tmp) / "runs", m, c, a) for m, c in cases]
            ok &= row["fp32"]["max_diff_over_std"] < 1e-3 and row["bf16"]["mean_diff_over_std"] < 0.03
            ok &= all(r["ok"] for r in row["runs"])
            rows.append(row)
            print(f"{name}: fp32 logits max|diff|/std {row['fp32']['max_diff_over_std']:.2e}, bf16 mean "
                  f"{row['bf16']['mean_diff_over_std']:.4f} max {row['bf16']['max_diff_over_std']:.4f}; "
                  + "; ".join(f"{r['run']}: {r.get('tokens_per_s') or 0:,.0f} tok/s, loss {r.get('first_loss', 0):.3f}"
                              f" -> {r.get('last_loss', 0):.3f}" for r in row["runs"]), flush=True)  # fmt: skip
    print("PASS" if ok else "FAIL")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    write_result("arch_gemma_phi_gpu.json", {**environment(), "args": vars(a), "pass": ok, "rows": rows}, out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
