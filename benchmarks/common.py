"""Helpers shared by benchmark scripts: environment facts, CUDA-event timing, result files."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    # The device machine receives the working tree without .git: the caller passes TRACETRAIN_COMMIT.
    commit = os.environ.get("TRACETRAIN_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=Path(__file__).parent).stdout.strip() or "unknown"
    return {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "commit": commit,
            "date": datetime.date.today().isoformat()}


def time_steps(step: Callable[[], None], warmup: int, steps: int) -> list[float]:
    """Seconds per call, measured with CUDA events around each call after `warmup` untimed calls."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def write_result(name: str, payload: dict, out_dir: Path | None = None) -> Path:
    """Write JSON to benchmarks/results/NAME (and a copy under out_dir, e.g. the device tool's $OUT)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = json.dumps(payload, indent=2)
    path = RESULTS / name
    path.write_text(text)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / name).write_text(text)
    return path


def last_json_line(text: str) -> dict | None:
    """The last line of a child's stdout that parses as a JSON object (its result), or None."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_peer(peer_script: Path, args: list[str]) -> dict | None:
    """Run ../shared/peers/hf_peer.py (carried into the checkout) and parse its JSON line."""
    proc = subprocess.run(["python3", str(peer_script), *args], capture_output=True, text=True)
    out = last_json_line(proc.stdout)
    if out is not None:
        return out
    tail = (proc.stderr or proc.stdout)[-600:]
    return {"error": "out of memory" if "OutOfMemory" in tail else tail}


def bench_train_step(cfg, batch: int, seq: int, warmup: int, steps: int, cap_gib: float | None = None) -> dict:
    """Build model, optimizer and transforms exactly as `tracetrain train` does for `cfg`, then time
    `train_step` on random full-length rows (median over `steps` after `warmup`). Peak memory counts
    the steps only (the stats are reset after the build)."""
    import dataclasses
    import gc

    from tracetrain.devices import peak_flops
    from tracetrain.models.accounting import training_flops_per_token
    from tracetrain.train.assemble import assemble, run_step_context
    from tracetrain.spec import resolve
    from tracetrain.train.step import train_step

    device = torch.device("cuda")
    spec = resolve(cfg, device)  # the trainer's path: same spec, same transform table, same step
    precision = spec.precision
    built = assemble(spec)
    model, opt = built.module, built.optimizer
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    # The rows below are unpacked (one document each): no document mask, whatever data.pack says.
    ctx = dataclasses.replace(run_step_context(built, scaler=scaler), use_document_mask=False)
    tokens = torch.randint(0, model.args.vocab_size, (batch, seq + 1))
    rows = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(seq).expand(batch, -1).contiguous(),
            "document_ids": torch.zeros(batch, seq, dtype=torch.long)}
    rows = {k: v.pin_memory() for k, v in rows.items()}
    micro = [rows] * cfg.train.grad_accum_steps
    torch.cuda.reset_peak_memory_stats()
    time_steps(lambda: train_step(model, opt, micro, ctx), warmup, 0)  # warm-up: compile, optimizer states
    warmup_peak = torch.cuda.max_memory_allocated()
    # What a step starts from (weights, optimizer states): peak minus this is the step's activations.
    base = torch.cuda.memory_allocated()
    if cap_gib is not None:
        # Timed steps under a hard cap on what the caching allocator may hold: a step that needs more
        # raises OutOfMemoryError; memory a side stream still reads is waited for (the allocator syncs
        # on its events) before that, so the throughput under the cap includes any such stall.
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total))
    torch.cuda.reset_peak_memory_stats()
    try:
        times = time_steps(lambda: train_step(model, opt, micro, ctx), 0, steps)
    finally:
        if cap_gib is not None:
            torch.cuda.set_per_process_memory_fraction(1.0)
    # "active" also counts memory freed while a side stream still reads it (record_stream): the
    # allocator cannot reuse it yet, but "allocated" already dropped it.
    step_active_peak = torch.cuda.memory_stats()["active_bytes.all.peak"]
    step_s = median(times)
    tokens_per_s = batch * seq * cfg.train.grad_accum_steps / step_s
    n_lora = sum(p.numel() for p in model.parameters() if p.requires_grad) if cfg.train.mode == "lora" else 0
    flops = training_flops_per_token(model.args, seq, mode=cfg.train.mode, num_lora_params=n_lora,
                                     recompute=cfg.memory.recompute)
    peak = peak_flops(torch.cuda.get_device_name(0), "bf16")
    result = {"batch": batch, "seq": seq, "grad_accum": cfg.train.grad_accum_steps, "step_s_median": step_s,
              "step_s_all": times, "tokens_per_s": tokens_per_s, "tflops": tokens_per_s * flops.model / 1e12,
              "hw_tflops": tokens_per_s * flops.hardware / 1e12,
              "mfu": tokens_per_s * flops.model / peak if peak else None,
              "peak_gib": max(warmup_peak, torch.cuda.max_memory_allocated()) / 2**30,
              "base_gib": base / 2**30, "step_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
              "step_active_peak_gib": step_active_peak / 2**30, "activation_gib": (step_active_peak - base) / 2**30,
              "cap_gib": cap_gib, "step_reserved_peak_gib": torch.cuda.max_memory_reserved() / 2**30}
    if hasattr(opt, "close"):
        opt.close()
    del model, opt, micro, rows, built
    gc.collect()
    torch.cuda.empty_cache()
    return result
