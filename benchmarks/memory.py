"""Memory toolkit on one GPU: peak memory and throughput of every memory switch, measured with the
real trainer step (benchmarks/common.py: bench_train_step), one table, one JSON.

Cases: the llama2-7b LoRA reference shape and a llama3.2-1b full fine-tune (batch 4 x 2048), each
with no / full / selective recomputation, streamed activation offload (all blocks but the last, a
share of the first blocks, and with full recomputation), save_on_cpu, fp16 instead of bf16, and for
the full fine-tune the CPU optimizer offload. The 7B full fine-tune with optimizer offload has its own
script (benchmarks/offload_check.py).

Columns: step time and peak allocated memory as before, and "act GiB": the activation memory of a
step, the peak of *active* memory over the timed steps minus what the step starts from (weights,
optimizer states). Active, not allocated: a tensor freed with `record_stream` while a side stream may
still read it (optimizer offload's gradient copies) leaves "allocated" at once but the allocator
cannot reuse it yet. The issue #4 goal reads off it directly: offload <= 15% slower than bf16 at
>= 40% less activation memory ("act vs bf16" <= 0.60).

  python3 benchmarks/memory.py [--only 1b-full,offload] [--steps 10]

`--only` takes model keys and/or "offload" (the offload rows with their bf16 and full-recompute
references only: the quick check of activation offload, ~3 minutes per model on an H100).
`--cap-activations 0.6` re-runs every streamed-offload row with the caching allocator capped at the
bf16 row's base + 60% of its activation memory (+ `--cap-slack` GiB): the goal's memory budget made
hard. A row that needs more raises OOM; one that only needs to wait for its copies to the host to finish
before the memory is reused pays that wait in its tokens/s.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_train_step, environment, write_result  # noqa: E402

from tracetrain.config import load_config  # noqa: E402

STREAMED = ["--memory.activation_offload=streamed"]
SWITCHES = {
    "bf16": [],
    "recompute full": ["--memory.recompute=full"],
    "recompute selective": ["--memory.recompute=selective"],
    "offload streamed": STREAMED,
    "offload streamed 0.5": [*STREAMED, "--memory.activation_offload_fraction=0.5"],
    "offload streamed 0.45": [*STREAMED, "--memory.activation_offload_fraction=0.45"],
    "offload streamed 0.4": [*STREAMED, "--memory.activation_offload_fraction=0.4"],
    "offload streamed 0.25": [*STREAMED, "--memory.activation_offload_fraction=0.25"],
    "offload streamed + full": [*STREAMED, "--memory.recompute=full"],
    "offload save_on_cpu": ["--memory.activation_offload=save_on_cpu"],
    "fp16": ["--train.precision=fp16"],
}
OFFLOAD_ROWS = ("bf16", "recompute full", "offload streamed", "offload streamed 0.5", "offload streamed 0.45",
                "offload streamed 0.4", "offload streamed 0.25", "offload streamed + full")
MODELS = {
    "7b-lora": ["--model.preset=llama2-7b", "--train.mode=lora"],
    "1b-full": ["--model.preset=llama3.2-1b", "--train.mode=full"],
}
EXTRA = {"1b-full": {"optimizer offload": ["--memory.optimizer_offload=true"]}}


def run_row(margs: list[str], name: str, sargs: list[str], warmup: int, steps: int,
            cap_gib: float | None = None) -> dict:
    cfg = load_config(None, [*margs, *sargs, "--data.seq_len=2048", "--data.pack=false",
                             "--train.precision=" + ("fp16" if name == "fp16" else "bf16")])
    try:
        r = bench_train_step(cfg, 4, 2048, warmup, steps, cap_gib=cap_gib)
    except Exception as e:  # record and go on: one failing switch must not lose the table
        r = {"error": f"{type(e).__name__}: {str(e)[:200]}", "cap_gib": cap_gib}
    gc.collect()
    # Memory a row leaves behind inflates every later row's peak (its activation column is immune).
    r["leftover_gib"] = torch.cuda.memory_allocated() / 2**30
    return r


def print_table(rows: list[dict]) -> None:
    print(f"\n{'model':<8} {'switch':<24} {'tok/s':>8} {'vs bf16':>8} {'peak GiB':>9} {'act GiB':>8} "
          f"{'act vs bf16':>11} {'left GiB':>8}")
    base = {r["model"]: r for r in rows if r["switch"] == "bf16" and "tokens_per_s" in r}
    for r in rows:
        b = base.get(r["model"])
        if "tokens_per_s" not in r or b is None:
            print(f"{r['model']:<8} {r['switch']:<24} {r.get('error', '')}")
            continue
        print(f"{r['model']:<8} {r['switch']:<24} {r['tokens_per_s']:>8,.0f} "
              f"{r['tokens_per_s'] / b['tokens_per_s']:>8.2f} {r['peak_gib']:>9.1f} {r['activation_gib']:>8.1f} "
              f"{r['activation_gib'] / b['activation_gib']:>11.2f} {r['leftover_gib']:>8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated model keys and/or 'offload' (default: all)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--cap-activations", type=float, default=0.0,
                    help="also run each streamed-offload row with the allocator capped at the bf16 row's "
                         "base + this share of its activation memory + --cap-slack GiB (e.g. 0.6: the goal's "
                         "40%% less activation memory); OOM means it does not fit in that budget")
    ap.add_argument("--cap-slack", type=float, default=0.5, help="GiB of allocator slack added to the cap")
    ap.add_argument("--switches", default="", help="comma-separated switch names to run (default: all of the "
                    "selection; 'bf16' is always run first, the reference of every ratio)")
    a = ap.parse_args()
    chosen = set(filter(None, a.switches.split(",")))
    known = [*SWITCHES, *(n for e in EXTRA.values() for n in e)]
    if chosen - set(known):
        sys.exit(f"--switches: unknown {', '.join(sorted(chosen - set(known)))}; allowed: {', '.join(known)}")
    only = set(filter(None, a.only.split(",")))
    unknown = only - {*MODELS, "offload"}
    if unknown:
        sys.exit(f"--only: unknown {', '.join(sorted(unknown))}; allowed: {', '.join([*MODELS, 'offload'])}")
    models = [m for m in MODELS if m in only] or list(MODELS)
    rows: list[dict] = []
    env = environment()
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    suffix = "".join(f"_{key}" for key in sorted(only))  # a partial run does not overwrite the full table
    suffix += "_capped" if a.cap_activations > 0 else ""

    def save() -> None:  # after every row: a run cut short by a time limit keeps what it measured
        write_result(f"memory{suffix}_{env['device'].replace(' ', '-')}.json", {**env, "rows": rows}, out)

    for model in models:
        for name, sargs in {**SWITCHES, **EXTRA.get(model, {})}.items():
            if ("offload" in only and name not in OFFLOAD_ROWS) or (chosen and name not in chosen | {"bf16"}):
                continue
            runs = [(name, None)]
            ref = next((x for x in rows if x["model"] == model and x["switch"] == "bf16" and "base_gib" in x), None)
            if a.cap_activations > 0 and name.startswith("offload streamed") and ref is not None:
                cap = ref["base_gib"] + a.cap_activations * ref["activation_gib"] + a.cap_slack
                runs.append((f"{name} @cap", cap))
            for label, cap in runs:
                r = run_row(MODELS[model], name, sargs, a.warmup, a.steps, cap_gib=cap)
                rows.append({"model": model, "switch": label, **r})
                print(f"{model} {label}: {r.get('tokens_per_s', 0):,.0f} tok/s, {r.get('peak_gib', 0):.1f} GiB "
                      f"peak, {r.get('activation_gib', 0):.1f} GiB act, {r['leftover_gib']:.1f} GiB left"
                      + (f", cap {cap:.1f} GiB" if cap else "") + f" {r.get('error', '')}", flush=True)
                save()
    print_table(rows)
    save()


if __name__ == "__main__":
    main()
