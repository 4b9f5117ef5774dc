"""Where does GPU time go? Top kernels, time by category, and host<->device copies.

Shares are of the summed duration of all GPU activities on the rank's main GPU (kernels, copies,
memsets; overlapping streams are summed here, unlike utilisation's busy time). Categories follow the
rules table in `categories.py`. Copy bandwidth is bytes over copy time; a copy from or to pageable
host memory is staged by the driver through a pinned buffer, so it is slower and blocks the host.

Each top kernel names the CPU operator that launched it: the kernel's correlation id finds its runtime
launch (`cudaLaunchKernel`, or the `ac2g` flow when that event is missing), and the innermost `cpu_op`
open on that thread at that moment is the operator (`link.py`; the same op whose `External id` the
kernel carries). A kernel launched by several operators names the one with most of its GPU time and
that operator's share of it, counting only launches found in the trace (the first kernels of a window
were often launched before the profiler started recording the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tracetrain.profile.analyze.categories import CATEGORIES, MEMCPY_CATEGORIES, is_pageable_copy, short_kernel_name
from tracetrain.profile.analyze.select import gpu_categories, main_device, name_mask, on_device
from tracetrain.profile.analyze.trace import Trace


@dataclass(frozen=True)
class KernelRow:
    """One kernel name: launches, total and mean time (µs), share of GPU time, and the CPU operator
    that launched it (`launched_by`, None when no launch was found; `launched_by_share` of the
    kernel's time with a known launch came from that operator)."""

    name: str
    full_name: str
    category: str
    count: int
    total_us: float
    mean_us: float
    share: float
    launched_by: str | None
    launched_by_share: float


@dataclass(frozen=True)
class CategoryRow:
    """One category: launches, total and mean time (µs), share of GPU time and of the window."""

    category: str
    count: int
    total_us: float
    mean_us: float
    share: float
    window_share: float


@dataclass(frozen=True)
class MemcpyRow:
    """Copies in one direction; bandwidth in GB/s (1e9 bytes/s); pageable = unpinned host memory."""

    direction: str
    count: int
    total_bytes: int
    total_us: float
    gb_per_s: float | None
    pageable_count: int
    pageable_bytes: int
    pageable_us: float


@dataclass(frozen=True)
class KernelBreakdown:
    total_gpu_us: float
    num_gpu_events: int
    top: list[KernelRow]
    categories: list[CategoryRow]
    memcpy: list[MemcpyRow]


def _launcher(trace: Trace, rows: np.ndarray) -> tuple[str | None, float]:
    """The operator that launched most of the GPU time of `rows` (one kernel name), and its share of
    the time whose launch is in the trace (kernels launched before the profiled window have none)."""
    ops = trace.gpu.op[rows]
    known = ops >= 0
    if not known.any():
        return None, 0.0
    op_names, inverse = np.unique(trace.host.name[ops[known]], return_inverse=True)
    durations = trace.gpu.dur[rows][known]
    if durations.sum() > 0:
        time = np.bincount(inverse, weights=durations, minlength=len(op_names))
        best = int(np.argmax(time))
        return trace.names[op_names[best]], float(time[best] / durations.sum())
    count = np.bincount(inverse, minlength=len(op_names))  # zero-length kernels: count launches
    best = int(np.argmax(count))
    return trace.names[op_names[best]], float(count[best] / len(durations))


def _top_kernels(trace: Trace, rows: np.ndarray, codes: np.ndarray, total: float, top_n: int) -> list[KernelRow]:
    names, inverse = np.unique(trace.gpu.name[rows], return_inverse=True)
    time = np.bincount(inverse, weights=trace.gpu.dur[rows], minlength=len(names))
    count = np.bincount(inverse, minlength=len(names))
    first = np.zeros(len(names), dtype=np.int64)
    first[inverse] = np.arange(len(rows))  # some row of each name, for its category
    order = np.argsort(-time, kind="stable")[:top_n]
    table = []
    for i in order.tolist():
        launched_by, launched_by_share = _launcher(trace, rows[inverse == i])
        table.append(
            KernelRow(
                name=short_kernel_name(trace.names[names[i]]),
                full_name=trace.names[names[i]],
                category=CATEGORIES[codes[rows[first[i]]]],
                count=int(count[i]),
                total_us=float(time[i]),
                mean_us=float(time[i] / count[i]),
                share=float(time[i] / total) if total > 0 else 0.0,
                launched_by=launched_by,
                launched_by_share=launched_by_share,
            )
        )
    return table


def _category_table(trace: Trace, rows: np.ndarray, codes: np.ndarray, total: float) -> list[CategoryRow]:
    time = np.bincount(codes[rows], weights=trace.gpu.dur[rows], minlength=len(CATEGORIES))
    count = np.bincount(codes[rows], minlength=len(CATEGORIES))
    window_us = trace.window[1] - trace.window[0]
    table = [
        CategoryRow(
            category=category,
            count=int(count[i]),
            total_us=float(time[i]),
            mean_us=float(time[i] / count[i]),
            share=float(time[i] / total),
            window_share=float(time[i] / window_us) if window_us > 0 else 0.0,
        )
        for i, category in enumerate(CATEGORIES)
        if count[i]
    ]
    return sorted(table, key=lambda row: -row.total_us)


def _memcpy_table(trace: Trace, rows: np.ndarray, codes: np.ndarray) -> list[MemcpyRow]:
    pageable = name_mask(trace, is_pageable_copy)[trace.gpu.name] if trace.names else np.zeros(0, bool)
    table = []
    for direction in MEMCPY_CATEGORIES:
        sel = rows[codes[rows] == CATEGORIES.index(direction)]
        if not len(sel):
            continue
        nbytes = np.maximum(trace.gpu.bytes[sel], 0)
        known = trace.gpu.bytes[sel] >= 0
        known_us = float(trace.gpu.dur[sel][known].sum())
        paged = sel[pageable[sel]]
        table.append(
            MemcpyRow(
                direction=direction.removeprefix("memcpy_"),
                count=len(sel),
                total_bytes=int(nbytes.sum()),
                total_us=float(trace.gpu.dur[sel].sum()),
                gb_per_s=float(nbytes.sum() / (known_us * 1e3)) if known_us > 0 else None,
                pageable_count=len(paged),
                pageable_bytes=int(np.maximum(trace.gpu.bytes[paged], 0).sum()),
                pageable_us=float(trace.gpu.dur[paged].sum()),
            )
        )
    return table


def kernel_breakdown(trace: Trace, top_n: int = 15) -> KernelBreakdown:
    """Top `top_n` kernels by total time, time per category, and copies by direction."""
    rows = np.flatnonzero(on_device(trace, main_device(trace)))
    if not len(rows):
        return KernelBreakdown(0.0, 0, [], [], [])
    codes = gpu_categories(trace)
    total = float(trace.gpu.dur[rows].sum())
    return KernelBreakdown(
        total_gpu_us=total,
        num_gpu_events=len(rows),
        top=_top_kernels(trace, rows, codes, total, top_n),
        categories=_category_table(trace, rows, codes, total),
        memcpy=_memcpy_table(trace, rows, codes),
    )
