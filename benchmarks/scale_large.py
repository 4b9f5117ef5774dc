"""Large models on several GPUs through the real trainer, with the planner's prediction beside each row.

Every case is one `tracetrain train` job (`torch.distributed.run -m tracetrain.cli train`, its own
processes: an out-of-memory case is a row with the trainer's one-line message, not the end of the
matrix): random init from the preset, generated text (written here, no download), byte tokenizer,
packed into full 2048-token rows of one document (so attention is the full causal square that the
FLOP counts assume). Measured, from the trainer's own metrics.jsonl (rank 0) and
logs/metrics_rank<R>.jsonl: tokens/s per GPU and MFU (median over the steps after the warm-up, at
least 10 timed), step time, and the peak allocated / reserved GiB per GPU (the maximum over ranks of
torch.cuda.max_memory_allocated / reserved, the build included). Planned, from the same overrides
through the same resolve (`plan_input_from_config`): peak memory (the largest of build and step),
step time, tokens/s per GPU and MFU, and the errors in %. A case the planner says does not fit is
recorded with its advice and not run, unless --run-unfit (then it runs, to check the verdict).

    torchrun --nproc-per-node=2 benchmarks/scale_large.py [--cases 70b_lora_fsdp,8b_full_tp2] [--out $OUT]
    python3 benchmarks/scale_large.py --gpus 2 ...           # the same without the outer torchrun
    ... --peers   # also torchtitan 0.3.0 (benchmarks/peers/torchtitan_multi.py) beside the 8B rows;
                  # needs PEERSITE (../shared/peers/fetch_peer_wheels.sh) and adds ~2 min a row

Default matrix, by GPU count N: llama3-70b LoRA r16 q/k/v/o FSDP N (1 x 2048, full recompute),
llama3-8b full FSDP N (2 x 2048, full recompute, compile as the trainer picks), llama3-8b full TP 2
(x FSDP N/2), and with N >= 4 llama3-70b full FSDP N with parallel.fsdp_cpu_offload. On 2 H200s the
first three take about 6 minutes. Writes benchmarks/results/scale_large_<device>.json: rows as in
peers_<device>.json (device, torch, commit, date on each). SCALE_DRY_RUN=1: the same flow on the CPU
(gloo, a tiny model) to check it before a GPU call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from common import write_result  # noqa: E402

DRY_RUN = os.environ.get("SCALE_DRY_RUN") == "1"
DRY_SHAPE = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
             "--model.ffn_dim=128", "--model.vocab_size=512", "--train.compile=off"]
SEQ = 64 if DRY_RUN else 2048
LORA_QKVO = ["--train.mode=lora", "--lora.rank=16", '--lora.targets=["q_proj","k_proj","v_proj","o_proj"]']
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# torchrun's per-worker variables: the cases start their own torchrun, which must not inherit ours.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def cases(n: int) -> dict[str, dict]:
    """name -> overrides (without data and run paths), warm-up and timed steps, peer arguments."""
    rec = ["--memory.recompute=full", f"--data.seq_len={SEQ}"]
    out = {
        "70b_lora_fsdp": {"overrides": ["--model.preset=llama3-70b", *LORA_QKVO, f"--parallel.dp_shard={n}",
                                        "--train.micro_batch_size=1", *rec], "warmup": 4, "timed": 10},
        "8b_full_fsdp": {"overrides": ["--model.preset=llama3-8b", f"--parallel.dp_shard={n}",
                                       "--train.micro_batch_size=2", *rec], "warmup": 5, "timed": 12,
                         "peer": ["--flavour", "8B", "--batch", "2", "--ac", "full", "--dp-shard", str(n)]},
        "8b_full_tp2": {"overrides": ["--model.preset=llama3-8b", "--parallel.tp=2", f"--parallel.dp_shard={n // 2}",
                                      "--train.micro_batch_size=2", *rec], "warmup": 5, "timed": 12,
                        "peer": ["--flavour", "8B", "--batch", "2", "--ac", "full", "--tp", "2",
                                 "--dp-shard", str(n // 2)]},
    }
    if n >= 4:
        out["70b_full_fsdp_offload"] = {
            "overrides": ["--model.preset=llama3-70b", f"--parallel.dp_shard={n}", "--parallel.fsdp_cpu_offload=true",
                          "--train.micro_batch_size=1", *rec], "warmup": 3, "timed": 10}
    if DRY_RUN:
        for c in out.values():
            c["overrides"] = [o for o in c["overrides"] if not o.startswith("--model.preset")] + DRY_SHAPE
            c["overrides"].insert(0, "--model.preset=llama3.2-1b")
            c["warmup"], c["timed"] = 1, 3
    return out


def write_text(path: Path, num_chars: int, seed: int = 0) -> None:
    """One long document of seeded pseudo-words (byte tokenizer: one token a character)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(4096)]
    parts, size = [], 0
    while size < num_chars:
        line = " ".join(rng.choice(words) for _ in range(12)) + ".\n"
        parts.append(line)
        size += len(line)
    path.write_text("".join(parts))


