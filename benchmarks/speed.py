"""Speed transforms on the GPU: kernel numerics, attention backends, and train_step variants vs the peers.

One process, one table. Three parts, each optional:

1. `--checks`: every Triton kernel against a float32 reference on real shapes (rel error printed, must
   be <= 1e-2 in bf16), and its time next to the eager ops it replaces (triton.testing.do_bench median).
2. `--attention`: fwd+bwd of the attention backends on 7B shapes with a packed document mask.
3. `--runs case:data:variant,...`: tracetrain's real `train_step` (model built as `tracetrain train`
   does, fused AdamW) on a packed batch (`data` = packed: several documents per row, document-masked)
   or unpacked rows (`data` = unpacked: no mask, like the peers); median of >= 10 timed steps after
   warm-up; loss of every step, and its largest difference from the eager variant's curve; Dynamo
   graphs compiled after warm-up (must be 0). `--peer` adds the HF (+PEFT) peers, `--peer-liger` with Liger.

Variants combine `attention` (sdpa | flex), `kernels` (fused RMSNorm/RoPE/SwiGLU), `compile` (regional,
per block) and `fused_ce` (chunked lm_head + cross-entropy). Each variant is assembled as `tracetrain
train` assembles a run (tracetrain/spec.py, train/assemble.py): its switches are config keys, or spec fields
changed with `RunSpec.replace` for the benchmark-only kernel subsets and the fused FP8 feed-forward.

  python3 benchmarks/speed.py --checks --attention --runs 7b-lora:packed:eager,7b-lora:packed:compile
  python3 benchmarks/speed.py --fp8     # the FP8 rows only (variants compile_fp8, compile_fp8_rowwise)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch._inductor.config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, median, run_peer, write_result  # noqa: E402
from speed_checks import (FUSED_CE_CHUNK, check_attention, check_kernels, free, packed_batch,  # noqa: E402
                          probe_addmm_out_dtype, unpacked_batch)

from tracetrain.config import load_config  # noqa: E402
from tracetrain.devices import peak_flops  # noqa: E402
from tracetrain.kernels.apply import compiled_frame_count  # noqa: E402
from tracetrain.models.accounting import training_flops_per_token  # noqa: E402
from tracetrain.train.assemble import assemble, run_step_context  # noqa: E402
from tracetrain.spec import resolve  # noqa: E402
from tracetrain.train.step import loss_sum, train_step  # noqa: E402

CASES = {
    "7b-lora": dict(preset="llama2-7b", mode="lora", batch=4, seq=2048, peer=["--model", "llama2-7b", "--mode", "lora"]),
    # unsloth's usual setting: adapters on every projection (its fused MLP path applies)
    "7b-lora-all": dict(preset="llama2-7b", mode="lora", batch=4, seq=2048, peer=[], targets="all-linear"),
    "1b-full": dict(preset="llama3.2-1b", mode="full", batch=4, seq=2048,
                    peer=["--model", "llama3.2-1b", "--mode", "full"]),
    "1b-full-b8": dict(preset="llama3.2-1b", mode="full", batch=8, seq=2048, peer=[]),
    # #19: llama3-8b full fine-tune on one H200 (fp32 weights + AdamW states: 128 GB before activations),
    # every block recomputed to fit; torchtitan's 8B runs next to it with --ac full at the same batch.
    "8b-full": dict(preset="llama3-8b", mode="full", batch=2, seq=2048, peer=[], extra=["--memory.recompute=full"]),
    "8b-full-b1": dict(preset="llama3-8b", mode="full", batch=1, seq=2048, peer=[],
                       extra=["--memory.recompute=full"]),
}
ALL_KERNELS = ("rmsnorm", "rope", "swiglu", "lora")
VARIANTS = {
    "eager": dict(attention="sdpa", kernels=(), compile=False, fused_ce=False),  # tracetrain today
    "flex": dict(attention="flex", kernels=(), compile=False, fused_ce=False),
    "fused_ce": dict(attention="sdpa", kernels=(), compile=False, fused_ce=True),
    "kernels": dict(attention="flex", kernels=ALL_KERNELS, compile=False, fused_ce=True),
    "compile": dict(attention="flex", kernels=(), compile=True, fused_ce=True),
    "compile_sdpa": dict(attention="sdpa", kernels=(), compile=True, fused_ce=True),
    "compile_lora": dict(attention="flex", kernels=("lora",), compile=True, fused_ce=True),
    "compile_kernels": dict(attention="flex", kernels=ALL_KERNELS, compile=True, fused_ce=True),
    # train.fp8 (kernels/fp8.py) on top of `compile`: LoRA bases quantised once; full FT through torchao.
    "compile_fp8": dict(attention="flex", kernels=(), compile=True, fused_ce=True, fp8="tensorwise"),
    "compile_fp8_rowwise": dict(attention="flex", kernels=(), compile=True, fused_ce=True, fp8="rowwise"),
    "compile_sdpa_fp8_rowwise": dict(attention="sdpa", kernels=(), compile=True, fused_ce=True, fp8="rowwise"),
    # With the opt-in fused FP8 feed-forward (kernels/fp8_mlp.py: gate|up in one GEMM, SwiGLU + quantisation
    # in single-pass Triton row kernels); slower than the default three FP8 linears on the H100 (cb02d8e).
    "compile_fp8_fused": dict(attention="flex", kernels=(), compile=True, fused_ce=True, fp8="tensorwise",
                              fp8_fused_mlp=True),
    "compile_fp8_rowwise_fused": dict(attention="flex", kernels=(), compile=True, fused_ce=True, fp8="rowwise",
                                      fp8_fused_mlp=True),
    "compile_sdpa_fp8_rowwise_fused": dict(attention="sdpa", kernels=(), compile=True, fused_ce=True,
                                           fp8="rowwise", fp8_fused_mlp=True),
    # torch's own fused AdamW instead of train/optim.py's (its Triton update): the A/B of that kernel.
    "compile_sdpa_torch_adamw": dict(attention="sdpa", kernels=(), compile=True, fused_ce=True, torch_adamw=True),
}
# `--fp8`: the 7B LoRA rows (unpacked, as the peers run, with the bf16 baseline; and packed), ~6 min.
FP8_RUNS = ("7b-lora:unpacked:compile,7b-lora:unpacked:compile_fp8,7b-lora:unpacked:compile_fp8_rowwise,"
            "7b-lora:packed:compile_fp8,7b-lora:packed:compile_fp8_rowwise")
# Inductor settings a run can add to its variant as "+name" suffixes (e.g. compile_fp8_rowwise+mk): the
# patch is active while the variant compiles and runs. mk: multi-kernel (persistent and looped variants
# of each reduction, benchmarked at first call; persistent reductions up to 16x longer rows, which the
# rowwise FP8 amax over 4096/11008 columns needs); cdt: coordinate-descent tuning of kernel block sizes.
INDUCTOR_KNOBS = {"mk": {"triton.multi_kernel": 1}, "cdt": {"coordinate_descent_tuning": True}}
T0 = time.time()


# ---------------------------------------------------------------------------------------------- runs

def build_variant(case: str, variant: str, lr: float):
    """The run `tracetrain train` assembles for the case, with the variant's switches: the config where it
    has them, the spec (`RunSpec.replace`) for the kernel subsets, the fused FP8 feed-forward and torch's
    fused AdamW kernel in place of the Triton update, which are benchmark-only choices. Returns (cfg, Assembly): model, optimizer and the step's context."""
    spec, var = CASES[case], VARIANTS[variant]
    cfg = load_config(None, [f"--model.preset={spec['preset']}", f"--train.mode={spec['mode']}",
                             f"--data.seq_len={spec['seq']}", "--train.precision=bf16", f"--optim.lr={lr}",
                             f"--train.attention={var['attention']}",
                             f"--train.compile={'on' if var['compile'] else 'off'}", "--train.fused_kernels=off",
                             f"--train.fused_ce={'true' if var['fused_ce'] else 'false'}",
                             f"--train.fused_ce_chunk={FUSED_CE_CHUNK}", f"--train.fp8={var.get('fp8', 'none')}",
                             *([f"--lora.targets={spec['targets']}"] if "targets" in spec else []),
                             *spec.get("extra", [])])
    torch._dynamo.reset()  # each variant compiles afresh (and Dynamo's recompile limit is per process)
    run_spec = resolve(cfg, torch.device("cuda")).replace(
        fused_kernels=tuple(var["kernels"]), fp8_fused_mlp=var.get("fp8_fused_mlp", False),
        optimizer_triton=not var.get("torch_adamw", False))
    return cfg, assemble(run_spec)


