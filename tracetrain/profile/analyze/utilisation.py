"""How busy is the GPU, and when it is idle, what was the host doing?

Busy time is the union of kernel, memcpy and memset intervals on the rank's GPU (streams that
overlap count once) over the profiled wall time: from the first to the last event of the profiled
window, so the time between iterations counts as well.

Each idle stretch is attributed to one cause, in this order:

1. **outside_steps**: idle time outside every `ProfilerStep#N` range (when the trace has no step
   ranges, the whole window is one step);
2. **data_loader**: idle time during which the host was inside a data-loading range (by time);
3. **sync**: the refill after a host synchronisation (`cudaStreamSynchronize`, `.item()`,
   `cudaMemcpy` to the host, ...): idle time from the sync's start until the GPU runs from its queue
   again (the first GPU activity after the sync that the host had issued before the work ahead of it
   finished) or the next sync begins, at most the time the host spent inside the sync plus the launch
   latency of the first GPU work after it. The sync drains the queue, so the host's work after it
   (Python, small ops) shows as GPU idle until the host is ahead again; without the sync the host
   would have done that work earlier by the time it waited, and the next launch would have found work
   still queued, which bounds what the sync costs. Idle beyond that is the host's own pace (rule 5);
4. **communication**: the rest (after rule 3) of a gap that the host spent at least half of inside
   `c10d::`/`nccl:` calls (a blocking collective or barrier). NCCL kernels themselves are busy GPU
   time; their part that no compute overlaps is reported as `exposed_comm_us`;
5. **host**: everything else: the host was busy but launched work too slowly (launch-bound, Python
   overhead, small kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

from tracetrain.profile.analyze.categories import CATEGORIES, is_comm_range, is_data_range, is_sync_op, is_sync_runtime
from tracetrain.profile.analyze.columns import ANNOTATION, KERNEL, OP, RUNTIME
from tracetrain.profile.analyze.intervals import (
    Spans,
    complement,
    contains,
    covered_until,
    intersect,
    measure_between,
    subtract,
    time_at_measure,
    union,
)
from tracetrain.profile.analyze.select import gpu_categories, gpu_spans, host_spans, main_device, on_device, step_rows
from tracetrain.profile.analyze.trace import Trace

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
    launches_per_step: float  # GPU activities (kernels, copies, memsets) started inside steps, per step
    syncs_per_step: float  # host syncs (merged when nested, as `.item()` around its stream sync) per step
    has_step_ranges: bool
    timeline: list[TimelineBin]
    # Sync and host idle from a sync's start until the GPU runs from its queue again (refill_windows):
    # the stretch whose first part `idle_us["sync"]` charges to the sync, and the rest to the host.
    sync_refill_us: float = 0.0


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


def _fed_starts(trace: Trace, device: int) -> np.ndarray:
    """Sorted start times of the GPU activities that the host had launched before the GPU finished the
    work ahead of them: from such an activity on, the GPU runs from its queue, not at the host's pace."""
    rows = np.flatnonzero(on_device(trace, device))
    rows = rows[np.argsort(trace.gpu.ts[rows], kind="stable")]
    starts, ends = trace.gpu.ts[rows], trace.gpu.ts[rows] + trace.gpu.dur[rows]
    ahead_ends = np.concatenate([[-np.inf], np.maximum.accumulate(ends)[:-1]])
    return starts[trace.gpu.launch_ts[rows] < ahead_ends]  # an unknown (NaN) launch is never ahead


def _first_launch_latency(trace: Trace, device: int, times: np.ndarray) -> np.ndarray:
    """For each time, how long the first GPU activity launched after it waited from its launch call to
    its start (0 where none follows or the launch is unknown)."""
    rows = np.flatnonzero(on_device(trace, device) & np.isfinite(trace.gpu.launch_ts))
    if not len(rows):
        return np.zeros(len(times))
    rows = rows[np.argsort(trace.gpu.launch_ts[rows], kind="stable")]
    latency = np.append(np.maximum(trace.gpu.ts[rows] - trace.gpu.launch_ts[rows], 0.0), 0.0)
    return latency[np.searchsorted(trace.gpu.launch_ts[rows], times, side="left")]