def planned(overrides: list[str], gpus: int, device: str) -> dict:
    """The planner's prediction for the same config, through the trainer's resolve."""
    from tracetrain.config import load_config
    from tracetrain.plan import plan, plan_input_from_config

    inp = plan_input_from_config(load_config(None, overrides), gpus, device)
    host = host_memory_gib()
    p = plan(inp.replace(host_memory_gib=host) if host and not DRY_RUN else inp)  # this node's, not 1 TiB
    m, gib = p.memory, 2**30
    return {"fits": p.fits, "peak_gib": m.peak_bytes / gib, "peak_phase": m.peak_phase,
            "build_peak_gib": m.build_peak_bytes / gib, "step_peak_gib": m.step_peak_bytes / gib,
            "required_gib": m.required_bytes / gib, "capacity_gib": m.capacity_bytes / gib,
            "host_gib_per_node": m.host_bytes_per_node / gib, "step_s": p.step_s,
            "tokens_per_s_per_gpu": p.tokens_per_s / p.input.num_gpus, "mfu": p.mfu, "layout": p.layout(),
            "advice": p.advice}


def environment_elsewhere() -> dict:
    """common.environment() read in a child process: the device name needs CUDA, and a CUDA context
    held by this driver for the whole matrix would take GPU 0's memory from every case."""
    code = "import json, sys; sys.path.insert(0, 'benchmarks'); from common import environment; print(json.dumps(environment()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def host_memory_gib() -> float | None:
    """This machine's memory (MemTotal), where parallel.fsdp_cpu_offload keeps the shards."""
    try:
        kib = next(int(ln.split()[1]) for ln in open("/proc/meminfo") if ln.startswith("MemTotal:"))
    except (OSError, StopIteration):
        return None
    return kib / 2**20


def train_records(run_dir: Path) -> list[list[dict]]:
    """Per rank, the per-step training records of metrics.jsonl (rank 0) and logs/metrics_rank<R>.jsonl."""
    files = [run_dir / "metrics.jsonl", *sorted((run_dir / "logs").glob("metrics_rank*.jsonl"))]
    out = []
    for f in files:
        if f.is_file():
            rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            out.append([r for r in rows if r.get("kind") == "train"])
    return out


