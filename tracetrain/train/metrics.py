"""Per-step metrics: loss, grad norm, lr, tokens/s, MFU, data-wait vs compute time, peak memory.

Device values (loss, grad norm, finite flag) stay on the device until `flush`, which reads a whole
interval with one host sync. Each step's own duration comes from markers recorded after each step (CUDA
events on the GPU, read after that sync; the clock on the CPU), so it covers the GPU work of that step and
any time the GPU waited for it, without a sync per step. The console shows the interval's throughput;
`summary()` gives the whole run's after warm-up (compile, allocator growth). Records go to
`metrics.jsonl` (schema in docs/metrics.md), the console and the trackers (train/tracking.py: the report
page, TensorBoard, MLflow, W&B).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tracetrain.errors import TracetrainError
from tracetrain.train.rundir import open_no_follow


@dataclass
class _Pending:
    step: int
    loss: torch.Tensor
    grad_norm: torch.Tensor
    finite: torch.Tensor
    diverged: torch.Tensor
    lr: float
    tokens: int
    data_wait_s: float
    start: Any  # step markers: torch.cuda.Event on the GPU, perf_counter seconds on the CPU
    end: Any
    time: float  # unix seconds when the step was recorded
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # the objective's (preference: rewards)


@dataclass
class MetricsLogger:
    run_dir: Path
    device: torch.device
    flops_per_token: float  # model FLOPs (MFU convention, see models/accounting.py)
    peak_flops: float | None  # None: unknown device, MFU is not reported
    max_bad_steps: int
    filename: str = "metrics.jsonl"  # other ranks of a job write under logs/
    pending: list[_Pending] = field(default_factory=list)
    bad_streak: int = 0
    skipped_steps: int = 0
    last: dict[str, Any] = field(default_factory=dict)
    trackers: list[Any] = field(default_factory=list)  # train/tracking.py, rank 0 only
    timed: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) of each step this process ran

    def __post_init__(self) -> None:
        path = self.run_dir / self.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)  # never appended through a link
        # Unbuffered: each line is one write(2), so a failed write (disk full) leaves nothing pending that
        # close() would try, and fail, to write again.
        self.file = open(fd, "ab", buffering=0)  # noqa: SIM115  # open for the run's life; close() closes it
        self.window_start = time.perf_counter()
        self.mark = self._marker()

    def record(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        finite: torch.Tensor,
        diverged: torch.Tensor,
        lr: float,
        tokens: int,
        data_wait_s: float,
        stats: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Remember one step's values without reading them from the device (`stats`: the objective's
        own, e.g. a preference objective's reward margin and accuracy, written under their names)."""
        end = self._marker()
        self.pending.append(
            _Pending(
                step,
                loss,
                grad_norm,
                finite,
                diverged,
                lr,
                tokens,
                data_wait_s,
                self.mark,
                end,
                time.time(),
                stats or {},
            )
        )
        self.mark = end

    def restart_window(self) -> None:
        """Exclude time spent outside training steps (eval, checkpoints) from throughput."""
        self.window_start = time.perf_counter()
        self.mark = self._marker()

    def _marker(self) -> Any:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @staticmethod
    def _seconds(start: Any, end: Any) -> float:
        if isinstance(start, float):
            return end - start
        return start.elapsed_time(end) / 1000.0  # both recorded and done: read after flush's sync

    def write(self, rec: dict[str, Any]) -> None:
        """One metrics.jsonl line, and the same record to the trackers (TensorBoard is one)."""
        try:
            self.file.write((json.dumps(rec) + "\n").encode())
        except OSError as e:  # name the file: a full disk's error says only "No space left on device"
            raise OSError(e.errno, e.strerror, str(self.run_dir / self.filename)) from e
        for tracker in self.trackers:
            tracker.log(rec)

    def flush(self) -> dict[str, Any] | None:
        """Read the pending steps (one host sync), write them, and return the interval's summary."""
        if not self.pending:
            return None
        # The one host sync of the interval: the stacked values can only be read once the GPU is done.
        rows = [
            [p.loss.float(), p.grad_norm.float(), p.finite.float(), p.diverged.float()]
            + [v.float() for v in p.stats.values()]
            for p in self.pending
        ]
        flat = torch.stack([v for row in rows for v in row]).tolist()
        values, at = [], 0
        for row in rows:
            values.append(flat[at : at + len(row)])
            at += len(row)
        elapsed = time.perf_counter() - self.window_start
        tokens = sum(p.tokens for p in self.pending)
        data_wait = sum(p.data_wait_s for p in self.pending)
        tokens_per_s = tokens / elapsed if elapsed > 0 else 0.0
        memory = self.memory()
        for p, (loss, gnorm, finite, diverged, *stat_values) in zip(self.pending, values):
            self._count_bad(finite > 0, diverged > 0, p.step)
            step_s = self._seconds(p.start, p.end)
            self.timed.append((p.tokens, step_s))
            own = p.tokens / step_s if step_s > 0 else 0.0
            rec = {
                "kind": "train",
                "step": p.step + 1,
                "time": round(p.time, 3),
                "loss": loss,
                "grad_norm": gnorm,
                "lr": p.lr,
                "skipped": finite == 0,
                "tokens": p.tokens,
                "tokens_per_s": own,
                "mfu": self._mfu(own),
                "step_s": step_s,
                "data_wait_s": p.data_wait_s,
                "compute_s": max(0.0, step_s - p.data_wait_s),
                **dict(zip(p.stats, stat_values)),
                **memory,
            }
            self.write(rec)
        self.last = {
            **rec,
            "tokens_per_s": tokens_per_s,  # the console shows the interval's throughput
            "mfu": self._mfu(tokens_per_s),
            "data_wait_share": data_wait / elapsed if elapsed > 0 else 0.0,
            "skipped_total": self.skipped_steps,
        }
        self.pending.clear()
        for tracker in self.trackers:
            tracker.refresh()
        self.window_start = time.perf_counter()
        return self.last

    def _mfu(self, tokens_per_s: float) -> float | None:
        return tokens_per_s * self.flops_per_token / self.peak_flops if self.peak_flops else None

    def throughput(self) -> dict[str, Any]:
        """The whole run's tokens/s (this process's steps) after warm-up: the first 10% of the steps, at
        least one when there are two or more (compile, allocator growth, the first data)."""
        n = len(self.timed)
        warmup = min(n - 1, max(1, n // 10)) if n > 1 else 0
        tokens = sum(t for t, _ in self.timed[warmup:])
        seconds = sum(s for _, s in self.timed[warmup:])
        tokens_per_s = tokens / seconds if seconds > 0 else None
        return {
            "tokens_per_s": tokens_per_s,
            "mfu": self._mfu(tokens_per_s) if tokens_per_s else None,
            "throughput_steps": n - warmup,
            "throughput_warmup_steps": warmup,
        }

    def _count_bad(self, applied: bool, diverged: bool, step: int) -> None:
        self.skipped_steps += 0 if applied else 1
        self.bad_streak = self.bad_streak + 1 if diverged else 0
        if self.bad_streak >= self.max_bad_steps:
            raise TracetrainError(
                f"loss or gradient was NaN/inf for {self.bad_streak} steps in a row (last at step {step + 1}); "
                "stopping. Try a lower optim.lr, train.grad_clip > 0, or bf16 instead of fp16"
            )

    def memory(self) -> dict[str, float]:
        if self.device.type == "cuda":
            return {
                "mem_peak_alloc_gib": torch.cuda.max_memory_allocated(self.device) / 2**30,
                "mem_peak_reserved_gib": torch.cuda.max_memory_reserved(self.device) / 2**30,
            }
        # CPU: peak resident set size of the process (ru_maxrss is KiB on Linux, bytes on macOS).
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"mem_peak_rss_gib": rss / (2**30 if sys.platform == "darwin" else 2**20)}

    def log_eval(self, step: int, values: dict[str, Any], final: bool = False) -> None:
        rec = {"kind": "eval", "step": step, "time": round(time.time(), 3), **values}
        if final:
            rec["final"] = True
        self.write(rec)

    def finish_trackers(self, summary: dict[str, Any] | None) -> None:
        """End every tracker's run with the summary (None: the run failed)."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.finish(summary)

    def close(self) -> None:
        self.finish_trackers(None)  # still open only when the run did not reach its summary
        self.file.close()


def format_line(rec: dict[str, Any], total_steps: int) -> str:
    """One console line for an interval summary."""
    parts = [
        f"step {rec['step']:>6}/{total_steps}",
        f"loss {rec['loss']:.4f}",
        f"gnorm {rec['grad_norm']:.3f}",
        f"lr {rec['lr']:.2e}",
        f"{rec['tokens_per_s']:,.0f} tok/s",
    ]
    if rec.get("mfu") is not None:
        parts.append(f"MFU {100 * rec['mfu']:.1f}%")
    parts.append(f"data {100 * rec.get('data_wait_share', 0):.0f}%")
    mem = rec.get("mem_peak_alloc_gib", rec.get("mem_peak_rss_gib"))
    if mem is not None:
        parts.append(f"mem {mem:.2f} GiB" + (" (rss)" if "mem_peak_rss_gib" in rec else ""))
    if rec.get("skipped_total"):
        parts.append(f"skipped {rec['skipped_total']}")
    return " | ".join(parts)
