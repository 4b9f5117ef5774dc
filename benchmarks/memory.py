"""Memory toolkit on one GPU: peak memory and throughput of every memory switch, measured with the
real trainer step (benchmarks/common.py: bench_train_step), one table, one JSON.

Cases: the llama2-7b LoRA reference shape and a llama3.2-1b full fine-tune (batch 4 x 2048), each
with no / full / selective recomputation, streamed activation offload (alone and with full
recomputation), save_on_cpu, fp16 instead of bf16, and for the full fine-tune the CPU optimizer
offload. The 7B full fine-tune with optimizer offload has its own script (benchmarks/offload_check.py).

  python3 benchmarks/memory.py [--only 1b] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_train_step, environment, write_result  # noqa: E402

from tracetrain.config import load_config  # noqa: E402

SWITCHES = {
    "bf16": [],
    "recompute full": ["--memory.recompute=full"],
    "recompute selective": ["--memory.recompute=selective"],
    "offload streamed": ["--memory.activation_offload=streamed"],
    "offload streamed + full": ["--memory.activation_offload=streamed", "--memory.recompute=full"],
    "offload save_on_cpu": ["--memory.activation_offload=save_on_cpu"],
    "fp16": ["--train.precision=fp16"],
}
MODELS = {
    "7b-lora": ["--model.preset=llama2-7b", "--train.mode=lora"],
    "1b-full": ["--model.preset=llama3.2-1b", "--train.mode=full"],
}
EXTRA = {"1b-full": {"optimizer offload": ["--memory.optimizer_offload=true"]}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated model keys (default: all)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    rows = []
    for model, margs in MODELS.items():
        if a.only and model not in a.only.split(","):
            continue
        for name, sargs in {**SWITCHES, **EXTRA.get(model, {})}.items():
            cfg = load_config(None, [*margs, *sargs, "--data.seq_len=2048", "--data.pack=false",
                                     "--train.precision=" + ("fp16" if name == "fp16" else "bf16")])
            try:
                r = bench_train_step(cfg, 4, 2048, a.warmup, a.steps)
            except Exception as e:  # record and go on: one failing switch must not lose the table
                r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            rows.append({"model": model, "switch": name, **r})
            print(f"{model} {name}: {r.get('tokens_per_s', 0):,.0f} tok/s, {r.get('peak_gib', 0):.1f} GiB "
                  f"{r.get('error', '')}", flush=True)
    print(f"\n{'model':<8} {'switch':<24} {'tok/s':>8} {'vs bf16':>8} {'peak GiB':>9} {'vs bf16':>8}")
    base = {r["model"]: r for r in rows if r["switch"] == "bf16" and "tokens_per_s" in r}
    for r in rows:
        b = base.get(r["model"])
        if "tokens_per_s" not in r or b is None:
            print(f"{r['model']:<8} {r['switch']:<24} {r.get('error', '')}")
            continue
        print(f"{r['model']:<8} {r['switch']:<24} {r['tokens_per_s']:>8,.0f} {r['tokens_per_s'] / b['tokens_per_s']:>8.2f} "
              f"{r['peak_gib']:>9.1f} {r['peak_gib'] / b['peak_gib']:>8.2f}")
    env = environment()
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    write_result(f"memory_{env['device'].replace(' ', '-')}.json", {**env, "rows": rows}, out)


if __name__ == "__main__":
    main()