def variant_context(built, packed: bool):
    """The step's context from the assembled run; `packed` rows carry a document mask, unpacked ones not."""
    return dataclasses.replace(run_step_context(built), use_document_mask=packed)


def bench_run(case: str, data: str, variant: str, warmup: int, steps: int, base_losses: dict,
              lr: float) -> dict:
    spec, var = CASES[case], VARIANTS[variant]
    device = torch.device("cuda")
    _, built = build_variant(case, variant, lr)
    model, opt = built.module, built.optimizer
    vocab = model.args.vocab_size
    packed = data == "packed"
    batch = (packed_batch if packed else unpacked_batch)(spec["batch"], spec["seq"], vocab)
    batch = {k: v.pin_memory() for k, v in batch.items()}
    ctx = variant_context(built, packed)
    free()
    torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    t_warm = time.time()
    for _ in range(warmup):
        losses.append(train_step(model, opt, [batch], ctx).loss)
    torch.cuda.synchronize()
    warm_s = time.time() - t_warm
    frames_after_warmup = compiled_frame_count()
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        losses.append(train_step(model, opt, [batch], ctx).loss)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    losses = [float(x) for x in losses]
    mask_ms = None
    if packed:  # host time to build the attention mask of one batch (the step waits for it)
        doc = batch["document_ids"].to(device)
        model.mask_fn(doc)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            model.mask_fn(doc)
        torch.cuda.synchronize()
        mask_ms = (time.perf_counter() - t) * 100
    step_s = median(times)
    tokens_per_s = spec["batch"] * spec["seq"] / step_s
    n_lora = sum(p.numel() for p in model.parameters() if p.requires_grad) if spec["mode"] == "lora" else 0
    flops = training_flops_per_token(model.args, spec["seq"], mode=spec["mode"], num_lora_params=n_lora)
    peak = peak_flops(torch.cuda.get_device_name(0), "bf16")  # also for FP8 rows: one scale for all rows
    fp8_peak = peak_flops(torch.cuda.get_device_name(0), "fp8")
    key = (case, data)
    if variant == "eager":
        base_losses[key] = losses
    ref = base_losses.get(key)
    base_losses[(case, data, variant)] = losses
    bf16 = base_losses.get((case, data, "compile")) if var.get("fp8") else None  # FP8 rows vs their bf16 twin
    row = {"case": case, "data": data, "system": f"tracetrain:{variant}", **var, "lr": lr, "batch": spec["batch"],
           "seq": spec["seq"], "step_s_median": step_s, "step_s_all": times, "tokens_per_s": tokens_per_s,
           "tflops": tokens_per_s * flops.model / 1e12, "mfu": tokens_per_s * flops.model / peak if peak else None,
           "mfu_of_fp8_peak": tokens_per_s * flops.model / fp8_peak if fp8_peak and var.get("fp8") else None,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "warmup_s": warm_s, "losses": losses,
           "mask_build_ms": mask_ms,
           "max_loss_diff_vs_eager": max(abs(a - b) for a, b in zip(losses, ref)) if ref else None,
           "max_loss_diff_vs_compile": max(abs(a - b) for a, b in zip(losses, bf16)) if bf16 else None,
           "graphs_compiled_after_warmup": compiled_frame_count() - frames_after_warmup,
           "graphs_compiled_total": compiled_frame_count()}
    del model, opt, batch, built
    free()
    return row


