"""Full fine-tuning of llama2-7b on one GPU with CPUOffloadAdamW: what each optimizer step costs.

bf16 weights on the GPU, full activation recomputation, bf16 autocast, fp32 masters and AdamW moments
on the host. For gradient accumulation G in --accum it measures, per optimizer step: wall time, the
time the GPU sits idle waiting for the CPU optimizer (CUDA events from the end of the last backward to
the end of the weight upload), tokens/s, model and hardware TFLOP/s, peak GPU memory and host RSS;
and the floor: one fused CPU AdamW pass over every parameter with the same threads.

The host needs 18 bytes per parameter (121 GB for 6.74B, see tracetrain/memory/optimizer_offload.py)
plus the process. With less available memory the model is cut to the layers that fit (recorded as
`n_layers` / `n_layers_preset` in the JSON); with too little for even one layer the script exits.
Unattended, under 6 minutes on an H100; prints a table, writes JSON (and a copy under $OUT if set).

  python3 benchmarks/offload_check.py [--preset llama2-7b] [--batch 4] [--seq 2048] [--accum 1,8]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402

from tracetrain.memory.optimizer_offload import CPUOffloadAdamW, cpu_threads  # noqa: E402
from tracetrain.models.accounting import num_params, training_flops_per_token  # noqa: E402
from tracetrain.models.build import materialize  # noqa: E402
from tracetrain.models.llama import ModelArgs  # noqa: E402
from tracetrain.models.presets import get_preset  # noqa: E402
from tracetrain.config import load_config  # noqa: E402
from tracetrain.spec import resolve  # noqa: E402
from tracetrain.train.assemble import Assembly, assemble, run_step_context  # noqa: E402
from tracetrain.train.step import StepContext, loss_sum  # noqa: E402

HOST_BYTES_PER_PARAM = 18        # staging 2 + grad 4 + master 4 + exp_avg 4 + exp_avg_sq 4
HOST_RESERVE_BYTES = 6 * 2**30   # torch and CUDA libraries, the CUDA context's host side, Python
GIB = 2**30


def host_bytes(key: str) -> int:
    """A field of /proc/meminfo (kB) or /proc/self/status, in bytes."""
    for path in ("/proc/meminfo", "/proc/self/status"):
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def fit_layers(args: ModelArgs) -> ModelArgs | None:
    """The preset, or as many of its layers as the host can hold the optimizer state for."""
    budget = host_bytes("MemAvailable") - HOST_RESERVE_BYTES
    for n_layers in range(args.n_layers, 0, -1):
        cut = dataclasses.replace(args, n_layers=n_layers)
        if num_params(cut) * HOST_BYTES_PER_PARAM <= budget:
            return cut
    return None


def assemble_run(a: argparse.Namespace, n_layers: int) -> Assembly:
    """The run `tracetrain train` assembles for this measurement: bf16 weights (the model row's dtype under
    optimizer offload) with CPUOffloadAdamW, full recomputation, bf16 autocast; eager, plain SDPA and
    cross-entropy over full logits, unpacked rows (the conditions of the committed results)."""
    cfg = load_config(None, [f"--model.preset={a.preset}", f"--model.n_layers={n_layers}", f"--data.seq_len={a.seq}",
                             "--data.pack=false", "--train.precision=bf16", "--train.compile=off",
                             "--train.fused_kernels=off", "--train.fused_ce=false", "--train.attention=sdpa",
                             "--memory.optimizer_offload=true", "--memory.recompute=full",
                             f"--memory.offload_threads={a.threads}", "--optim.lr=1e-4", "--optim.weight_decay=0.1",
                             "--optim.beta1=0.9", "--optim.beta2=0.95", "--optim.eps=1e-8", "--train.grad_clip=1.0"])
    return assemble(resolve(cfg, torch.device("cuda")))


def random_batch(vocab: int, batch: int, seq: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    rows = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:],
            "position_ids": torch.arange(seq).expand(batch, -1),
            "document_ids": torch.zeros(batch, seq, dtype=torch.long)}
    return {k: v.contiguous().cuda() for k, v in rows.items()}


def one_step(model: nn.Module, opt: CPUOffloadAdamW, batch: dict[str, torch.Tensor], accum: int,
             ctx: StepContext) -> dict[str, float]:
    """One optimizer step (the same batch `accum` times); seconds and the GPU's wait, synchronised."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    num_targets = batch["labels"].numel() * accum
    total = torch.zeros((), device="cuda")
    for _ in range(accum):
        loss = loss_sum(model, batch, ctx) / num_targets
        loss.backward()
        total += loss.detach()
    backward_done, upload_done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    backward_done.record()
    grad_norm, finite = opt.step_with_clip(1.0)
    upload_done.record()  # the compute stream waits on the uploads: completes when the weights are new
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return {"step_s": time.perf_counter() - start, "gpu_wait_s": backward_done.elapsed_time(upload_done) / 1e3,
            "loss": total.item(), "grad_norm": grad_norm.item(), "finite": bool(finite), **opt.last_timings}


