"""How busy is the GPU, and when it is idle, what was the host doing?

Busy time is the union of kernel, memcpy and memset intervals on the rank's GPU (streams that
overlap count once) over the profiled wall time: from the first to the last event of the profiled
window, so the time between iterations counts as well.

Each idle stretch is attributed to one cause (whole-gap rules are applied to each stretch of a gap):

1. **outside_steps**: idle time outside every `ProfilerStep#N` range (when the trace has no step
   ranges, the whole window is one step);
2. **data_loader**: idle time during which the host was inside a data-loading range (by time);
3. **sync**: the rest of a gap that a host synchronisation (`cudaStreamSynchronize`, `.item()`, ...)
   overlaps or ends in: the GPU queue drained while the host waited, and refills only after it;
4. **communication**: the rest of a gap that the host spent at least half of inside `c10d::`/`nccl:`
   calls (a blocking collective or barrier). NCCL kernels themselves are busy GPU time; their part that
   no compute overlaps is reported as `exposed_comm_us`;
5. **host**: everything else: the host was busy but launched work too slowly (launch-bound, Python
   overhead, small kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

from tracetrain.profile.analyze.categories import CATEGORIES, is_comm_range, is_data_range, is_sync_op, is_sync_runtime
from tracetrain.profile.analyze.intervals import Spans, complement, intersect, measure_between, subtract, touches, union
from tracetrain.profile.analyze.select import gpu_categories, gpu_spans, host_spans, main_device, on_device, step_rows
from tracetrain.profile.analyze.trace import ANNOTATION, KERNEL, OP, RUNTIME, Trace

IDLE_CAUSES: Final = ("data_loader", "sync", "communication", "host", "outside_steps")
_COMM = CATEGORIES.index("communication")


@dataclass(frozen=True)
class StepRow:
    """One `ProfilerStep#N`: times in µs, `start_us` relative to the window start."""

    name: str
    start_us: float
    duration_us: float
    busy_us: float
    busy_fraction: float
    idle_us: dict[str, float]
    num_kernels: int


@dataclass(frozen=True)
class TimelineBin:
    """One bin of the busy/idle timeline: fractions of the bin's width."""

    start_us: float
    width_us: float
    busy_fraction: float
    idle_fraction: dict[str, float]


@dataclass(frozen=True)
class Utilisation:
    """GPU busy time and idle time by cause, overall and per step (µs)."""

    device: int
    window_us: float
    busy_us: float
    busy_fraction: float
    exposed_comm_us: float
    idle_us: dict[str, float]
    steps: list[StepRow]
    steps_us: float  # time inside step ranges (the window when there are none)
    mean_step_us: float
    has_step_ranges: bool
    timeline: list[TimelineBin]


def _step_spans(trace: Trace) -> Spans:
    rows = step_rows(trace)
    if not len(rows):
        return Spans(np.array([trace.window[0]]), np.array([trace.window[1]]))
    return union(trace.host.ts[rows], trace.host.ts[rows] + trace.host.dur[rows])


def _sync_spans(trace: Trace) -> Spans:
    runtime = host_spans(trace, (RUNTIME,), is_sync_runtime)
    ops = host_spans(trace, (OP,), is_sync_op)
    return union(np.concatenate([runtime.starts, ops.starts]), np.concatenate([runtime.ends, ops.ends]))


def _select(spans: Spans, mask: np.ndarray) -> Spans:
    return Spans(spans.starts[mask], spans.ends[mask])


