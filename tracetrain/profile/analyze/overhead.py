"""How much did the profiler itself slow the host, and how much GPU idle did that add?

Every recorded host event (an operator, a CUDA runtime call) costs the profiler a few microseconds.
Where the GPU waits for the host (idle charged to the host's pace, to the refill after a sync, or to
the data loader), that cost lengthens the idle one for one; where the GPU is busy, the host's extra
time hides behind the queue. So the unprofiled run differs from the trace in its host-side idle:

- **measured**: `tracetrain profile` times unprofiled steps on both sides of the profiled window
  (`rank{R}.timing.json` beside the trace). The difference `profiled - real` per step is removed from
  the host-side idle, shared between the causes in proportion to their estimated overhead (below),
  never more than a cause's idle less its round trip (below; what a cause cannot take goes to the
  others);
- **estimated** (any other program's trace): the recording cost per event is twice the 10th
  percentile of the gaps between back-to-back top-level operators on the busiest host thread (what
  an empty gap costs: one op's end and the next one's start, both recorded; none when that floor is
  over 5 µs, which is the program's own Python, not recording). Each idle gap loses
  that cost per host event recorded on the host's path to the launch that ends it: from the launch
  of the GPU work that ran last before the gap to the gap's end (events recorded while the GPU still
  had earlier work queued hide behind it); at most the gap. On the
  H100 traces of benchmarks/host_sync_traces.py this gives 4-6 µs per event with shapes recorded,
  against 4.4-5.2 µs measured (profiled minus unprofiled step time over events per step). An
  estimate under 2% of the step is not applied (within run-to-run noise).

Either way, a sync's idle keeps its **round trip**: the stretches in which the GPU waited for work the
host had already issued (the device-to-host copy's and the next kernel's launch latency) or the host
still sat in the sync call (the device finishing, the host waking up). That is device and driver time,
which the profiler's per-event cost does not lengthen, and a sync leaves the queue empty in the
unprofiled run too, so it is paid there as well: no correction removes it (`protected_us`), and what it
would have taken goes to the other host-paced idle. On the advice-truth corpus (`item_per_param`, 76
`.item()` a step on an H200) the round trip is 40% of the sync-charged idle; removed in proportion like
Python between launches, the syncs kept 2% of the step where fixing them gave back 9%.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

import numpy as np

from tracetrain.profile.analyze.categories import is_sync_runtime
from tracetrain.profile.analyze.columns import OP, RUNTIME
from tracetrain.profile.analyze.intervals import Spans, complement, intersect, union
from tracetrain.profile.analyze.select import gpu_spans, host_spans, main_device, on_device, step_rows
from tracetrain.profile.analyze.trace import Trace

# Idle causes set by the host's pace, which the profiler's per-event cost stretches.
HOST_PACED: Final = ("data_loader", "sync", "host")
MIN_APPLIED: Final = 0.02  # an estimated correction below this share of the step is not applied
TIMING_SUFFIX: Final = ".timing.json"
MAX_FLOOR_US: Final = 5.0  # a wider 10th-percentile gap between back-to-back operators is not recording cost


@dataclass(frozen=True)
class Overhead:
    """The profiler's cost to this rank's host-side idle (µs, summed over the profiled steps)."""

    method: Literal["measured", "estimated", "none"]
    per_event_us: float  # estimated recording cost of one host event
    events_per_step: float  # host events (operators, runtime calls) recorded per step
    profiled_step_us: float  # mean step in the trace
    real_step_us: float  # mean step without the profiler (measured, or the trace's minus the removed idle)
    removed_us: dict[str, float] = field(default_factory=dict)  # per host-paced idle cause
    note: str = ""
    protected_us: dict[str, float] = field(default_factory=dict)  # per cause: round trip, never removed

    @property
    def removed_total_us(self) -> float:
        return sum(self.removed_us.values())


def timing_path(trace_path: str | Path) -> Path:
    """`rank0.timing.json` beside `rank0.json.gz` (or `.json`)."""
    path = Path(trace_path)
    stem = path.name.removesuffix(".gz").removesuffix(".json")
    return path.with_name(stem + TIMING_SUFFIX)


def read_real_step_us(trace_path: str | Path) -> float | None:
    """The unprofiled step time `tracetrain profile` measured around the window, if it wrote one."""
    path = timing_path(trace_path)
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text()).get("real_step_ms")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) * 1e3 if isinstance(value, (int, float)) and value > 0 else None


def per_event_cost_us(trace: Trace) -> float:
    """Twice the 10th percentile of the gaps between back-to-back top-level operators on the busiest
    host thread (0 when there are too few operators to tell)."""
    ops = trace.host.kind == OP
    if ops.sum() < 20:
        return 0.0
    thread = int(np.bincount(trace.host.thread[ops]).argmax())
    rows = np.flatnonzero(ops & (trace.host.thread == thread))
    order = np.argsort(trace.host.ts[rows], kind="stable")
    starts = trace.host.ts[rows][order]
    ends = np.maximum.accumulate(starts + trace.host.dur[rows][order])
    top = np.concatenate([[True], starts[1:] >= ends[:-1]])  # not nested in an earlier op
    gaps = starts[top][1:] - ends[top][:-1]
    if len(gaps) < 10:
        return 0.0
    floor = float(np.percentile(gaps, 10))
    # Back-to-back operators of a real profiled run sit 1-4 µs apart; wider floors are the program's
    # own Python time (or a generated trace), which tells nothing of the recording cost.
    return 2 * floor if floor <= MAX_FLOOR_US else 0.0


def events_in(trace: Trace, spans: Spans) -> np.ndarray:
    """Host events (operators, runtime calls) that start inside each interval of `spans`."""
    kinds = (trace.host.kind == OP) | (trace.host.kind == RUNTIME)
    starts = np.sort(trace.host.ts[kinds])
    return np.searchsorted(starts, spans.ends, side="left") - np.searchsorted(starts, spans.starts, side="left")


def _gap_ratio(trace: Trace, gaps: Spans, cost: float) -> np.ndarray:
    """Per idle gap, the fraction of it the recording cost explains: the host events recorded from
    the launch of the GPU work that ran last before the gap until the gap's end (the host's path to
    the next launch) times `cost`, at most the gap."""
    rows = np.flatnonzero(trace.gpu.device == main_device(trace))
    ends = trace.gpu.ts[rows] + trace.gpu.dur[rows]
    order = np.argsort(ends, kind="stable")
    ends, launches = ends[order], trace.gpu.launch_ts[rows][order]
    before = np.maximum(np.searchsorted(ends, gaps.starts, side="right") - 1, 0)
    since = np.where(np.isfinite(launches[before]), np.minimum(launches[before], gaps.starts), gaps.starts)
    counts = events_in(trace, Spans(since, gaps.ends))
    length = np.maximum(gaps.ends - gaps.starts, 1e-9)
    return np.minimum(cost * counts / length, 1.0)


def round_trip(trace: Trace, device: int) -> Spans:
    """Where the host waited on the device, not the other way round: from each GPU activity's launch
    call until it started, and the host's time inside sync calls (module docstring)."""
    rows = np.flatnonzero(on_device(trace, device) & np.isfinite(trace.gpu.launch_ts))
    issued = union(trace.gpu.launch_ts[rows], trace.gpu.ts[rows])
    waiting = host_spans(trace, (RUNTIME,), is_sync_runtime)
    return union(np.concatenate([issued.starts, waiting.starts]), np.concatenate([issued.ends, waiting.ends]))