def cpu_adamw_floor(opt: CPUOffloadAdamW, repeats: int = 2) -> float:
    """Seconds of one fused CPU AdamW pass over all host buffers (the weights are not uploaded)."""
    from torch.optim.adamw import adamw
    host = opt.host_tensors()
    steps = [torch.ones(()) for _ in host["step"]]
    times = []
    with cpu_threads(opt.threads):
        for _ in range(repeats):
            start = time.perf_counter()
            adamw(host["master"], host["grad"], host["exp_avg"], host["exp_avg_sq"], [], steps, fused=True,
                  amsgrad=False, beta1=0.9, beta2=0.95, lr=0.0, weight_decay=0.0, eps=1e-8, maximize=False)
            times.append(time.perf_counter() - start)
    return min(times)


def run(a: argparse.Namespace) -> dict:
    preset = get_preset(a.preset)
    args = fit_layers(dataclasses.replace(preset, max_seq_len=max(preset.max_seq_len, a.seq)))
    if args is None:
        print(f"host memory too small: {host_bytes('MemAvailable') / GIB:.0f} GiB available; exiting")
        return {"error": "insufficient host memory", "mem_available_gib": host_bytes("MemAvailable") / GIB}
    if args.n_layers < preset.n_layers:
        print(f"host memory holds the optimizer state of {args.n_layers} of {preset.n_layers} layers: reduced model")
    start = time.perf_counter()  # the whole assembly now (the optimizer's host buffers dominate it)
    built = assemble_run(a, args.n_layers)
    build_s = time.perf_counter() - start
    model, opt = built.module, built.optimizer
    assert isinstance(opt, CPUOffloadAdamW) and "recompute" in built.applied
    recompute = "tracetrain.memory.recompute"
    print(f"{num_params(args) / 1e9:.2f}B params, optimizer built in {build_s:.0f} s, "
          f"RSS {host_bytes('VmRSS') / GIB:.0f} GiB, recompute via {recompute}", flush=True)
    ctx = run_step_context(built)
    assert ctx.autocast_dtype == torch.bfloat16 and not ctx.use_document_mask and ctx.fused_ce_chunk == 0
    batch = random_batch(args.vocab_size, a.batch, a.seq)
    flops = training_flops_per_token(args, a.seq, mode="full", recompute="full")
    rows = []
    for accum in [int(g) for g in a.accum.split(",")]:
        torch.cuda.reset_peak_memory_stats()
        runs = [one_step(model, opt, batch, accum, ctx) for _ in range(1 + a.steps)][1:]  # first = warm-up
        best = min(runs, key=lambda r: r["step_s"])
        tokens_per_s = a.batch * a.seq * accum / best["step_s"]
        rows.append({"accum": accum, **best, "losses": [r["loss"] for r in runs], "tokens_per_s": tokens_per_s,
                     "tflops_model": tokens_per_s * flops.model / 1e12,
                     "tflops_hardware": tokens_per_s * flops.hardware / 1e12,
                     "peak_gpu_gib": torch.cuda.max_memory_allocated() / GIB,
                     "rss_gib": host_bytes("VmRSS") / GIB, "rss_peak_gib": host_bytes("VmHWM") / GIB})
        print(f"G={accum}: {best['step_s']:.2f} s/step, GPU waits {best['gpu_wait_s']:.2f} s, "
              f"losses {[round(r['loss'], 4) for r in runs]}", flush=True)
    floor = cpu_adamw_floor(opt)
    return {"preset": a.preset, "n_layers": args.n_layers, "n_layers_preset": preset.n_layers,
            "num_params": num_params(args), "batch": a.batch, "seq": a.seq, "threads": a.threads or os.cpu_count(),
            "optimizer_build_s": build_s, "cpu_adamw_floor_s": floor, "recompute": recompute, "rows": rows}


def _groups(model: nn.Module) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def _tiny_backward(model: nn.Module, step: int, accum: int = 2) -> None:
    for micro in range(accum):
        g = torch.Generator().manual_seed(100 * step + micro)
        tokens = torch.randint(0, 259, (2, 33), generator=g).cuda()
        logits = model(tokens[:, :-1]).float()  # (batch, seq, vocab)
        (nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) / accum).backward()


