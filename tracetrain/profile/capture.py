"""Capture a chosen window of a training run: steps [start_step, start_step + num_steps).

Three instruments, all driven by the same step boundaries:
- the PyTorch profiler (CPU + CUDA activities, shapes, memory), its Kineto trace written gzipped to
  `RUN_DIR/profile/rank{R}.json.gz` and analysed at the end (report.html, report.json);
- NVTX ranges named like the trainer's phases (`step 12`, `tracetrain/forward`, ...), so an Nsight
  Systems timeline reads in the trainer's own vocabulary;
- `cudaProfilerStart/Stop` exactly around the window (`profile.cuda_profiler_api = true`), for
  `nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop tracetrain train ...`.
Unprofiled steps on both sides of the window are timed (`step_timer.py`, `rank{R}.timing.json`): the
analyzer reads the real step time from it to remove the profiler's own cost from host-side idle.
Phase names are the contract with the analyzer (`tracetrain/data_wait`, `tracetrain/forward`,
`tracetrain/backward`, `tracetrain/optimizer`, `tracetrain/checkpoint`, `tracetrain/eval`).

When profiling is off, `phase()` returns a shared null context: no profiler object exists and
nothing is recorded, so the profiler costs nothing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from tracetrain.config import ProfileSection
from tracetrain.profile.step_timer import StepTimer

_NULL = contextlib.nullcontext()


def current_rank() -> int:
    return int(os.environ.get("RANK", "0"))


class ProfileCapture:
    """Owns the profiler for one run. Call `step_begin(step)` / `step_end(step)` around every step
    (0-based step index) and wrap phases in `phase(name)`."""

    def __init__(self, cfg: ProfileSection, run_dir: Path, device: torch.device) -> None:
        self.cfg = cfg
        self.dir = run_dir / "profile"
        self.device = device
        self.rank = current_rank()
        self.on = cfg.enabled and ("all" in cfg.ranks or str(self.rank) in cfg.ranks)
        self.cuda = device.type == "cuda"
        self.nvtx = self.on and cfg.nvtx and self.cuda
        # 0-based indices of the profiled steps (the config counts steps from 1).
        self.first = cfg.start_step - 1
        self.last = self.first + cfg.num_steps - 1
        self.trace_paths: list[Path] = []
        self.profiler: torch.profiler.profile | None = None
        # Unprofiled steps around the window, for the real step time next to the profiled one.
        warmup = 1 if self.first >= 1 and not cfg.cuda_profiler_api else 0
        self.timer = StepTimer(self.first, self.last, warmup, device)
        self.profiler_due = self.on and not cfg.cuda_profiler_api  # started at the run's first step
        if self.on:
            self.dir.mkdir(parents=True, exist_ok=True)

    def _start_profiler(self, step: int) -> None:
        """Start the PyTorch profiler before the run's first step (0-based `step`: 0, or where a resumed
        run continues), counting steps as the trainer prints them, so the trace's `ProfilerStep#N` is
        step N of the run (the profiler would count its own `step()` calls from 0)."""
        first_number = step + 1
        self.profiler = self._make_profiler(first_number)
        self.profiler.step_num = first_number  # labels the running step; the schedule reads the same count
        self.profiler.start()

    def _make_profiler(self, first_number: int) -> torch.profiler.profile:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        # Over step numbers (1-based): nothing until the step before the window, warm up on it (the
        # profiler's own start-up cost lands there, not in the window), then record the window.
        start = self.first + 1
        warmup = 1 if start - 1 >= first_number else 0
        steps = torch.profiler.schedule(
            skip_first=start - warmup, wait=0, warmup=warmup, active=self.cfg.num_steps, repeat=1
        )

        def schedule(number: int) -> torch.profiler.ProfilerAction:
            # The profiler asks once for step 0, before its counter is set: answer for the first step.
            return steps(max(number, first_number))

        return torch.profiler.profile(
            activities=acts,
            schedule=schedule,
            on_trace_ready=self._write_trace,
            record_shapes=self.cfg.record_shapes,
            with_stack=self.cfg.with_stack,
            profile_memory=self.cfg.profile_memory,
        )

    def _write_trace(self, prof: torch.profiler.profile) -> None:
        path = self.dir / f"rank{self.rank}.json.gz"
        prof.export_chrome_trace(str(path))  # a .gz name makes torch write it gzipped
        self.trace_paths.append(path)

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        """A named range in the trace (and in NVTX); a no-op when profiling is off."""
        if not self.on:
            return _NULL
        return self._phase(name)

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        label = f"tracetrain/{name}"
        if self.nvtx:
            torch.cuda.nvtx.range_push(label)
        try:
            with torch.profiler.record_function(label):
                yield
        finally:
            if self.nvtx:
                torch.cuda.nvtx.range_pop()

    def step_begin(self, step: int) -> None:
        if not self.on:
            return
        if self.profiler_due:
            self.profiler_due = False
            self._start_profiler(step)
        if step == self.first:
            if self.cfg.cuda_profiler_api and self.cuda:
                torch.cuda.synchronize()  # the capture range must not include earlier queued work
                torch.cuda.profiler.start()
            if self.cfg.memory_snapshot and self.cuda:
                torch.cuda.memory._record_memory_history(max_entries=200_000)
        if self.nvtx:
            torch.cuda.nvtx.range_push(f"step {step + 1}")
        self.timer.begin(step)

    def step_end(self, step: int) -> None:
        if not self.on:
            return
        self.timer.end(step)
        if self.nvtx:
            torch.cuda.nvtx.range_pop()
        if self.profiler is not None:
            self.profiler.step()
        if step == self.last:
            if self.cfg.cuda_profiler_api and self.cuda:
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
            if self.cfg.memory_snapshot and self.cuda:
                torch.cuda.memory._dump_snapshot(str(self.dir / f"memory_snapshot_rank{self.rank}.pickle"))
                torch.cuda.memory._record_memory_history(enabled=None)

    def finish(self, note: Callable[[str], None]) -> dict[str, str]:
        """Stop the profiler, analyze the trace if asked; returns paths of what was written."""
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
        if not self.on or getattr(self, "_finished", False):
            return {}
        self._finished = True
        out: dict[str, str] = {"profile_dir": str(self.dir)}
        if self.cfg.cuda_profiler_api:
            note(
                "profile: cudaProfilerStart/Stop placed around steps "
                f"{self.first + 1}-{self.last + 1} for nsys --capture-range=cudaProfilerApi"
            )
            return out
        if not self.trace_paths:
            note(
                f"profile: the run ended before step {self.last + 1}; no trace was written "
                "(raise train.steps or lower profile.start_step)"
            )
            return out
        out["trace"] = str(self.trace_paths[-1])
        timing = self.timer.write(self.trace_paths[-1], self.cfg.num_steps)
        if timing is not None:
            out["timing"] = str(timing)
            note(f"profile: real step time (unprofiled, around the window) written to {timing}")
        if self.cfg.analyze:
            out.update(analyze_to_dir(self.trace_paths, self.dir, self.device))
        return out


def analyze_to_dir(paths: list[Path], out_dir: Path, device: torch.device) -> dict[str, str]:
    """Run the analyzer on captured traces; write report.html and report.json; print the summary."""
    import json

    from tracetrain.profile.analyze import analyze, render_html, render_json, render_terminal

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    report = analyze([str(p) for p in paths], device_name=name)
    (out_dir / "report.html").write_text(render_html(report))
    (out_dir / "report.json").write_text(json.dumps(render_json(report), indent=2))
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # logs and CI: do not squeeze the tables into 80 columns
        console = Console(width=160)
    render_terminal(report, console)
    return {"report_html": str(out_dir / "report.html"), "report_json": str(out_dir / "report.json")}
