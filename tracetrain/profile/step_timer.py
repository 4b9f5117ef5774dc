"""The real step time next to the profiled one: a few unprofiled steps timed on each side of the window.

The profiler slows the host (each recorded operator costs microseconds), so a host-bound step is
longer in the trace than in the run. `StepTimer` times up to `NUM_EACH_SIDE` steps before the
profiler's warm-up step and as many after the window, wall clock with the device synchronised at both
ends of each timed step (on the CPU just wall clock), and writes `rank{R}.timing.json` beside the
trace. The analyzer (analyze/overhead.py) reads it and removes the difference from the host-side idle.
The synchronisation only happens on those few steps, never in the profiled ones.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Final

import torch

NUM_EACH_SIDE: Final = 3


class StepTimer:
    """Times the unprofiled steps around the profiled window [first, last] (0-based step indices);
    `warmup` is the number of profiler warm-up steps just before `first` (recorded, so not timed)."""

    def __init__(self, first: int, last: int, warmup: int, device: torch.device) -> None:
        before_end = first - warmup  # the warm-up step already runs under the profiler
        self.timed = set(range(max(before_end - NUM_EACH_SIDE, 0), before_end))
        self.timed |= set(range(last + 1, last + 1 + NUM_EACH_SIDE))
        self.device = device
        self.before: list[float] = []
        self.after: list[float] = []
        self.last = last
        self._start: float | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin(self, step: int) -> None:
        if step in self.timed:
            self._sync()
            self._start = time.perf_counter()

    def end(self, step: int) -> None:
        if step not in self.timed or self._start is None:
            return
        self._sync()
        ms = (time.perf_counter() - self._start) * 1e3
        (self.after if step > self.last else self.before).append(ms)
        self._start = None

    def write(self, trace_path: Path, profiled_steps: int) -> Path | None:
        """`rank0.timing.json` beside `rank0.json.gz`; None when no step was timed (a run too short)."""
        times = self.before + self.after
        if not times:
            return None
        path = trace_path.with_name(trace_path.name.removesuffix(".gz").removesuffix(".json") + ".timing.json")
        payload = {
            "real_step_ms": statistics.median(times),
            "before_ms": self.before,
            "after_ms": self.after,
            "profiled_steps": profiled_steps,
            "how": "unprofiled steps around the window, wall clock, device synchronised at each end",
        }
        path.write_text(json.dumps(payload, indent=1))
        return path
