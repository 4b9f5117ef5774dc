"""Communication, host<->device traffic, and GPU memory over time.

- Communication: NCCL kernels (category `communication`) on the rank's GPU. Overlapped time is the
  part of their union that other GPU work (compute kernels, copies) runs alongside; the rest is
  exposed: the step waits for the network, or for a slower rank to join the collective. One row per
  rank (one trace file per rank).
- Offload / unified memory: time and bytes of host-to-device and device-to-host copies (parameter,
  optimizer-state or activation offload all show up here) and unified-memory page-fault/migration
  events when the trace has them.
- Memory: `[memory]` events (with `profile_memory=True`) give the CUDA caching allocator's allocated
  and reserved bytes after each allocation; the peak against the device's capacity is the headroom.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracetrain.profile.analyze.categories import CATEGORIES, collective_of
from tracetrain.profile.analyze.intervals import intersect, union
from tracetrain.profile.analyze.select import gpu_categories, gpu_spans, main_device, on_device
from tracetrain.profile.analyze.trace import Trace

_COMM = CATEGORIES.index("communication")
_H2D, _D2H = CATEGORIES.index("memcpy_h2d"), CATEGORIES.index("memcpy_d2h")
MAX_MEMORY_POINTS = 400


@dataclass(frozen=True)
class CommRow:
    """One rank's NCCL time (µs): total (union), overlapped with other GPU work, exposed."""

    rank: int
    num_kernels: int
    comm_us: float
    overlapped_us: float
    exposed_us: float
    comm_share: float  # of GPU busy time
    overlap_fraction: float  # of communication time
    exposed_fraction: float  # of time inside steps
    collectives: dict[str, float]  # AllReduce, ReduceScatter, ... -> summed kernel µs


@dataclass(frozen=True)
class OffloadRow:
    """Host<->device copies and unified-memory activity (µs, bytes); `copy_fraction` of the window."""

    h2d_us: float
    h2d_bytes: int
    d2h_us: float
    d2h_bytes: int
    copy_fraction: float
    num_unified_events: int
    unified_us: float
    unified_bytes: int


@dataclass(frozen=True)
class MemoryTimeline:
    """Allocator bytes on the rank's GPU; `points` are (µs from window start, allocated bytes)."""

    device: int
    num_events: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    capacity_bytes: int | None
    headroom_fraction: float | None
    points: list[tuple[float, int]]


def communication(trace: Trace, steps_us: float) -> CommRow:
    """NCCL time, its overlap with other GPU work and the exposed rest, for this rank."""
    device = on_device(trace, main_device(trace))
    comm = device & (gpu_categories(trace) == _COMM)
    comm_spans, other_spans = gpu_spans(trace, comm), gpu_spans(trace, device & ~comm)
    overlapped = intersect(comm_spans, other_spans).total()
    busy = union(
        np.concatenate([comm_spans.starts, other_spans.starts]), np.concatenate([comm_spans.ends, other_spans.ends])
    ).total()
    collectives: dict[str, float] = {}
    for row in np.flatnonzero(comm).tolist():
        name = collective_of(trace.names[trace.gpu.name[row]])
        collectives[name] = collectives.get(name, 0.0) + float(trace.gpu.dur[row])
    total = comm_spans.total()
    return CommRow(
        rank=trace.rank,
        num_kernels=int(comm.sum()),
        comm_us=total,
        overlapped_us=overlapped,
        exposed_us=total - overlapped,
        comm_share=total / busy if busy else 0.0,
        overlap_fraction=overlapped / total if total else 0.0,
        exposed_fraction=(total - overlapped) / steps_us if steps_us else 0.0,
        collectives=collectives,
    )


def offload(trace: Trace) -> OffloadRow:
    """H2D/D2H copy time and bytes, their share of the window, and unified-memory events."""
    device = on_device(trace, main_device(trace))
    codes = gpu_categories(trace)
    h2d, d2h = device & (codes == _H2D), device & (codes == _D2H)
    copies = gpu_spans(trace, h2d | d2h)
    window_us = trace.window[1] - trace.window[0]
    return OffloadRow(
        h2d_us=float(trace.gpu.dur[h2d].sum()),
        h2d_bytes=int(np.maximum(trace.gpu.bytes[h2d], 0).sum()),
        d2h_us=float(trace.gpu.dur[d2h].sum()),
        d2h_bytes=int(np.maximum(trace.gpu.bytes[d2h], 0).sum()),
        copy_fraction=copies.total() / window_us if window_us > 0 else 0.0,
        num_unified_events=len(trace.unified),
        unified_us=float(np.nansum(trace.unified.dur)),
        unified_bytes=int(np.maximum(trace.unified.bytes, 0).sum()),
    )


def _downsample(ts: np.ndarray, values: np.ndarray, max_points: int) -> list[tuple[float, int]]:
    """At most `max_points` points: the maximum of each run of consecutive samples (keeps the peak)."""
    order = np.argsort(ts, kind="stable")
    ts, values = ts[order], values[order]
    if len(ts) > max_points:
        chunks = np.array_split(np.arange(len(ts)), max_points)
        picks = np.array([chunk[np.argmax(values[chunk])] for chunk in chunks])
        ts, values = ts[picks], values[picks]
    return [(float(t), int(v)) for t, v in zip(ts.tolist(), values.tolist())]


def memory_timeline(trace: Trace, capacity_bytes: int | None) -> MemoryTimeline | None:
    """Allocated/reserved bytes over time on the rank's GPU; None without GPU memory events."""
    device = main_device(trace)
    rows = np.flatnonzero((trace.memory.device == device) & (trace.memory.device >= 0))
    if not len(rows):
        return None
    allocated, reserved = trace.memory.allocated[rows], trace.memory.reserved[rows]
    peak_reserved = int(max(reserved.max(), allocated.max()))
    return MemoryTimeline(
        device=device,
        num_events=len(rows),
        peak_allocated_bytes=int(allocated.max()),
        peak_reserved_bytes=peak_reserved,
        capacity_bytes=capacity_bytes,
        headroom_fraction=1.0 - peak_reserved / capacity_bytes if capacity_bytes else None,
        points=_downsample(trace.memory.ts[rows] - trace.window[0], allocated, MAX_MEMORY_POINTS),
    )
