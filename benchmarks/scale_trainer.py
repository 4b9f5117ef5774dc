"""The trainer itself on several GPUs: `torchrun ... -m tracetrain.cli train` end to end, as a user runs it.

Unlike benchmarks/scale.py (which times `parallel.testing.run_step` on random rows), every case here is
the real `tracetrain train` job: data loader, packing, the CUDA defaults (regional torch.compile,
FlexAttention with document masks, chunked fused cross-entropy), fused AdamW, gradient clipping, the
metrics' once-per-interval host sync. Throughput is what the trainer itself logs (metrics.jsonl:
tokens/s per GPU over each log interval, wall clock); this script takes the median over the intervals
after the first `--warmup-intervals` (compile and allocator warm-up), and the peak memory as the
maximum over ranks (rank 0's metrics.jsonl and the others' logs/metrics_rank<R>.jsonl).

Data: tinyshakespeare with the GPT-2 tokenizer, packed into full rows (one long document, so attention
is the full causal square the FLOP count assumes). Both come from ../shared/data, carried as
.carry/data on the GPU machine; `--data-dir` points at them.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python3 benchmarks/scale_trainer.py --out $OUT --data-dir .carry/data [--cases a,b] [--budget-s 540]

SCALE_DRY_RUN=1 runs the same flow on the CPU (gloo, tiny model) to check it before a GPU call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402

DRY_RUN = os.environ.get("SCALE_DRY_RUN") == "1"
DRY_SHAPE = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
             "--model.ffn_dim=128", "--data.seq_len=64", "--train.compile=off"]

L1B = ["--model.preset=llama3.2-1b"]
L8B = ["--model.preset=llama3-8b"]

# name -> (GPUs, overrides, micro_batch_size per data-parallel rank, steps)
CASES: dict[str, tuple[int, list[str], int, int]] = {
    "1b_1gpu": (1, L1B, 4, 30),
    "1b_fsdp4": (4, L1B + ["--parallel.dp_shard=4"], 4, 30),
    "8b_fsdp4": (4, L8B + ["--parallel.dp_shard=4"], 2, 30),
    "8b_fsdp4_mbs4": (4, L8B + ["--parallel.dp_shard=4"], 4, 30),
    "8b_fsdp4_eager": (4, L8B + ["--parallel.dp_shard=4", "--train.compile=off"], 2, 30),
    "8b_fsdp2_tp2": (4, L8B + ["--parallel.dp_shard=2", "--parallel.tp=2"], 4, 20),
    "8b_pp2_fsdp2": (4, L8B + ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.pp_microbatches=4"], 4, 20),
    "moe_ep4": (4, ["--model.preset=llama3.2-1b", "--model.n_layers=8", "--model.ffn_dim=2048", "--model.num_experts=8",
                    "--model.experts_top_k=2", "--parallel.dp_shard=4", "--parallel.ep=4"], 4, 30),
}


def read_intervals(run_dir: Path) -> list[dict]:
    """One record per logged interval of rank 0 (the trainer writes every step of it with equal values)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tokens_per_s" in r]
    out, seen = [], set()
    for r in rows:
        key = (r["tokens_per_s"], r["step_s"])
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def peak_over_ranks(run_dir: Path) -> float | None:
    files = [run_dir / "metrics.jsonl", *sorted((run_dir / "logs").glob("metrics_rank*.jsonl"))]
    peaks = []
    for f in files:
        if f.is_file():
            for line in f.read_text().splitlines():
                r = json.loads(line)
                if "mem_peak_alloc_gib" in r:
                    peaks.append(r["mem_peak_alloc_gib"])
    return max(peaks) if peaks else None


