"""Interval sets on the trace clock (microseconds), vectorised with numpy.

A `Spans` is a sorted list of disjoint half-open intervals. Utilisation, idle causes, overlap of
communication with compute and the HTML timeline are all set algebra over these: union (busy time
with overlapping streams counted once), complement (idle), intersection (overlap) and the measure of a
set between two times (busy time inside a step or a timeline bin), and its inverse (the time by which
a set has covered a given measure: where a host sync's share of the idle time after it runs out).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Spans:
    """Disjoint, sorted intervals `[starts[i], ends[i])` in microseconds."""

    starts: np.ndarray  # (n,) float64
    ends: np.ndarray  # (n,) float64

    def __len__(self) -> int:
        return len(self.starts)

    def total(self) -> float:
        return float(np.sum(self.ends - self.starts))


EMPTY = Spans(np.zeros(0), np.zeros(0))


def union(starts: np.ndarray, ends: np.ndarray) -> Spans:
    """Merge possibly overlapping intervals into disjoint ones (zero-length intervals are dropped)."""
    starts = np.asarray(starts, dtype=np.float64)
    ends = np.asarray(ends, dtype=np.float64)
    keep = ends > starts
    starts, ends = starts[keep], ends[keep]
    if len(starts) == 0:
        return EMPTY
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)
    # A new group starts where an interval begins after everything before it has ended.
    new_group = np.empty(len(starts), dtype=bool)
    new_group[0] = True
    new_group[1:] = starts[1:] > reach[:-1]
    first = np.flatnonzero(new_group)
    last = np.append(first[1:] - 1, len(starts) - 1)
    return Spans(starts[first], reach[last])


def complement(spans: Spans, lo: float, hi: float) -> Spans:
    """The gaps of `spans` inside `[lo, hi)`."""
    starts = np.concatenate([[lo], spans.ends])
    ends = np.concatenate([spans.starts, [hi]])
    return union(np.clip(starts, lo, hi), np.clip(ends, lo, hi))


def _bounds(*sets: Spans) -> tuple[float, float]:
    lows = [s.starts[0] for s in sets if len(s)]
    highs = [s.ends[-1] for s in sets if len(s)]
    return (min(lows), max(highs)) if lows else (0.0, 0.0)


def intersect(a: Spans, b: Spans) -> Spans:
    """Time covered by both: the complement of the union of the complements."""
    if not len(a) or not len(b):
        return EMPTY
    lo, hi = _bounds(a, b)
    gaps_a, gaps_b = complement(a, lo, hi), complement(b, lo, hi)
    either = union(np.concatenate([gaps_a.starts, gaps_b.starts]), np.concatenate([gaps_a.ends, gaps_b.ends]))
    return complement(either, lo, hi)


def subtract(a: Spans, b: Spans) -> Spans:
    """Time in `a` but not in `b`."""
    if not len(a) or not len(b):
        return a
    lo, hi = _bounds(a, b)
    return intersect(a, complement(b, lo, hi))


def covered_until(spans: Spans, times: np.ndarray) -> np.ndarray:
    """For each time t, the measure of `spans` before t."""
    times = np.asarray(times, dtype=np.float64)
    if not len(spans):
        return np.zeros_like(times)
    lengths = spans.ends - spans.starts
    cumulative = np.concatenate([[0.0], np.cumsum(lengths)])
    index = np.searchsorted(spans.starts, times, side="right")  # intervals starting at or before t
    previous = np.maximum(index - 1, 0)
    partial = np.clip(times - spans.starts[previous], 0.0, lengths[previous])
    return np.where(index > 0, cumulative[previous] + partial, 0.0)


def measure_between(spans: Spans, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Measure of `spans` inside each `[lo[i], hi[i])`."""
    return covered_until(spans, hi) - covered_until(spans, lo)


def contains(spans: Spans, times: np.ndarray) -> np.ndarray:
    """Whether each time lies inside `spans` (NaN times never do)."""
    times = np.asarray(times, dtype=np.float64)
    if not len(spans):
        return np.zeros(len(times), dtype=bool)
    index = np.searchsorted(spans.starts, np.nan_to_num(times, nan=-np.inf), side="right") - 1
    return (index >= 0) & (times <= spans.ends[np.maximum(index, 0)])


def time_at_measure(spans: Spans, measures: np.ndarray) -> np.ndarray:
    """For each measure m, the earliest time by which `spans` has covered m (the inverse of
    `covered_until`); infinity where m exceeds the total."""
    measures = np.asarray(measures, dtype=np.float64)
    if not len(spans):
        return np.full(measures.shape, np.inf)
    lengths = spans.ends - spans.starts
    cumulative = np.concatenate([[0.0], np.cumsum(lengths)])
    # The interval in which the running measure reaches m: the first whose end covers m.
    index = np.searchsorted(cumulative[1:], measures, side="left")
    inside = index < len(spans)
    safe = np.minimum(index, len(spans) - 1)
    return np.where(inside, spans.starts[safe] + np.maximum(measures - cumulative[safe], 0.0), np.inf)
