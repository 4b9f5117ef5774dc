"""Shared parts of the advice-truth corpus (benchmarks/advice_truth.py): the small models the loops
train, unprofiled step timing, profiled capture, and the per-case result files.

Every loop is written as a user would write it: a plain `nn.Module`, `torch.autocast` for bf16, a
`torch.optim.AdamW`, a `for` loop. A case builds a `step()` closure for its variant ("problem",
"fixed" or "control"); the runner times it unprofiled and records it profiled.
"""

from __future__ import annotations

import gzip
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule

Step = Callable[[], None]


@dataclass
class Settings:
    """Sizes shared by every case; `tiny` shrinks everything for a CPU smoke run of the script itself."""

    device: torch.device
    steps: int = 20  # unprofiled steps timed (the median is the truth)
    warmup: int = 3
    tiny: bool = False

    def dim(self, d: int) -> int:
        return 32 if self.tiny else d

    def n(self, k: int) -> int:
        return max(1, min(k, 2)) if self.tiny else k


@dataclass
class Case:
    """One loop: `build(variant, settings)` returns its step. `variants` are timed and profiled in order."""

    name: str
    cause: str
    build: Callable[[str, Settings], Step]
    variants: tuple[str, ...] = ("problem", "fixed")
    active: int = 2  # profiled steps (kept few: traces must stay a few hundred KB)
    warmup: int | None = None  # unprofiled warm-up steps, when the case needs more than the default
    extra: dict = field(default_factory=dict)


class Block(nn.Module):
    """A pre-norm MLP block: the bulk of a transformer's FLOPs, without attention's extra kernels."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding -> blocks -> head; `features=True` takes (batch, seq, dim) float features instead of ids."""

    def __init__(self, dim: int, layers: int, vocab: int = 4096, features: bool = False) -> None:
        super().__init__()
        self.embed = None if features else nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x  # (batch, seq, dim)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))  # (batch, seq, vocab)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def autocast(s: Settings):
    return torch.autocast(s.device.type, dtype=torch.bfloat16)


def sync(s: Settings) -> None:
    if s.device.type == "cuda":
        torch.cuda.synchronize(s.device)


def python_work(us: float) -> None:
    """Pure-Python CPU work for about `us` microseconds (decoding, tokenizing, augmenting a sample)."""
    end = time.perf_counter() + us * 1e-6
    total = 0
    while time.perf_counter() < end:
        total += sum(range(50))


def time_steps(step: Step, s: Settings, warmup: int | None = None) -> list[float]:
    """Milliseconds per step, unprofiled: wall clock with the device synchronised after each step."""
    for _ in range(s.warmup if warmup is None else warmup):
        step()
    sync(s)
    times = []
    for _ in range(s.steps):
        start = time.perf_counter()
        step()
        sync(s)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def record(step: Step, path: Path, s: Settings, active: int) -> float:
    """Profile one warm-up step and `active` recorded steps into `path` (gzipped); returns seconds taken."""
    path.parent.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(
        activities=acts,
        record_shapes=True,
        schedule=schedule(wait=0, warmup=1, active=active, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(path)),
    ) as prof:
        for _ in range(1 + active):
            step()
            prof.step()
    sync(s)
    return time.perf_counter() - start


def summary(times: list[float]) -> dict:
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "steps_ms": times}


def trace_kib(path: Path) -> float:
    return path.stat().st_size / 1024 if path.exists() else 0.0


def count_events(path: Path) -> int:
    with gzip.open(path, "rt") as f:
        return len(json.load(f).get("traceEvents", []))


def write_case(results: Path, name: str, payload: dict) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(payload, indent=1))


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"


def log(msg: str) -> None:
    print(f"[advice_truth {time.strftime('%H:%M:%S')} pid {os.getpid()}] {msg}", flush=True)


def run_case(
    case: Case,
    s: Settings,
    out: Path,
    results: Path,
    rank: int = 0,
    gather: Callable[[list[float]], list[float]] | None = None,
) -> None:
    """Time each variant unprofiled, then record it profiled; write the case's result (rank 0).

    The problem (or control) trace lands in `out/<case>/rank{R}.json.gz`, the fixed twin's in
    `out/<case>/fixed/`, so that analysing the case folder reads the problem only."""
    payload: dict = {"case": case.name, "cause": case.cause, "variants": {}}
    try:
        for variant in case.variants:
            log(f"{case.name}/{variant}: build")
            step = case.build(variant, s)
            times = time_steps(step, s, case.warmup)
            times = gather(times) if gather else times
            folder = out / case.name / ("" if variant != "fixed" else "fixed")
            path = folder / f"rank{rank}.json.gz"
            seconds = record(step, path, s, case.active)
            # The real step time beside the trace, as `tracetrain profile` writes it (analyze/overhead.py).
            timing = {"real_step_ms": statistics.median(times), "unprofiled_steps_ms": times}
            (folder / f"rank{rank}.timing.json").write_text(json.dumps(timing, indent=1))
            row = {
                **summary(times),
                "trace": str(path.relative_to(out).parent),
                "profiled_steps": case.active,
                "profile_s": round(seconds, 2),
                "trace_kib": round(trace_kib(path), 1),
            }
            payload["variants"][variant] = row
            log(f"{case.name}/{variant}: median {row['median_ms']:.2f} ms, trace {row['trace_kib']:.0f} KiB")
            del step
            import gc

            gc.collect()
            if s.device.type == "cuda":
                torch.cuda.empty_cache()
        v = payload["variants"]
        if "problem" in v and "fixed" in v:
            p, f = v["problem"]["median_ms"], v["fixed"]["median_ms"]
            payload["realized_gain"] = (p - f) / p
    except Exception as exc:  # a failed case is recorded and the matrix goes on
        payload["error"] = error_text(exc)
        log(f"{case.name}: FAILED {payload['error'][:300]}")
    if rank == 0:
        write_case(results, case.name, payload)
