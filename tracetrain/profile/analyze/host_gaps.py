"""While the GPU waited for the host, what was the host doing?

An idle gap is explained by what the host did during it, not by what launched the next kernel. Every
stretch of GPU idle inside the steps that `utilisation.py` charged to the host side (data loader,
sync, communication, host) is split by the host activity under it, the first that applies:

| activity      | the host was ...                                                            |
|---------------|-----------------------------------------------------------------------------|
| data_loader   | inside a data-loading range (`enumerate(DataLoader)#...__next__`, ...)       |
| collective    | inside a `c10d::`/`nccl:` call (a blocking collective: a peer is late)      |
| pageable_copy | in the runtime call of a copy from/to pageable host memory (it blocks)      |
| sync          | in a host sync (`cudaStreamSynchronize`, `.item()`, `cudaMemcpy`)            |
| compile       | compiling (TorchDynamo / Inductor ranges: a recompilation in the step)      |
| cpu_optimizer | inside the optimizer step, in operators that launch no GPU work (CPU tensors) |
| cpu_ops       | in other operators that launch no GPU work (CPU tensor work in the loop)    |
| dispatch      | in operators that launch GPU work (dispatch and launch overhead)             |
| python        | in no recorded operator: Python between launches                            |

Each row keeps the host events that overlap its idle the most (`top`), for the advice's evidence, and
its idle less the profiler's recording cost (`corrected_us`, see overhead.py).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from tracetrain.profile.analyze.categories import (
    is_comm_range,
    is_data_range,
    is_pageable_copy,
    is_sync_op,
    is_sync_runtime,
    phase_of,
)
from tracetrain.profile.analyze.columns import ANNOTATION, MEMCPY, OP, RUNTIME
from tracetrain.profile.analyze.intervals import EMPTY, Spans, intersect, measure_between, subtract, union
from tracetrain.profile.analyze.overhead import events_in
from tracetrain.profile.analyze.select import host_rows, name_mask
from tracetrain.profile.analyze.trace import Trace

ACTIVITIES: Final = (
    "data_loader",
    "collective",
    "pageable_copy",
    "sync",
    "compile",
    "cpu_optimizer",
    "cpu_ops",
    "dispatch",
    "python",
)
CHARGED: Final = ("data_loader", "sync", "communication", "host")
_COMPILE: Final = re.compile(r"dynamo|inductor|compile_inner|compile_fx|aot_autograd|OutputGraph|_compile\.", re.I)


@dataclass(frozen=True)
class HostGapRow:
    """GPU idle (µs, over the profiled steps) under one host activity, and its top host events."""

    activity: str
    idle_us: float
    corrected_us: float
    top: list[tuple[str, float]] = field(default_factory=list)  # (event name, µs of idle it overlaps)


def _spans(trace: Trace, rows: np.ndarray) -> Spans:
    return union(trace.host.ts[rows], trace.host.ts[rows] + trace.host.dur[rows])


def _launching_ops(trace: Trace) -> np.ndarray:
    """Whether each host event is an operator inside which a GPU launch (a linked runtime call) ran."""
    linked = np.isin(trace.host.corr, trace.gpu.corr[trace.gpu.corr >= 0]) & (trace.host.kind == RUNTIME)
    launches = np.sort(trace.host.ts[linked & (trace.host.corr >= 0)])
    ts, end = trace.host.ts, trace.host.ts + trace.host.dur
    inside = np.searchsorted(launches, end, side="right") - np.searchsorted(launches, ts, side="left")
    return (trace.host.kind == OP) & (inside > 0)


def _pageable_runtime(trace: Trace) -> np.ndarray:
    pageable = (trace.gpu.kind == MEMCPY) & name_mask(trace, is_pageable_copy)[trace.gpu.name]
    corr = trace.gpu.corr[pageable]
    return np.flatnonzero((trace.host.kind == RUNTIME) & np.isin(trace.host.corr, corr[corr >= 0]))


def _activity_rows(trace: Trace) -> dict[str, Callable[[], np.ndarray]]:
    """Host rows marking each activity (python has none: it is what is left)."""
    launching = _launching_ops(trace)
    cpu_op = (trace.host.kind == OP) & ~launching
    optimizer = host_rows(trace, (ANNOTATION,), lambda n: phase_of(n) == "optimizer")
    opt_spans = _spans(trace, optimizer)
    in_optimizer = np.zeros(len(trace.host), dtype=bool)
    if len(opt_spans):
        index = np.searchsorted(opt_spans.starts, trace.host.ts, side="right") - 1
        in_optimizer = (index >= 0) & (trace.host.ts < opt_spans.ends[np.maximum(index, 0)])
    return {
        "data_loader": lambda: host_rows(trace, (ANNOTATION,), is_data_range),
        "collective": lambda: host_rows(trace, (OP, ANNOTATION), is_comm_range),
        "pageable_copy": lambda: _pageable_runtime(trace),
        "sync": lambda: np.concatenate(
            [host_rows(trace, (RUNTIME,), is_sync_runtime), host_rows(trace, (OP,), is_sync_op)]
        ),
        "compile": lambda: host_rows(trace, (OP, ANNOTATION), lambda n: bool(_COMPILE.search(n))),
        "cpu_optimizer": lambda: np.flatnonzero(cpu_op & in_optimizer),
        "cpu_ops": lambda: np.flatnonzero(cpu_op),
        "dispatch": lambda: np.flatnonzero(launching),
    }


def _top(trace: Trace, rows: np.ndarray, part: Spans, limit: int = 3) -> list[tuple[str, float]]:
    if not len(rows) or not len(part):
        return []
    overlap = measure_between(part, trace.host.ts[rows], trace.host.ts[rows] + trace.host.dur[rows])
    by_name: dict[str, float] = defaultdict(float)
    for name, us in zip(trace.host.name[rows].tolist(), overlap.tolist()):
        if us > 0:
            by_name[trace.names[name]] += us
    return sorted(by_name.items(), key=lambda item: -item[1])[:limit]


def host_gaps(trace: Trace, causes: dict[str, Spans], per_event_us: float) -> list[HostGapRow]:
    """The charged GPU idle split by host activity (module table), largest first."""
    parts = [causes[c] for c in CHARGED if c in causes and len(causes[c])]
    if not parts:
        return []
    left = union(np.concatenate([p.starts for p in parts]), np.concatenate([p.ends for p in parts]))
    rows_of = _activity_rows(trace)
    found: list[HostGapRow] = []
    for activity in ACTIVITIES:
        rows = rows_of[activity]() if activity in rows_of else np.zeros(0, dtype=np.int64)
        part = left if activity == "python" else intersect(left, _spans(trace, rows)) if len(rows) else EMPTY
        left = subtract(left, part)
        if not len(part):
            continue
        recording = np.minimum(part.ends - part.starts, per_event_us * events_in(trace, part)).sum()
        top = _top(trace, rows, part)
        found.append(HostGapRow(activity, part.total(), max(part.total() - float(recording), 0.0), top))
    return sorted(found, key=lambda row: -row.idle_us)


def activity(rows: list[HostGapRow], name: str) -> HostGapRow:
    """The row of one activity (an empty one when the host never did it during GPU idle)."""
    return next((row for row in rows if row.activity == name), HostGapRow(name, 0.0, 0.0))