def protected(trace: Trace, causes: dict[str, Spans]) -> dict[str, float]:
    """Per host-paced cause, the idle no recording correction removes: a sync's round trip."""
    found = dict.fromkeys(HOST_PACED, 0.0)
    if "sync" in causes and len(causes["sync"]) and len(trace.gpu):
        found["sync"] = intersect(causes["sync"], round_trip(trace, main_device(trace))).total()
    return found


def _share_out(total: float, weights: dict[str, float], caps: dict[str, float]) -> dict[str, float]:
    """`total` split in proportion to `weights`, at most `caps` each; what a capped cause cannot take
    goes to the others (in proportion again), never more than all the caps together."""
    out = dict.fromkeys(caps, 0.0)
    left, open_ = min(total, sum(caps.values())), {c for c in caps if caps[c] > 0 and weights.get(c, 0) > 0}
    while left > 1e-9 and open_:
        weight = sum(weights[c] for c in open_)
        take = {c: min(caps[c] - out[c], left * weights[c] / weight) for c in open_}
        for c, us in take.items():
            out[c] += us
        left -= sum(take.values())
        open_ = {c for c in open_ if out[c] < caps[c] - 1e-9}
    return out


def _estimate(trace: Trace, causes: dict[str, Spans], cost: float) -> dict[str, float]:
    """Idle of each host-paced cause that the recording cost explains (module docstring)."""
    pieces = [causes[c] for c in HOST_PACED if c in causes and len(causes[c])]
    if not pieces or cost <= 0 or not len(trace.gpu):
        return dict.fromkeys(HOST_PACED, 0.0)
    lo, hi = trace.window
    busy = gpu_spans(trace, trace.gpu.device == main_device(trace))
    gaps = complement(busy, lo, hi)
    ratio = _gap_ratio(trace, gaps, cost)
    found = {}
    for cause in HOST_PACED:
        spans = causes.get(cause)
        if spans is None or not len(spans):
            found[cause] = 0.0
            continue
        parent = np.clip(np.searchsorted(gaps.starts, spans.starts, side="right") - 1, 0, len(gaps) - 1)
        found[cause] = float(((spans.ends - spans.starts) * ratio[parent]).sum())
    return found