def run_case(name: str, a: argparse.Namespace, work: Path, deadline: float) -> dict:
    gpus, overrides, mbs, steps = CASES[name]
    if DRY_RUN:  # the same layouts as CPU processes (gloo), a tiny model
        steps = 6
        overrides = [o for o in overrides if not o.startswith(("--model.n_layers", "--model.ffn_dim"))] + DRY_SHAPE
    interval = 2 if DRY_RUN else 5
    data = Path(a.data_dir)
    args = [*overrides, "--data.kind=text", f"--data.path={data / 'tinyshakespeare.txt'}",
            f"--data.tokenizer={data / 'gpt2_tokenizer.json'}", "--data.pack=true",
            f"--train.micro_batch_size={mbs}", f"--train.steps={steps}", f"--logging.log_interval={interval}",
            "--logging.progress=false", "--train.eval_interval=0", "--train.eval_batches=1",
            "--train.eval_generate=0", "--checkpoint.save_final=false", "--data.eval_fraction=0.01",
            f"--train.output_dir={work}", f"--train.run_name={name}"]
    if not DRY_RUN:
        args.append("--data.seq_len=2048")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
           "-m", "tracetrain.cli", "train", *args]
    left = deadline - time.time()
    if left < 60:
        return {"case": name, "gpus": gpus, "status": "skipped: benchmark time budget spent"}
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
    except subprocess.TimeoutExpired:
        return {"case": name, "gpus": gpus, "status": f"timed out after {left:.0f} s"}
    wall = time.time() - t0
    run_dir = work / name
    if proc.returncode != 0:
        tail = (proc.stdout[-1500:] + proc.stderr[-2500:]).strip()
        status = "OOM" if "out of memory" in tail.lower() else f"failed (exit {proc.returncode})"
        print(f"--- {name}: {status}\n{tail}\n---", flush=True)
        return {"case": name, "gpus": gpus, "status": status, "wall_s": wall}
    intervals = read_intervals(run_dir)
    timed = intervals[a.warmup_intervals:] or intervals[-1:]
    step_s = statistics.median(r["step_s"] for r in timed)
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    return {"case": name, "gpus": gpus, "status": "ok", "overrides": overrides, "micro_batch_per_rank": mbs,
            "seq": 64 if DRY_RUN else 2048, "steps": steps, "timed_steps": len(timed) * interval,
            "step_s_median": step_s, "tokens_per_s_per_gpu": tps,
            "mfu": statistics.median(mfus) if mfus else None, "peak_gib": peak_over_ranks(run_dir),
            "final_loss": summary.get("final_loss", intervals[-1]["loss"] if intervals else None), "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--warmup-intervals", type=int, default=2)
    p.add_argument("--results-tag", default="", help="write scale_trainer_<gpu>_<tag>.json (keeps the main file)")
    a = p.parse_args()
    data = Path(a.data_dir)
    for f in ("tinyshakespeare.txt", "gpt2_tokenizer.json"):
        if not (data / f).is_file():
            sys.exit(f"error: {data / f} is missing (--data-dir must hold tinyshakespeare.txt and gpt2_tokenizer.json)")
    names = [c for c in a.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        sys.exit(f"error: unknown case(s) {unknown}; known: {', '.join(CASES)}")
    ngpu = 0 if DRY_RUN else torch.cuda.device_count()
    deadline = time.time() + a.budget_s
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            if not DRY_RUN and CASES[name][0] > ngpu:
                rows.append({"case": name, "gpus": CASES[name][0], "status": f"skipped: needs {CASES[name][0]} GPUs"})
                continue
            rows.append(run_case(name, a, Path(tmp), deadline))
            r = rows[-1]
            print(f"{name:18s} {r['status']:10s} " + (f"{r['tokens_per_s_per_gpu']:9.0f} tok/s/GPU  "
                  f"MFU {100 * (r['mfu'] or 0):5.1f}%  peak {r['peak_gib'] or 0:6.1f} GiB  step {r['step_s_median']:.3f} s"
                  if r["status"] == "ok" else ""), flush=True)
    one = next((r for r in rows if r["case"] == "1b_1gpu" and r["status"] == "ok"), None)
    for r in rows:
        if one and r["status"] == "ok" and r["case"].startswith("1b_") and r["gpus"] > 1:
            r["scaling_efficiency"] = r["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
    print("\n| case | GPUs | tok/s/GPU | MFU | peak GiB | step s | scaling |\n|---|---|---|---|---|---|---|")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['case']} | {r['gpus']} | {r['status']} | | | | |")
            continue
        eff = f"{100 * r['scaling_efficiency']:.1f}%" if "scaling_efficiency" in r else ""
        print(f"| {r['case']} | {r['gpus']} | {r['tokens_per_s_per_gpu']:.0f} | "
              f"{100 * (r['mfu'] or 0):.1f}% | {r['peak_gib'] or 0:.1f} | {r['step_s_median']:.3f} | {eff} |")
    result = {**environment(), "benchmark": "scale_trainer", "dry_run": DRY_RUN, "rows": rows}
    if not DRY_RUN:
        tag = f"_{a.results_tag}" if a.results_tag else ""
        name = f"scale_trainer_{result['device'].replace(' ', '-')}{tag}.json"
        write_result(name, result, Path(a.out) if a.out else None)


if __name__ == "__main__":
    main()