def grad_check(case: str, data: str, variants: list[str], lr: float) -> dict:
    """Loss and trainable-parameter gradients of one step (before any update) per variant, relative
    to the eager variant: is a variant's gradient within the bf16 noise that fused_ce shows?"""
    spec = CASES[case]
    ref, out = None, {}
    for variant in variants:
        _, built = build_variant(case, variant, lr)
        model, opt = built.module, built.optimizer
        vocab = model.args.vocab_size
        packed = data == "packed"
        batch = (packed_batch if packed else unpacked_batch)(spec["batch"], spec["seq"], vocab)
        batch = {k: v.to("cuda") for k, v in batch.items()}
        ctx = variant_context(built, packed)
        if spec["mode"] == "lora":  # B = 0 at init makes A's gradient 0: give B a value, as after training
            with torch.no_grad():
                g = torch.Generator(device="cuda").manual_seed(0)
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.copy_(1e-3 * torch.randn(p.shape, generator=g, device="cuda"))
        loss = loss_sum(model, batch, ctx)
        loss.backward()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        if ref is None:
            ref = (float(loss), grads)
        rel = {n: float((grads[n] - ref[1][n]).norm() / ref[1][n].norm().clamp_min(1e-30)) for n in grads}
        worst = sorted(rel, key=rel.get)[-3:]
        out[variant] = {"loss": float(loss), "loss_diff": float(loss) - ref[0],
                        "grad_rel_err_all": float(torch.cat([(grads[n] - ref[1][n]).flatten() for n in grads]).norm()
                                                  / torch.cat([ref[1][n].flatten() for n in grads]).norm()),
                        "worst": {n: rel[n] for n in worst}}
        print(f"grad check {case}:{data}:{variant}: {out[variant]}", flush=True)
        del model, opt, grads, loss, built
        free()
    return out


