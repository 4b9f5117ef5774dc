"""Multi-GPU scaling of tracetrain's parallel layouts: tokens/s per GPU, MFU, peak memory.

Driver (one device call): runs every group of cases as its own torchrun job, one after the other,
each with a time limit, and writes $OUT/scale_<gpu>.json (and benchmarks/results/):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        python3 benchmarks/scale.py --out $OUT [--groups 1b_1gpu,1b_2gpu,...] [--budget-s 540]

Worker (inside torchrun): `--group NAME --case-out DIR` runs that group's cases in one process group.

Every case: random full-length rows (no packing), bf16 (FSDP MixedPrecisionPolicy: bf16 params, fp32
reduce; autocast for TP/PP-only layouts), fused AdamW, gradient clipping, the step with every
ParallelModel hooks (the trainer's `train_step`, which runs the pipeline schedule for pp > 1),
3 warm-up steps, then the median of 10 timed steps (CUDA events). Tokens/s per GPU = rows * seq of
the global batch / step time / GPUs; MFU from the shared FLOP formula (models/accounting.py; for MoE
the active weights: top_k experts plus the router); peak memory = max over ranks of max_memory_allocated during
the timed steps (after the model was built and sharded). Eager mode (no torch.compile).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, median, time_steps, write_result  # noqa: E402

# SCALE_DRY_RUN=1: the same flow on CPU (gloo) with a tiny model, to check a change before a GPU call.
DRY_RUN = os.environ.get("SCALE_DRY_RUN") == "1"
DRY_SHAPE = ["--model.dim=64", "--model.n_layers=4", "--model.n_heads=8", "--model.n_kv_heads=4",
             "--model.ffn_dim=128", "--model.vocab_size=256"]

L1B = ["--model.preset=llama3.2-1b"]
L8B = ["--model.preset=llama3-8b"]
MOE = ["--model.preset=llama3.2-1b", "--model.n_layers=8", "--model.ffn_dim=2048", "--model.num_experts=8",
       "--model.experts_top_k=2"]

# group -> (GPUs, [(case, overrides, micro_batch_size per data-parallel rank, seq_len)])
GROUPS: dict[str, tuple[int, list[tuple[str, list[str], int, int]]]] = {
    "1b_1gpu": (1, [("llama3.2-1b single GPU", L1B, 4, 2048)]),
    "1b_2gpu": (2, [("llama3.2-1b FSDP dp_shard=2", L1B + ["--parallel.dp_shard=2"], 4, 2048)]),
    "dense_4gpu": (4, [
        ("llama3.2-1b FSDP dp_shard=4", L1B + ["--parallel.dp_shard=4"], 4, 2048),
        ("llama3.2-1b DDP dp_replicate=4", L1B + ["--parallel.dp_replicate=4"], 4, 2048),
        ("llama3-8b FSDP dp_shard=4", L8B + ["--parallel.dp_shard=4"], 2, 2048),
        ("llama3-8b TP=4", L8B + ["--parallel.tp=4"], 2, 2048),
        ("llama3-8b FSDP 2 x TP 2", L8B + ["--parallel.dp_shard=2", "--parallel.tp=2"], 2, 2048),
    ]),
    "pp_4gpu": (4, [
        ("llama3-8b PP=4 1F1B", L8B + ["--parallel.pp=4", "--parallel.pp_microbatches=8"], 8, 2048),
        ("llama3-8b PP=2 1F1B x FSDP 2", L8B + ["--parallel.pp=2", "--parallel.dp_shard=2",
                                               "--parallel.pp_microbatches=4"], 4, 2048),
    ]),
    "tp2_2gpu": (2, [("llama3-8b TP=2", L8B + ["--parallel.tp=2"], 2, 2048)]),
    "pp2_2gpu": (2, [("llama3-8b PP=2 1F1B", L8B + ["--parallel.pp=2", "--parallel.pp_microbatches=8"], 8, 2048)]),
    "pp_schedules_4gpu": (4, [
        ("llama3-8b PP=4 GPipe", L8B + ["--parallel.pp=4", "--parallel.pp_schedule=gpipe",
                                        "--parallel.pp_microbatches=8"], 8, 2048),
        ("llama3-8b PP=4 interleaved 1F1B (2 stages/rank)", L8B + [
            "--parallel.pp=4", "--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_microbatches=8"], 8, 2048),
        ("llama3-8b PP=2 GPipe x FSDP 2", L8B + ["--parallel.pp=2", "--parallel.dp_shard=2",
                                                 "--parallel.pp_schedule=gpipe", "--parallel.pp_microbatches=4"], 4, 2048),
        ("llama3-8b PP=2 interleaved 1F1B x FSDP 2", L8B + [
            "--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.pp_schedule=interleaved_1f1b",
            "--parallel.pp_microbatches=4"], 4, 2048),
    ]),
    "cp_4gpu": (4, [("llama3-8b CP=4 seq 32k (full recompute)", L8B + ["--parallel.cp=4", "--memory.recompute=full"],
                     1, 32768)]),
    "moe_4gpu": (4, [
        ("MoE 8x top-2 (1B-shaped, 8 layers) EP=4", MOE + ["--parallel.dp_shard=4", "--parallel.ep=4"], 4, 2048),
        ("MoE 8x top-2 (1B-shaped, 8 layers) FSDP, no EP", MOE + ["--parallel.dp_shard=4"], 4, 2048),
    ]),
}


def run_case(name: str, overrides: list[str], mbs: int, seq: int, warmup: int, steps: int) -> dict:
    from tracetrain.config import load_config
    from tracetrain.devices import peak_flops
    from tracetrain.models.accounting import training_flops_per_token
    from tracetrain.models.build import model_args_from_config
    from tracetrain.parallel.mesh import build_mesh, validate_parallel
    from tracetrain.spec import resolve
    from tracetrain.train.assemble import assemble, run_step_context
    from tracetrain.train.step import train_step

    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if DRY_RUN:
        overrides, seq = overrides + DRY_SHAPE, 64
    # The eager path: SDPA, no compile, no fused kernels or fused cross-entropy (what plan_vs_scale models).
    cfg = load_config(None, overrides + [f"--data.seq_len={seq}", f"--train.micro_batch_size={mbs}",
                                         "--data.pack=false", "--train.precision=bf16", "--train.compile=off",
                                         "--train.attention=sdpa", "--train.fused_kernels=off", "--train.fused_ce=false",
                                         f"--train.device={'cpu' if DRY_RUN else 'cuda'}"])
    args = model_args_from_config(cfg)
    validate_parallel(cfg, args, world)
    device = torch.device("cpu") if DRY_RUN else torch.device("cuda", torch.cuda.current_device())
    mesh = build_mesh(cfg.parallel, device.type) if world > 1 else None
    # The trainer's path: spec, the transform table (layout rows included), the optimizer, the real step.
    built = assemble(resolve(cfg, device, world, args), mesh)
    par = built.par
    ctx = run_step_context(built)
    rows = mbs * (par.dp_size if par is not None else 1)  # the global micro-batch; each rank takes its rows
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (rows, seq + 1), generator=gen)
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "position_ids": torch.arange(seq).expand(rows, -1).contiguous(),
             "document_ids": torch.zeros(rows, seq, dtype=torch.long)}
    if not DRY_RUN:
        batch = {k: v.pin_memory() for k, v in batch.items()}
    losses = []

    def step(model: torch.nn.Module = built.module, opt: torch.optim.Optimizer | None = built.optimizer) -> None:
        assert opt is not None
        losses.append(train_step(model, opt, [batch], ctx).loss)

    for _ in range(warmup):
        step()
    if DRY_RUN:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    else:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = time_steps(step, 0, steps)
    peak = torch.tensor([0.0 if DRY_RUN else torch.cuda.max_memory_allocated() / 2**30], device=device)
    if world > 1:
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    step_s = median(times)
    tokens_per_s_per_gpu = rows * seq / step_s / world
    flops = training_flops_per_token(args, seq, num_experts=cfg.model.num_experts,
                                     top_k=cfg.model.experts_top_k if cfg.model.num_experts else 0).model
    peak_fl = None if DRY_RUN else peak_flops(torch.cuda.get_device_name(0), "bf16")
    result = {"case": name, "gpus": world, "layout": {k: v for k, v in dataclasses.asdict(cfg.parallel).items()
                                                      if k in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep",
                                                               "zero_stage", "pp_schedule", "pp_microbatches")},
              "recompute": cfg.memory.recompute, "global_rows": rows, "seq": seq, "step_s_median": step_s,
              "step_s_all": times, "tokens_per_s_per_gpu": tokens_per_s_per_gpu,
              "tflops_per_gpu": tokens_per_s_per_gpu * flops / 1e12,
              "mfu": tokens_per_s_per_gpu * flops / peak_fl if peak_fl else None, "peak_gib": float(peak),
              "loss_first": float(losses[0]), "loss_last": float(losses[-1])}
    del par, built
    gc.collect()
    if not DRY_RUN:
        torch.cuda.empty_cache()
    return result


def worker(group: str, case_out: Path, warmup: int, steps: int) -> None:
    from tracetrain.parallel import dist as tdist
    info = tdist.init_distributed(300, "cpu" if DRY_RUN else "cuda")
    for name, overrides, mbs, seq in GROUPS[group][1]:
        t0 = time.perf_counter()
        result = run_case(name, overrides, mbs, seq, warmup, steps)  # an error ends the group (no rank is left waiting)
        result["wall_s"] = time.perf_counter() - t0
        if info.rank == 0:
            print(json.dumps({k: v for k, v in result.items() if k != "step_s_all"}), flush=True)
            (case_out / f"{name.replace(' ', '_').replace('/', '_')}.json").write_text(json.dumps(result))
    tdist.shutdown()


def _launch(group: str, case_out: Path, warmup: int, steps: int, gpus: str | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={GROUPS[group][0]}", "--standalone",
           __file__, "--group", group, "--case-out", str(case_out), "--warmup", str(warmup), "--steps", str(steps)]
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": gpus} if gpus else {}))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _finish(proc: subprocess.Popen, deadline: float) -> str:
    try:
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return f"timed out: {out[-1500:]}"
    return "ok" if proc.returncode == 0 else f"exit {proc.returncode}: {out[-3000:]}"


def driver(groups: list[str], out: Path, budget_s: float, warmup: int, steps: int, results_tag: str = "") -> None:
    """Groups of fewer than 4 GPUs run side by side on disjoint GPUs (0 | 1,2); the rest one by one."""
    case_out = out / "cases"
    case_out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    status = {}
    small = [g for g in groups if GROUPS[g][0] < 4]
    waves = ([small] if small else []) + [[g] for g in groups if GROUPS[g][0] >= 4]
    for wave in waves:
        if deadline - time.monotonic() < 30:
            status.update({g: "skipped: time budget spent" for g in wave})
            continue
        t0 = time.monotonic()
        first_gpu, procs = 0, {}
        for g in wave:
            n = GROUPS[g][0]
            gpus = ",".join(str(i) for i in range(first_gpu, first_gpu + n)) if len(wave) > 1 else None
            first_gpu += n
            procs[g] = _launch(g, case_out, warmup, steps, gpus)
        for g, proc in procs.items():
            status[g] = _finish(proc, deadline)
            print(f"== {g}: {time.monotonic() - t0:.0f} s, {status[g][:300]}", flush=True)
    cases = [json.loads(p.read_text()) for p in sorted(case_out.glob("*.json"))]
    single = next((c for c in cases if c["case"] == "llama3.2-1b single GPU"), None)
    for c in cases:
        if single and c["case"].startswith("llama3.2-1b"):
            c["scaling_efficiency"] = c["tokens_per_s_per_gpu"] / single["tokens_per_s_per_gpu"]
    env = environment()
    payload = {"environment": env, "groups": status, "cases": cases}
    if DRY_RUN:  # a flow check, not a result: only into --out
        (out / "scale_dry_run.json").write_text(json.dumps(payload, indent=2))
        return
    tag = f"_{results_tag}" if results_tag else ""
    write_result(f"scale_{env['device'].replace(' ', '-')}{tag}.json", payload, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    ap.add_argument("--groups", default=",".join(GROUPS))
    ap.add_argument("--group", default="", help="worker mode (inside torchrun)")
    ap.add_argument("--case-out", type=Path)
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--results-tag", default="", help="write scale_<gpu>_<tag>.json (a partial run keeps the "
                                                       "full matrix's file as it is)")
    a = ap.parse_args()
    if a.group:
        worker(a.group, a.case_out, a.warmup, a.steps)
    else:
        driver(a.groups.split(","), a.out, a.budget_s, a.warmup, a.steps, a.results_tag)


if __name__ == "__main__":
    main()