def steps_span_us(trace: Trace) -> float:
    """From the first step's start until the GPU finished the work launched inside the steps (at
    least the step ranges): the profiled step time when the host runs ahead of the GPU, whose step
    ranges (host time) then end before the work they launched."""
    rows = step_rows(trace)
    if not len(rows) or not len(trace.gpu):
        return trace.window[1] - trace.window[0]
    lo, hi = float(trace.host.ts[rows].min()), float((trace.host.ts[rows] + trace.host.dur[rows]).max())
    device = trace.gpu.device == main_device(trace)
    launched = device & (trace.gpu.launch_ts >= lo) & (trace.gpu.launch_ts <= hi)
    end = float((trace.gpu.ts[launched] + trace.gpu.dur[launched]).max()) if launched.any() else hi
    return max(hi, end) - lo


def profiler_overhead(
    trace: Trace, causes: dict[str, Spans], steps_us: float, num_steps: int, real_step_us: float | None
) -> Overhead:
    """The host-side idle the profiler added (module docstring), per idle cause."""
    num_steps = max(num_steps, 1)
    cost = per_event_cost_us(trace)
    kinds = (trace.host.kind == OP) | (trace.host.kind == RUNTIME)
    events_per_step = float(kinds.sum()) / num_steps
    idle = {cause: causes[cause].total() if cause in causes else 0.0 for cause in HOST_PACED}
    kept = protected(trace, causes)
    removable = {cause: max(idle[cause] - kept[cause], 0.0) for cause in HOST_PACED}
    estimated = {cause: min(us, removable[cause]) for cause, us in _estimate(trace, causes, cost).items()}
    profiled = steps_us / num_steps
    base = Overhead("none", cost, events_per_step, profiled, profiled, protected_us=kept)
    if real_step_us is not None:
        return _measured(base, estimated, removable, real_step_us, num_steps)
    total = sum(estimated.values())
    if total < MIN_APPLIED * steps_us:
        return base
    note = (
        f"host-side idle corrected for the profiler's own cost: ~{cost:.1f} µs per recorded host event "
        f"(estimated from the gaps between back-to-back operators), {events_per_step:.0f} events per step; "
        f"{total / num_steps / 1e3:.2f} ms of idle per step removed"
    )
    return Overhead("estimated", cost, events_per_step, profiled, profiled - total / num_steps, estimated, note, kept)


def _measured(
    base: Overhead, estimated: dict[str, float], removable: dict[str, float], real_step_us: float, num_steps: int
) -> Overhead:
    """Remove `profiled - real` per step from the host-paced idle less its round trip, shared as the
    estimate shares it (as the removable idle does where there is no estimate)."""
    extra = max(base.profiled_step_us - real_step_us, 0.0) * num_steps
    weights = estimated if sum(estimated.values()) > 0 else removable
    removed = _share_out(extra, weights, removable)
    note = (
        f"step time without the profiler {real_step_us / 1e3:.2f} ms (measured around the window) against "
        f"{base.profiled_step_us / 1e3:.2f} ms profiled; {sum(removed.values()) / num_steps / 1e3:.2f} ms of "
        "host-side idle per step removed"
    )
    return Overhead(
        "measured",
        base.per_event_us,
        base.events_per_step,
        base.profiled_step_us,
        real_step_us,
        removed,
        note,
        base.protected_us,
    )


def host_only_overhead(trace: Trace, steps_us: float, num_steps: int, real_step_us: float) -> Overhead:
    """A trace without GPU activity: the real step time beside the profiled one, nothing to correct."""
    num_steps = max(num_steps, 1)
    profiled = steps_us / num_steps
    events = float(((trace.host.kind == OP) | (trace.host.kind == RUNTIME)).sum()) / num_steps
    note = (
        f"step time without the profiler {real_step_us / 1e3:.2f} ms (measured around the window) against "
        f"{profiled / 1e3:.2f} ms profiled"
    )
    return Overhead("measured", per_event_cost_us(trace), events, profiled, real_step_us, {}, note)