def idle_by_cause(trace: Trace, device: int) -> dict[str, Spans]:
    """Idle time of `device` split into the causes of the module docstring, as interval sets."""
    lo, hi = trace.window
    idle = complement(gpu_spans(trace, on_device(trace, device)), lo, hi)
    steps = _step_spans(trace)
    inside = intersect(idle, steps)
    data_ranges = host_spans(trace, (ANNOTATION,), is_data_range)
    rest = subtract(inside, data_ranges)
    # Whole-gap rules look at the idle gap each remaining stretch belongs to.
    parent = np.searchsorted(idle.starts, rest.starts, side="right") - 1
    gap_lo, gap_hi = idle.starts[parent], idle.ends[parent]
    is_sync = touches(_sync_spans(trace), gap_lo, gap_hi)
    comm_time = measure_between(host_spans(trace, (OP, ANNOTATION), is_comm_range), gap_lo, gap_hi)
    is_comm = ~is_sync & (comm_time >= 0.5 * (gap_hi - gap_lo))
    return {
        "data_loader": intersect(inside, data_ranges),
        "sync": _select(rest, is_sync),
        "communication": _select(rest, is_comm),
        "host": _select(rest, ~is_sync & ~is_comm),
        "outside_steps": subtract(idle, steps),
    }


def _step_table(trace: Trace, busy: Spans, causes: dict[str, Spans], device: int) -> list[StepRow]:
    rows = step_rows(trace)
    starts, ends = trace.host.ts[rows], trace.host.ts[rows] + trace.host.dur[rows]
    busy_us = measure_between(busy, starts, ends)
    idle = {cause: measure_between(spans, starts, ends) for cause, spans in causes.items()}
    kernel_ts = np.sort(trace.gpu.ts[on_device(trace, device) & (trace.gpu.kind == KERNEL)])
    counts = np.searchsorted(kernel_ts, ends) - np.searchsorted(kernel_ts, starts)
    return [
        StepRow(
            name=trace.names[trace.host.name[row]],
            start_us=float(starts[i] - trace.window[0]),
            duration_us=float(ends[i] - starts[i]),
            busy_us=float(busy_us[i]),
            busy_fraction=float(busy_us[i] / max(ends[i] - starts[i], 1e-9)),
            idle_us={cause: float(v[i]) for cause, v in idle.items() if cause != "outside_steps"},
            num_kernels=int(counts[i]),
        )
        for i, row in enumerate(rows.tolist())
    ]


def busy_timeline(trace: Trace, busy: Spans, causes: dict[str, Spans], num_bins: int) -> list[TimelineBin]:
    """The window cut into `num_bins` equal bins: busy and idle-cause fractions of each."""
    lo, hi = trace.window
    edges = np.linspace(lo, hi, num_bins + 1)
    width = max((hi - lo) / num_bins, 1e-9)
    busy_part = measure_between(busy, edges[:-1], edges[1:]) / width
    idle_parts = {cause: measure_between(spans, edges[:-1], edges[1:]) / width for cause, spans in causes.items()}
    return [
        TimelineBin(
            start_us=float(edges[i] - lo),
            width_us=float(width),
            busy_fraction=float(busy_part[i]),
            idle_fraction={cause: float(part[i]) for cause, part in idle_parts.items()},
        )
        for i in range(num_bins)
    ]


def utilisation(trace: Trace, num_bins: int = 240) -> Utilisation:
    """GPU utilisation of the rank's main GPU, idle time by cause, per step and over the window."""
    device = main_device(trace)
    lo, hi = trace.window
    mask = on_device(trace, device)
    busy = gpu_spans(trace, mask)
    comm = gpu_categories(trace) == _COMM
    exposed = subtract(gpu_spans(trace, mask & comm), gpu_spans(trace, mask & ~comm))
    causes = idle_by_cause(trace, device)
    steps = _step_table(trace, busy, causes, device)
    window_us = hi - lo
    return Utilisation(
        device=device,
        window_us=window_us,
        busy_us=busy.total(),
        busy_fraction=busy.total() / window_us if window_us > 0 else 0.0,
        exposed_comm_us=exposed.total(),
        idle_us={cause: spans.total() for cause, spans in causes.items()},
        steps=steps,
        steps_us=_step_spans(trace).total(),
        mean_step_us=float(np.mean([s.duration_us for s in steps])) if steps else window_us,
        has_step_ranges=bool(steps),
        timeline=busy_timeline(trace, busy, causes, num_bins),
    )