def profile_run(case: str, data: str, variant: str, lr: float, out_dir: Path | None) -> list[dict]:
    """One profiled step after warm-up: GPU time by kernel (top 70), and the trace (gz) under $OUT."""
    import gzip
    import shutil
    from torch.profiler import ProfilerActivity, profile
    spec = CASES[case]
    _, built = build_variant(case, variant, lr)
    model, opt = built.module, built.optimizer
    packed = data == "packed"
    batch = (packed_batch if packed else unpacked_batch)(spec["batch"], spec["seq"], model.args.vocab_size)
    ctx = variant_context(built, packed)
    for _ in range(3):
        train_step(model, opt, [batch], ctx)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        train_step(model, opt, [batch], ctx)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0]
    total = sum(getattr(e, "self_device_time_total", 0) for e in events) or 1
    top = sorted(events, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)[:70]
    rows = [{"name": e.key[:120], "count": e.count, "ms": e.self_device_time_total / 1e3,
             "share": e.self_device_time_total / total} for e in top]
    print(f"profile {case}:{data}:{variant}: GPU total {total / 1e3:.1f} ms", flush=True)
    for r in rows:
        print(f"  {r['ms']:8.2f} ms {100 * r['share']:5.1f}% x{r['count']:<5} {r['name'][:100]}", flush=True)
    if out_dir is not None:
        trace = Path("/tmp/speed_trace.json")
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(out_dir / f"trace_{case}_{data}_{variant}.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    del model, opt, built
    free()
    return rows


# ---------------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checks", action="store_true")
    ap.add_argument("--attention", action="store_true")
    ap.add_argument("--runs", default="", help="case:data:variant,... (data = packed | unpacked)")
    ap.add_argument("--fp8", action="store_true", help=f"add the FP8 rows (and their bf16 baselines): {FP8_RUNS}")
    ap.add_argument("--grad-check", default="", help="case:data:variant,variant,... (first = reference)")
    ap.add_argument("--profile", default="", help="case:data:variant to profile one step of")
    ap.add_argument("--peer", default="", help="path to hf_peer.py; '' = no peers")
    ap.add_argument("--peer-cases", default="7b-lora,1b-full")
    ap.add_argument("--peer-liger", action="store_true")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-4, help="constant AdamW lr of the loss curves (1e-4: stable "
                    "for full 1B training from random init; 1e-3 spikes, and bf16 noise then grows)")
    ap.add_argument("--budget-s", type=float, default=560, help="skip what would start after this many s")
    a = ap.parse_args()
    env = environment()
    print(f"{env}", flush=True)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    gpu = env["device"].replace(" ", "-").replace("/", "-")
    result: dict = {**env, "checks": [], "attention": [], "rows": [], "skipped": []}

    def save() -> None:
        write_result(f"speed_{gpu}.json", result, out_dir)

    tasks = [(key, fn) for enabled, key, fn in ((a.checks, "checks", check_kernels),
                                                 (a.checks, "addmm_out_dtype", probe_addmm_out_dtype),
                                                 (a.attention, "attention", check_attention)) if enabled]
    if a.grad_check:
        case, data, variants = a.grad_check.split(":")
        tasks.append(("grad_check", lambda: grad_check(case, data, variants.split(","), a.lr)))
    if a.profile:
        pcase, pdata, pvariant = a.profile.split(":")
        tasks.append(("profile", lambda: profile_run(pcase, pdata, pvariant, a.lr, out_dir)))
    for key, fn in tasks:
        try:
            result[key] = fn()
        except Exception as e:  # recorded and printed; the runs below still go ahead
            traceback.print_exc()
            result[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            free()
        save()
    base_losses: dict = {}
    runs = a.runs + ("," + FP8_RUNS if a.fp8 else "")
    for run in filter(None, runs.split(",")):
        if time.time() - T0 > a.budget_s:
            result["skipped"].append(run)
            continue
        case, data, variant = run.split(":")
        variant, *knobs = variant.split("+")
        try:
            patch = {k: v for knob in knobs for k, v in INDUCTOR_KNOBS[knob].items()}
            with torch._inductor.config.patch(patch):
                row = bench_run(case, data, variant, a.warmup, a.steps, base_losses, a.lr)
            if knobs:
                row.update(system=f"tracetrain:{'+'.join([variant, *knobs])}", inductor=patch)
        except Exception as e:  # recorded and printed: one failing variant must not lose the others' numbers
            traceback.print_exc()
            kind = "OOM" if isinstance(e, torch.OutOfMemoryError) else type(e).__name__
            row = {"case": case, "data": data, "system": f"tracetrain:{'+'.join([variant, *knobs])}", "error": f"{kind}: {str(e)[:300]}"}
            free()
        result["rows"].append(row)
        print(f"{run}: {row.get('tokens_per_s', 0):,.0f} tok/s  {row.get('peak_gib', 0):.1f} GiB  "
              f"warm-up {row.get('warmup_s', 0):.0f} s  graphs after warm-up "
              f"{row.get('graphs_compiled_after_warmup')}  loss diff {row.get('max_loss_diff_vs_eager')}  "
              f"fp8 vs bf16 loss diff {row.get('max_loss_diff_vs_compile')}  "
              f"{row.get('error', '')}", flush=True)
        save()
    for case in filter(None, a.peer_cases.split(",") if a.peer else []):
        spec = CASES[case]
        for extra in [[]] + ([["--liger"]] if a.peer_liger else []):
            if time.time() - T0 > a.budget_s:
                result["skipped"].append(f"peer {case} {extra}")
                continue
            peer = run_peer(Path(a.peer), [*spec["peer"], "--batch", str(spec["batch"]), "--seq", str(spec["seq"]),
                                           "--steps", str(a.steps), "--warmup", str(a.warmup), *extra])
            peer.update({"case": case, "data": "unpacked", "system": peer.get("peer", "peer" + "".join(extra))})
            result["rows"].append(peer)
            print(f"peer {case}: {peer['system']} {peer.get('tokens_per_s', peer.get('error'))}", flush=True)
            save()
    print_table(result)
    save()


def print_table(result: dict) -> None:
    rows = result["rows"]
    peers = {(r["case"], r["system"]): r["tokens_per_s"] for r in rows if "peer" in r and "tokens_per_s" in r}
    print(f"\n{result['device']}  torch {result['torch']}  {result['date']}")
    print(f"{'case':<11} {'data':<9} {'system':<26} {'tok/s':>8} {'TFLOP/s':>8} {'MFU':>6} {'GiB':>6} "
          f"{'dLoss':>7} {'recomp':>6} {'/hf':>5} {'/liger':>6}")
    for r in rows:
        case = r["case"]
        ref = [p for (c, s), p in peers.items() if c == case and "liger" not in s]
        lig = [p for (c, s), p in peers.items() if c == case and "liger" in s]
        tps = r.get("tokens_per_s", 0)
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        dl = f"{r['max_loss_diff_vs_eager']:.3f}" if r.get("max_loss_diff_vs_eager") is not None else "-"
        print(f"{case:<11} {r.get('data', ''):<9} {r['system']:<26} {tps:>8,.0f} {r.get('tflops', 0):>8.1f} "
              f"{mfu:>6} {r.get('peak_gib', 0):>6.1f} {dl:>7} {str(r.get('graphs_compiled_after_warmup', '')):>6} "
              f"{tps / ref[0] if ref and tps else 0:>5.2f} {tps / lig[0] if lig and tps else 0:>6.2f}"
              + (f"  {r['error'][:60]}" if r.get("error") else ""))
    print(json.dumps({"skipped": result["skipped"]}))


if __name__ == "__main__":
    main()