def selftest() -> dict:
    """The CUDA path on a tiny model: against torch AdamW on the GPU (fp32 weights, accumulation 2,
    clipping), bf16 weights equal to the masters cast, gradients freed, staging pinned."""
    args = dataclasses.replace(get_preset("tiny"), n_layers=2)
    ours, ref = (materialize(args, torch.device("cuda"), seed=0) for _ in range(2))
    opt = CPUOffloadAdamW(_groups(ours), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, chunk_numel=20_000)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
    norms, freed = [], True
    for step in range(3):
        _tiny_backward(ours, step)
        _tiny_backward(ref, step)
        freed &= all(p.grad is None for p in ours.parameters())
        norm, _ = opt.step_with_clip(1.0)
        norms.append((norm.item(), torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0).item()))
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    ordered = [[p for g in _groups(m) for p in g["params"]] for m in (ours, ref)]
    weight_diff = max((a - b).abs().max().item() for a, b in zip(*ordered))
    master_diff = max((m - b.cpu()).abs().max().item() for m, b in zip(opt.host_tensors()["master"], ordered[1]))
    model16 = materialize(args, torch.device("cuda"), seed=0, dtype=torch.bfloat16)
    opt16 = CPUOffloadAdamW(_groups(model16), lr=1e-3)
    _tiny_backward(model16, 0)
    opt16.step_with_clip(1.0)
    torch.cuda.synchronize()
    params16 = [p for g in _groups(model16) for p in g["params"]]
    bf16_exact = all(torch.equal(p.cpu(), m.bfloat16()) for p, m in zip(params16, opt16.host_tensors()["master"]))
    result = {"max_weight_diff": weight_diff, "max_master_diff": master_diff, "norms_ours_ref": norms,
              "grads_freed": freed, "bf16_upload_exact": bf16_exact,
              "staging_pinned": opt16.host_tensors()["staging"][0].is_pinned()}
    result["passed"] = (weight_diff < 1e-5 and master_diff < 1e-5 and freed and bf16_exact
                        and result["staging_pinned"] and all(abs(a - b) < 1e-4 * b for a, b in norms))
    opt.close()
    opt16.close()
    return result


def unified_selftest() -> dict:
    """Managed memory on this GPU: a tensor used by a kernel, prefetches, a tiny model and its AdamW
    moved into managed memory and trained a step, and the guard refusing more than the free memory."""
    from tracetrain.memory import unified
    x = unified.managed_empty((1024, 1024), torch.float32, "cuda", advise="gpu", accessed_by_gpu=True)
    x.fill_(1.0)
    unified.prefetch(x, "cpu")
    unified.prefetch(x, "gpu")
    matmul_ok = bool(((x @ x) == 1024.0).all())
    args = dataclasses.replace(get_preset("tiny"), n_layers=2)
    model = materialize(args, torch.device("cuda"), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    moved = unified.apply_unified_memory(model, "model") + unified.apply_unified_memory(opt, "optimizer")
    _tiny_backward(model, 0)
    opt.step()
    free_bytes, _ = torch.cuda.mem_get_info()
    try:
        unified.managed_empty((free_bytes,), torch.uint8, "cuda")
        refused = False
    except unified.UnifiedMemoryError:
        refused = True
    held = unified.LEDGER.held(torch.cuda.current_device())
    del x, model, opt
    torch.cuda.synchronize()
    return {"matmul_ok": matmul_ok, "moved_bytes": moved, "guard_refused": refused, "held_bytes": held,
            "held_after_free": unified.LEDGER.held(torch.cuda.current_device()),
            "passed": matmul_ok and refused and moved > 0}


def print_table(result: dict) -> None:
    print(f"\n{result['preset']} ({result['n_layers']}/{result['n_layers_preset']} layers), micro-batch "
          f"{result['batch']} x {result['seq']}, CPU AdamW floor {result['cpu_adamw_floor_s']:.2f} s "
          f"({result['threads']} threads)")
    print(f"{'G':>3} {'step s':>7} {'GPU wait s':>10} {'norm s':>7} {'update s':>8} {'tok/s':>7} "
          f"{'TFLOP/s mdl':>11} {'hw':>6} {'GPU GiB':>7} {'RSS GiB':>7}")
    for r in result["rows"]:
        print(f"{r['accum']:>3} {r['step_s']:>7.2f} {r['gpu_wait_s']:>10.2f} {r['grad_norm_s']:>7.2f} "
              f"{r['update_s']:>8.2f} {r['tokens_per_s']:>7.0f} {r['tflops_model']:>11.1f} "
              f"{r['tflops_hardware']:>6.1f} {r['peak_gpu_gib']:>7.1f} {r['rss_peak_gib']:>7.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama2-7b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--accum", default="1,8", help="gradient accumulation steps to measure, comma-separated")
    ap.add_argument("--steps", type=int, default=2, help="timed optimizer steps per G (after one warm-up)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for the update (0 = torch's default)")
    ap.add_argument("--selftest", action="store_true", help="only the tiny-model CUDA correctness checks")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("offload_check needs a CUDA GPU; exiting")
        return
    check, um = selftest(), unified_selftest()
    for name, r in (("offload selftest", check), ("unified-memory selftest", um)):
        print(f"{name} {'PASSED' if r['passed'] else 'FAILED'}: {r}", flush=True)
    result = {**environment(), "selftest": check, "unified_selftest": um, **({} if a.selftest else run(a))}
    if "rows" in result:
        print_table(result)
    gpu = result["device"].replace(" ", "-").replace("/", "-")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    path = write_result(f"offload_check_{gpu}.json", result, out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
