"""Selections over a parsed trace shared by the analyzers: events by name rule, the main GPU, the
category of every GPU event, and interval sets of host ranges and GPU activity."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tracetrain.profile.analyze.categories import CATEGORIES, STEP_ANNOTATION, kernel_category
from tracetrain.profile.analyze.columns import ANNOTATION, GPU_KIND_NAMES
from tracetrain.profile.analyze.intervals import Spans, union
from tracetrain.profile.analyze.trace import Trace


def name_mask(trace: Trace, predicate: Callable[[str], bool]) -> np.ndarray:
    """Boolean per interned name: whether `predicate(name)` holds (evaluated once per name)."""
    return np.fromiter((predicate(name) for name in trace.names), dtype=bool, count=len(trace.names))


def host_rows(trace: Trace, kinds: tuple[int, ...], predicate: Callable[[str], bool]) -> np.ndarray:
    """Indices of host events of the given kinds whose name satisfies `predicate`."""
    if not len(trace.host) or not trace.names:
        return np.zeros(0, dtype=np.int64)
    selected = name_mask(trace, predicate)[trace.host.name] & np.isin(trace.host.kind, kinds)
    return np.flatnonzero(selected)


def host_spans(trace: Trace, kinds: tuple[int, ...], predicate: Callable[[str], bool]) -> Spans:
    """The union of the time ranges of the selected host events."""
    rows = host_rows(trace, kinds, predicate)
    return union(trace.host.ts[rows], trace.host.ts[rows] + trace.host.dur[rows])


def step_rows(trace: Trace) -> np.ndarray:
    """`ProfilerStep#N` annotation rows, in time order."""
    rows = host_rows(trace, (ANNOTATION,), lambda name: bool(STEP_ANNOTATION.match(name)))
    return rows[np.argsort(trace.host.ts[rows], kind="stable")]


def main_device(trace: Trace) -> int:
    """The GPU with the most activity time (a rank's trace normally shows one); -1 without GPU events."""
    if not len(trace.gpu):
        return -1
    devices, inverse = np.unique(trace.gpu.device, return_inverse=True)
    return int(devices[np.argmax(np.bincount(inverse, weights=trace.gpu.dur))])


def gpu_categories(trace: Trace) -> np.ndarray:
    """Category index (into `CATEGORIES`) of every GPU event, computed once per (name, kind)."""
    if not len(trace.gpu):
        return np.zeros(0, dtype=np.int64)
    keys = trace.gpu.name.astype(np.int64) * len(GPU_KIND_NAMES) + trace.gpu.kind
    unique, inverse = np.unique(keys, return_inverse=True)
    codes = np.array(
        [
            CATEGORIES.index(
                kernel_category(trace.names[k // len(GPU_KIND_NAMES)], GPU_KIND_NAMES[k % len(GPU_KIND_NAMES)])
            )
            for k in unique.tolist()
        ],
        dtype=np.int64,
    )
    return codes[inverse]


def gpu_spans(trace: Trace, mask: np.ndarray | None = None) -> Spans:
    """Union of GPU activity intervals (all streams), optionally only the events in `mask`."""
    ts, dur = trace.gpu.ts, trace.gpu.dur
    if mask is not None:
        ts, dur = ts[mask], dur[mask]
    return union(ts, ts + dur)


def on_device(trace: Trace, device: int) -> np.ndarray:
    return trace.gpu.device == device
