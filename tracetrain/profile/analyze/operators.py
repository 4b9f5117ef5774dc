"""Which host operators take the time? The answer for a trace without GPU activity.

A CPU-only trace (a run on CPU, or a trace taken without `ProfilerActivity.CUDA`) has no kernels, so
the GPU analyses are empty and every step would read as GPU idle. What such a trace does hold is the
host's `cpu_op` events; this analyzer sums them per operator name:

- **total** time: the operator's ranges, children included (a recursive call, such as `aten::sum`
  inside `aten::sum`, counts in both, as in PyTorch's own `key_averages()` table);
- **self** time: total minus the time of the operators it calls directly, on the same thread. The
  self times of all operators add up to the time the host spent inside any operator, so the table
  shows where the host's time went without double counting. Host runtime calls (`cudaLaunchKernel`)
  are not operators and stay in their caller's self time; record_function ranges (`ProfilerStep#N`,
  `## forward ##`) are not operators either.

The record_function ranges other than steps (`gloo:all_reduce`, `## forward ##`, `DataLoader` ranges)
get the same table: in a CPU-only trace of a distributed run they are often where the time is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tracetrain.profile.analyze.categories import STEP_ANNOTATION
from tracetrain.profile.analyze.columns import ANNOTATION, OP
from tracetrain.profile.analyze.trace import Trace

MAX_OPERATORS = 15


@dataclass(frozen=True)
class OperatorRow:
    """One operator name: number of calls, total and self time (µs), self time's share of the host
    time spent inside operators."""

    name: str
    count: int
    total_us: float
    self_us: float
    self_share: float


def self_times(trace: Trace, rows: np.ndarray) -> np.ndarray:
    """Self time (µs) of each host row in `rows` (all of one kind, e.g. operators): its duration less
    the durations of the rows directly nested in it on the same thread."""
    host = trace.host
    ts, dur, thread = host.ts[rows], host.dur[rows], host.thread[rows]
    # Thread by thread, in time order; of two ranges starting together the longer one is the parent, and
    # of two identical ones the one written first (Kineto writes a caller before its callees, e.g.
    # `aten::item` before `aten::_local_scalar_dense`; lexsort is stable).
    order = np.lexsort((-dur, ts, thread))
    child_us = np.zeros(len(rows))
    stack: list[tuple[int, float, int]] = []  # (index into rows, end µs, thread)
    for i in order.tolist():
        start, end = ts[i], ts[i] + dur[i]
        while stack and (stack[-1][2] != thread[i] or stack[-1][1] <= start):
            stack.pop()
        if stack:
            child_us[stack[-1][0]] += dur[i]
        stack.append((i, end, int(thread[i])))
    # A child that outlasts its parent (clock rounding) must not make the parent's self time negative.
    return np.maximum(dur - child_us, 0.0)


@dataclass(frozen=True)
class HostTime:
    """Where the host's time went: operators (`cpu_op`) and record_function ranges other than
    `ProfilerStep#N`, each by self time, most first."""

    operators: list[OperatorRow] = field(default_factory=list)
    ranges: list[OperatorRow] = field(default_factory=list)


def host_time(trace: Trace, limit: int = MAX_OPERATORS) -> HostTime:
    """The `limit` operators and ranges with the most self time."""
    is_step = np.fromiter((bool(STEP_ANNOTATION.match(n)) for n in trace.names), dtype=bool, count=len(trace.names))
    kind, steps = trace.host.kind, is_step[trace.host.name] if len(trace.host) else np.zeros(0, dtype=bool)
    return HostTime(
        operators=_top(trace, np.flatnonzero(kind == OP), limit),
        ranges=_top(trace, np.flatnonzero((kind == ANNOTATION) & ~steps), limit),
    )


def _top(trace: Trace, rows: np.ndarray, limit: int) -> list[OperatorRow]:
    if not len(rows):
        return []
    self_us = self_times(trace, rows)
    names, inverse = np.unique(trace.host.name[rows], return_inverse=True)
    counts = np.bincount(inverse, minlength=len(names))
    total_by_name = np.bincount(inverse, weights=trace.host.dur[rows], minlength=len(names))
    self_by_name = np.bincount(inverse, weights=self_us, minlength=len(names))
    all_self_us = float(self_by_name.sum())
    best = np.argsort(-self_by_name, kind="stable")[:limit]
    return [
        OperatorRow(
            name=trace.names[int(names[k])],
            count=int(counts[k]),
            total_us=float(total_by_name[k]),
            self_us=float(self_by_name[k]),
            self_share=float(self_by_name[k]) / all_self_us if all_self_us > 0 else 0.0,
        )
        for k in best.tolist()
    ]
