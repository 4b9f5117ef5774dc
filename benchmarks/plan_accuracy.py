"""How close is the planner? Runs a grid of single-GPU configurations with the REAL trainer step and
compares the plan's peak memory and step time with what the GPU measures.

Each case builds the model as `tracetrain train` does (`build_model`, `build_optimizer`, `train_step`
on random full-length rows, no packing), resets the allocator's peak, runs 3 warm-up and 10 timed
steps, and records torch.cuda.max_memory_allocated and the median step time (CUDA events). Cases that
need an option the trainer does not implement yet (recomputation, offload: tracetrain.memory.*) are
skipped with the reason. `--profile CASE,...` also captures 2 steps with the torch profiler and splits
kernel time into the planner's kinds (GEMM, attention, optimizer, memory-bound), to see which part of
the time model misses. Prints a table; writes plan_accuracy_<gpu>.json (and a copy under $OUT).

  python3 benchmarks/plan_accuracy.py                       # whole grid, < 7 minutes on an H100
  python3 benchmarks/plan_accuracy.py --cases 1b-full-b4 --profile 1b-full-b4
  python3 benchmarks/plan_accuracy.py --rescore benchmarks/results/plan_accuracy_NVIDIA-H200.json  # no GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, median, time_steps, write_result  # noqa: E402

from tracetrain.config import load_config  # noqa: E402
from tracetrain.train.assemble import assemble, run_step_context  # noqa: E402
from tracetrain.spec import resolve  # noqa: E402
from tracetrain.plan import plan, plan_input_from_config  # noqa: E402
from tracetrain.train.step import StepContext, train_step  # noqa: E402

QKVO = '["q_proj","k_proj","v_proj","o_proj"]'
# name -> config overrides (precision defaults to bf16; no packing).
CASES: dict[str, list[str]] = {
    "1b-full-b4": ["--model.preset=llama3.2-1b", "--train.micro_batch_size=4", "--data.seq_len=2048"],
    "1b-full-b2": ["--model.preset=llama3.2-1b", "--train.micro_batch_size=2", "--data.seq_len=2048"],
    "1b-full-b1": ["--model.preset=llama3.2-1b", "--train.micro_batch_size=1", "--data.seq_len=2048"],
    "1b-full-b8-s1024": ["--model.preset=llama3.2-1b", "--train.micro_batch_size=8", "--data.seq_len=1024"],
    "1b-full-b4-ga2": ["--model.preset=llama3.2-1b", "--train.micro_batch_size=4", "--data.seq_len=2048",
                       "--train.grad_accum_steps=2"],
    "1b-full-fp32-b1-s1024": ["--model.preset=llama3.2-1b", "--train.micro_batch_size=1", "--data.seq_len=1024",
                              "--train.precision=fp32"],
    "1b-lora-b4": ["--model.preset=llama3.2-1b", "--train.mode=lora", "--train.micro_batch_size=4", "--data.seq_len=2048"],
    "1b-lora-all-b4": ["--model.preset=llama3.2-1b", "--train.mode=lora", "--train.micro_batch_size=4",
                       "--data.seq_len=2048", '--lora.targets=["all-linear"]'],
    "1b-full-b4-recompute-full": ["--model.preset=llama3.2-1b", "--train.micro_batch_size=4", "--data.seq_len=2048",
                                  "--memory.recompute=full"],
    "1b-full-b4-recompute-sel": ["--model.preset=llama3.2-1b", "--train.micro_batch_size=4", "--data.seq_len=2048",
                                 "--memory.recompute=selective"],
    "7b-lora-b4": ["--model.preset=llama2-7b", "--train.mode=lora", "--train.micro_batch_size=4", "--data.seq_len=2048",
                   f"--lora.targets={QKVO}"],
    "7b-lora-b2": ["--model.preset=llama2-7b", "--train.mode=lora", "--train.micro_batch_size=2", "--data.seq_len=2048"],
    "7b-lora-all-b2": ["--model.preset=llama2-7b", "--train.mode=lora", "--train.micro_batch_size=2",
                       "--data.seq_len=2048", '--lora.targets=["all-linear"]'],
    "7b-8layer-lora-fp32base-b2": ["--model.preset=llama2-7b", "--model.n_layers=8", "--train.mode=lora",
                            "--lora.base_dtype=fp32", "--train.micro_batch_size=2", "--data.seq_len=2048"],
    "7b-4layer-full-b4": ["--model.preset=llama2-7b", "--model.n_layers=4", "--train.micro_batch_size=4",
                          "--data.seq_len=2048"],
    "7b-4layer-full-b2-s4096": ["--model.preset=llama2-7b", "--model.n_layers=4", "--train.micro_batch_size=2",
                                "--data.seq_len=4096"],
    "7b-4layer-full-fp32-b1-s1024": ["--model.preset=llama2-7b", "--model.n_layers=4", "--train.micro_batch_size=1",
                                     "--data.seq_len=1024", "--train.precision=fp32"],
    "1b-full-b1-s8192": ["--model.preset=llama3.2-1b", "--train.micro_batch_size=1", "--data.seq_len=8192"],
    "1b-lora-b8-recompute-full-every2": ["--model.preset=llama3.2-1b", "--train.mode=lora", "--train.micro_batch_size=8",
                                         "--data.seq_len=2048", "--memory.recompute=full", "--memory.recompute_every=2"],
    "7b-lora-b4-offload": ["--model.preset=llama2-7b", "--train.mode=lora", "--train.micro_batch_size=4",
                           "--data.seq_len=2048", "--memory.activation_offload=streamed"],
}


# The grid was measured on the eager path (before compile, FlexAttention and the fused lm_head + CE
# existed); every case keeps it, so re-runs and the offline re-score compare like with like.
EAGER = ["--train.compile=off", "--train.fused_kernels=off", "--train.attention=sdpa", "--train.fused_ce=false"]


def case_config(overrides: list[str]):
    return load_config(None, [*overrides, *EAGER, "--data.pack=false", "--train.device=cuda"]
                       + ([] if any(o.startswith("--train.precision") for o in overrides) else ["--train.precision=bf16"]))


def rescore(path: Path) -> None:
    """Offline: plan every measured row of a committed results JSON again and print the errors."""
    data = json.loads(path.read_text())
    print(f"{'case':<34} {'pred GiB':>9} {'meas GiB':>9} {'err':>7} {'pred s':>8} {'meas s':>8} {'err':>7}  goal")
    ok = 0
    rows = [r for r in data["rows"] if "step_s" in r]
    for r in rows:
        p = plan(plan_input_from_config(case_config(r["overrides"]), 1, data["device"]))
        mem, step = p.peak_gib / r["peak_gib"] - 1, p.step_s / r["step_s"] - 1
        good = abs(mem) <= 0.10 and abs(step) <= 0.25
        ok += good
        print(f"{r['case']:<34} {p.peak_gib:>9.2f} {r['peak_gib']:>9.2f} {100 * mem:>+6.1f}% {p.step_s:>8.4f} "
              f"{r['step_s']:>8.4f} {100 * step:>+6.1f}%  {'yes' if good else 'MISS'}")
    print(f"{ok} of {len(rows)} rows within memory ±10% and time ±25%")


def missing_feature(overrides: list[str]) -> str | None:
    """Why a case cannot run with today's trainer, or None. Recomputation needs
    tracetrain.memory.recompute.apply_recompute; activation offload also needs a hook in the step."""
    for arg in overrides:
        if arg.startswith("--memory.recompute") and importlib.util.find_spec("tracetrain.memory.recompute") is None:
            return "memory.recompute needs tracetrain.memory.recompute, not implemented yet"
        if arg.startswith("--memory.activation_offload"):
            if importlib.util.find_spec("tracetrain.memory.activation_offload") is None:
                return "memory.activation_offload needs tracetrain.memory.activation_offload"
            if not any("offload" in f for f in StepContext.__dataclass_fields__):
                return "train_step has no activation-offload context yet"
    return None


def make_batch(vocab: int, batch: int, seq: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, vocab, (batch, seq + 1))
    b = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
         "position_ids": torch.arange(seq).expand(batch, -1).contiguous(),
         "document_ids": torch.zeros(batch, seq, dtype=torch.long)}
    return {k: v.pin_memory() for k, v in b.items()}


def run_case(name: str, overrides: list[str], warmup: int, steps: int, profile: bool) -> dict:
    cfg = case_config(overrides)
    device = torch.device("cuda")
    inp = plan_input_from_config(cfg, 1, torch.cuda.get_device_name(0))
    predicted = plan(inp)
    built = assemble(resolve(cfg, device))  # the trainer's path: spec, transform table, optimizer
    model, opt = built.module, built.optimizer
    # make_batch's rows are unpacked (one document each): no document mask.
    ctx = dataclasses.replace(run_step_context(built), use_document_mask=False)
    mbs = [make_batch(model.args.vocab_size, cfg.train.micro_batch_size, cfg.data.seq_len)
           for _ in range(cfg.train.grad_accum_steps)]
    torch.cuda.reset_peak_memory_stats()
    times = time_steps(lambda: train_step(model, opt, mbs, ctx), warmup, steps)
    row = {"case": name, "overrides": overrides, "step_s": median(times),
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
           "reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
           "pred_step_s": predicted.step_s, "pred_peak_gib": predicted.peak_gib,
           "pred_required_gib": predicted.memory.required_bytes / 2**30,
           "pred_peak_phase": predicted.memory.peak_phase, "pred_time_s": predicted.time.breakdown}
    row["mem_err"] = row["pred_peak_gib"] / row["peak_gib"] - 1
    row["time_err"] = row["pred_step_s"] / row["step_s"] - 1
    if profile:
        row["kernels_s"] = profile_kinds(lambda: train_step(model, opt, mbs, ctx))
    del model, opt, mbs
    gc.collect()
    torch.cuda.empty_cache()
    return row


KINDS = [("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
         ("GEMM", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|sm90_|sm80_", re.I)),
         ("optimizer", re.compile(r"adam|multi_tensor", re.I))]


def profile_kinds(step, num_steps: int = 2) -> dict[str, float]:
    """GPU kernel seconds per step by kind (the rest is memory-bound), plus the kernel count."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    out: dict[str, float] = {"GEMM": 0.0, "attention": 0.0, "optimizer": 0.0, "memory-bound": 0.0, "kernels": 0.0}
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memset", "gpu_memcpy"):
            continue
        kind = next((k for k, rx in KINDS if rx.search(e["name"])), "memory-bound")
        out[kind] += e["dur"] / 1e6 / num_steps
        out["kernels"] += 1 / num_steps
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--profile", default="", help="comma-separated cases to profile by kernel kind")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rescore", type=Path, help="offline: re-plan the rows of this results JSON, no GPU")
    a = ap.parse_args()
    if a.rescore:
        rescore(a.rescore)
        return
    env, rows = environment(), []
    profiled = set(filter(None, a.profile.split(",")))
    for name in a.cases.split(","):
        why = missing_feature(CASES[name])
        if why:
            print(f"{name}: skipped ({why})", flush=True)
            rows.append({"case": name, "skipped": why})
            continue
        try:
            row = run_case(name, CASES[name], a.warmup, a.steps, name in profiled)
        except torch.OutOfMemoryError as e:
            row = {"case": name, "error": f"out of memory: {str(e)[:120]}"}
            gc.collect()
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "overrides"}), flush=True)
    print(f"\n{'case':<26} {'pred GiB':>9} {'meas GiB':>9} {'err':>7} {'pred s':>8} {'meas s':>8} {'err':>7}")
    for r in rows:
        if "step_s" not in r:
            print(f"{r['case']:<26} {r.get('skipped') or r.get('error')}")
            continue
        print(f"{r['case']:<26} {r['pred_peak_gib']:>9.2f} {r['peak_gib']:>9.2f} {100 * r['mem_err']:>+6.1f}% "
              f"{r['pred_step_s']:>8.4f} {r['step_s']:>8.4f} {100 * r['time_err']:>+6.1f}%")
        if "kernels_s" in r:
            k, p = r["kernels_s"], r["pred_time_s"]
            pm = sum(v for n, v in p.items() if n in ("memory-bound", "weight casts", "grad accumulation"))
            print(f"    kernels: GEMM {k['GEMM']:.4f} (pred {p.get('GEMM', 0):.4f})  attention {k['attention']:.4f} "
                  f"(pred {p.get('attention', 0):.4f})  optimizer {k['optimizer']:.4f} (pred {p.get('optimizer', 0):.4f})"
                  f"  memory-bound {k['memory-bound']:.4f} (pred {pm:.4f})  kernels/step {k['kernels']:.0f}")
    gpu = env["device"].replace(" ", "-").replace("/", "-")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    write_result(f"plan_accuracy_{gpu}.json", {**env, "rows": rows}, out)


if __name__ == "__main__":
    main()