def one_line(text: str) -> str:
    """The trainer's own error line (an out-of-memory names its phase), else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for wanted in (lambda ln: "out of memory" in ln.lower(), lambda ln: ln.startswith("error:")):
        found = [ln for ln in lines if wanted(ln)]
        if found:
            return found[-1][:400]
    return lines[-1][:400] if lines else ""


def run_case(name: str, case: dict, n: int, data: Path, work: Path, deadline: float) -> dict:
    steps = case["warmup"] + case["timed"]
    args = [*case["overrides"], "--data.kind=text", f"--data.path={data}", "--data.tokenizer=byte",
            "--data.pack=true", f"--train.steps={steps}", f"--optim.warmup_steps={min(10, steps - 1)}", "--logging.log_interval=5", "--logging.progress=false",
            "--train.eval_interval=0", "--train.eval_batches=1", "--train.eval_generate=0",
            "--checkpoint.save_final=false", "--data.eval_fraction=0.01", f"--train.output_dir={work}",
            f"--train.run_name={name}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           "-m", "tracetrain.cli", "train", *args]
    left = deadline - time.time()
    if left < 60:
        return {"status": "skipped: benchmark time budget spent"}
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    env.update({k: env.get(k, v) for k, v in NCCL_ENV.items()}, PYTHONPATH=str(ROOT))
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"status": f"timed out after {left:.0f} s"}
    row: dict = {"wall_s": round(time.time() - t0, 1)}
    if proc.returncode != 0:
        text = proc.stdout[-3000:] + "\n" + proc.stderr[-6000:]
        oom = "out of memory" in text.lower()
        print(f"--- {name}: exit {proc.returncode}\n{text[-2500:]}\n---", flush=True)
        return {**row, "status": "OOM" if oom else f"failed (exit {proc.returncode})", "message": one_line(text)}
    ranks = train_records(work / name)
    timed = [r for r in ranks[0] if r["step"] > case["warmup"]]
    step_s = [r["step_s"] for r in timed]
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    last = [rs[-1] for rs in ranks if rs]
    return {**row, "status": "ok", "timed_steps": len(timed), "step_s_all": step_s,
            "step_s_median": statistics.median(step_s),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "mfu": statistics.median(mfus) if mfus else None,
            "peak_gib": max(r.get("mem_peak_alloc_gib", r.get("mem_peak_rss_gib", 0)) for r in last),
            "peak_reserved_gib": max(r.get("mem_peak_reserved_gib", 0) for r in last),
            "loss_last": timed[-1]["loss"] if timed else None}


def run_peer(case: dict, n: int, data: Path, deadline: float) -> dict | None:
    """torchtitan 0.3.0 on the same GPUs with the same batch, sequence and recompute (benchmarks/peers/)."""
    site = os.environ.get("PEERSITE")
    if "peer" not in case or not site or deadline - time.time() < 120:
        return None
    script = ROOT / "benchmarks" / "peers" / "torchtitan_multi.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", str(script),
           "--data", str(data), "--seq", str(SEQ), "--steps", "20", "--skip", "8", "--no-cudagraphs", *case["peer"]]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("TORCHELASTIC_")}
    env.update({k: env.get(k, v) for k, v in NCCL_ENV.items()}, PYTHONPATH=site)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=deadline - time.time(), env=env)
    except subprocess.TimeoutExpired:
        return {"status": "timed out"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return {"status": "ok", **json.loads(line)}
    return {"status": f"failed (exit {proc.returncode})", "message": one_line(proc.stdout + proc.stderr)}


def error_pct(measured: float | None, plan_value: float) -> float | None:
    return None if not measured else round(100 * (plan_value - measured) / measured, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=int(os.environ.get("WORLD_SIZE", "0")) or None,
                   help="GPUs per case (default: the outer torchrun's world size, else every visible GPU)")
    p.add_argument("--cases", default="", help="comma-separated case names (default: the matrix for --gpus)")
    p.add_argument("--out", default=None, help="also write the JSON here (the device tool's $OUT)")
    p.add_argument("--budget-s", type=float, default=480.0)
    p.add_argument("--run-unfit", action="store_true", help="run the cases the planner says do not fit")
    p.add_argument("--peers", action="store_true", help="torchtitan beside the 8B rows (needs PEERSITE)")
    a = p.parse_args()
    if int(os.environ.get("RANK", "0")) != 0:
        return  # under an outer torchrun only rank 0 drives; each case starts its own ranks
    n = a.gpus or (2 if DRY_RUN else torch.cuda.device_count())  # (counts without a CUDA context)
    matrix = cases(n)
    names = [c for c in a.cases.split(",") if c] or list(matrix)
    unknown = [c for c in names if c not in matrix]
    if unknown:
        sys.exit(f"error: unknown case(s) {unknown} for {n} GPUs; known: {', '.join(matrix)}")
    env = environment_elsewhere()
    device = "h200" if DRY_RUN else env["device"]
    call = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    deadline = time.time() + a.budget_s
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "generated.txt"
        write_text(data, 2_000_000)
        for name in names:
            case = matrix[name]
            overrides = case["overrides"]
            plan_row = planned(overrides, n, device)
            row = {"system": "tracetrain", "case": name, "gpus": n, "layout": plan_row["layout"],
                   "overrides": overrides, "batch": next(int(o.split("=")[1]) for o in overrides
                                                         if o.startswith("--train.micro_batch_size")),
                   "seq": SEQ, "tokens_per_s_is_per_gpu": True, "planned": plan_row}
            if plan_row["fits"] or a.run_unfit:
                row.update(run_case(name, case, n, data, Path(tmp), deadline))
            else:
                row["status"] = "not run: the planner says it does not fit (--run-unfit runs it)"
            if row["status"] == "ok":
                row["error_pct"] = {"peak_memory": error_pct(row["peak_gib"], plan_row["peak_gib"]),
                                    "step_time": error_pct(row["step_s_median"], plan_row["step_s"]),
                                    "tokens_per_s": error_pct(row["tokens_per_s"], plan_row["tokens_per_s_per_gpu"])}
            rows.append({**row, **env, "call": call, "dry_run": DRY_RUN})
            print_row(rows[-1])
            if a.peers and row["status"] == "ok":
                peer = run_peer(case, n, data, deadline)
                if peer is not None:
                    peer_row = {"system": "torchtitan 0.3.0 (--no-cudagraphs, --ac full)", "case": name, "gpus": n,
                                **peer, "vs_tracetrain": (row["tokens_per_s"] / peer["tokens_per_s"]
                                                          if peer.get("tokens_per_s") else None)}
                    rows.append({**peer_row, **env, "call": call})
                    print_row(rows[-1])
    print_table(rows)
    if not DRY_RUN:
        write_result(f"scale_large_{env['device'].replace(' ', '-')}.json", rows, Path(a.out) if a.out else None)


def print_row(r: dict) -> None:
    if r.get("status") != "ok":
        print(f"{r['case']:24s} {r['system'][:12]:12s} {r.get('status')}  {r.get('message', '')}", flush=True)
        return
    print(f"{r['case']:24s} {r['system'][:12]:12s} {r['tokens_per_s']:9.0f} tok/s/GPU  MFU {100 * (r.get('mfu') or 0):5.1f}%"
          f"  peak {r.get('peak_gib') or 0:6.1f} GiB", flush=True)


def print_table(rows: list[dict]) -> None:
    print("\n| case | system | GPUs | tok/s/GPU | MFU | peak GiB | planned GiB (err) | step s | planned s (err) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pl, err = r.get("planned", {}), r.get("error_pct", {})
        if r.get("status") != "ok":
            verdict = f"planned {pl.get('required_gib', 0):.1f} GiB, fits={pl.get('fits')}" if pl else ""
            print(f"| {r['case']} | {r['system']} | {r['gpus']} | {r.get('status')} {r.get('message', '')} | | | "
                  f"{verdict} | | |")
            continue
        mem = f"{pl['peak_gib']:.1f} ({err['peak_memory']:+.1f}%)" if pl else ""
        step = f"{pl['step_s']:.3f} ({err['step_time']:+.1f}%)" if pl else ""
        measured_step = f"{r['step_s_median']:.3f}" if "step_s_median" in r else ""
        print(f"| {r['case']} | {r['system']} | {r['gpus']} | {r['tokens_per_s']:.0f} | {100 * (r.get('mfu') or 0):.1f}% | "
              f"{r.get('peak_gib') or 0:.1f} | {mem} | {measured_step} | {step} |")


if __name__ == "__main__":
    main()