def refill_windows(trace: Trace, device: int) -> Spans:
    """From each host sync's start until the GPU runs from its queue again, whatever the host did
    meanwhile (other syncs included): the drain and refill a sync starts, uncapped."""
    syncs = _sync_spans(trace)
    fed = _fed_starts(trace, device)
    fed_after = np.append(fed, np.inf)[np.searchsorted(fed, syncs.ends, side="right")]
    return union(syncs.starts, np.minimum(fed_after, trace.window[1]))


def sync_refill(trace: Trace, device: int, idle: Spans) -> Spans:
    """The part of `idle` that host syncs cost (rule 3 of the module docstring): per sync, from its
    start until the GPU runs from its queue again or the next sync starts, at most the time the host
    spent in the sync plus the launch latency of the first work after it (the empty queue exposes it)."""
    syncs = _sync_spans(trace)
    if not len(syncs):
        return Spans(np.zeros(0), np.zeros(0))
    fed = _fed_starts(trace, device)
    fed_after = np.append(fed, np.inf)[np.searchsorted(fed, syncs.ends, side="right")]
    until = np.minimum(fed_after, np.append(syncs.starts[1:], np.inf))
    cost = syncs.ends - syncs.starts + _first_launch_latency(trace, device, syncs.ends)
    # Where the idle time after the sync's start adds up to what the sync can cost.
    spent = time_at_measure(idle, covered_until(idle, syncs.starts) + cost)
    return intersect(idle, union(syncs.starts, np.minimum(until, spent)))


def idle_by_cause(trace: Trace, device: int) -> dict[str, Spans]:
    """Idle time of `device` split into the causes of the module docstring, as interval sets."""
    lo, hi = trace.window
    idle = complement(gpu_spans(trace, on_device(trace, device)), lo, hi)
    steps = _step_spans(trace)
    inside = intersect(idle, steps)
    data_ranges = host_spans(trace, (ANNOTATION,), is_data_range)
    sync = sync_refill(trace, device, subtract(inside, data_ranges))
    rest = subtract(subtract(inside, data_ranges), sync)
    # The communication rule looks at the idle gap each remaining stretch belongs to.
    parent = np.searchsorted(idle.starts, rest.starts, side="right") - 1
    gap_lo, gap_hi = idle.starts[parent], idle.ends[parent]
    comm_time = measure_between(host_spans(trace, (OP, ANNOTATION), is_comm_range), gap_lo, gap_hi)
    is_comm = comm_time >= 0.5 * (gap_hi - gap_lo)
    return {
        "data_loader": intersect(inside, data_ranges),
        "sync": sync,
        "communication": _select(rest, is_comm),
        "host": _select(rest, ~is_comm),
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


def utilisation(trace: Trace, num_bins: int = 240, causes: dict[str, Spans] | None = None) -> Utilisation:
    """GPU utilisation of the rank's main GPU, idle time by cause, per step and over the window.
    `causes` is `idle_by_cause(trace, main_device(trace))` when the caller has it already."""
    device = main_device(trace)
    lo, hi = trace.window
    mask = on_device(trace, device)
    busy = gpu_spans(trace, mask)
    comm = gpu_categories(trace) == _COMM
    exposed = subtract(gpu_spans(trace, mask & comm), gpu_spans(trace, mask & ~comm))
    causes = idle_by_cause(trace, device) if causes is None else causes
    steps = _step_table(trace, busy, causes, device)
    step_spans = _step_spans(trace)
    window_us = hi - lo
    refill = refill_windows(trace, device)
    return Utilisation(
        device=device,
        window_us=window_us,
        busy_us=busy.total(),
        busy_fraction=busy.total() / window_us if window_us > 0 else 0.0,
        exposed_comm_us=exposed.total(),
        idle_us={cause: spans.total() for cause, spans in causes.items()},
        steps=steps,
        steps_us=step_spans.total(),
        mean_step_us=float(np.mean([s.duration_us for s in steps])) if steps else window_us,
        launches_per_step=float(contains(step_spans, trace.gpu.ts[mask]).sum()) / max(len(steps), 1),
        syncs_per_step=float(contains(step_spans, _sync_spans(trace).starts).sum()) / max(len(steps), 1),
        has_step_ranges=bool(steps),
        timeline=busy_timeline(trace, busy, causes, num_bins),
        sync_refill_us=sum(intersect(causes[c], refill).total() for c in ("sync", "host")),
    )
