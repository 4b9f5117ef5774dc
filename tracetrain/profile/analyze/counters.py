"""What did CUPTI's range profiler count? The answer for a trace of `cuda_profiler_range` events.

torch.profiler with `experimental_config=_ExperimentalConfig(profiler_metrics=[...],
profiler_measure_per_kernel=True)` runs Kineto's CUPTI range profiler, where the build has it, instead
of kernel tracing: each kernel is replayed until every asked counter is read, and becomes one range
named after it (or a range name such as `__missing__` when names run out; without per-kernel
measurement, one range for the window), its counters in the event's `args`. Kineto splits the profiled
span evenly between the ranges, so a range's time says nothing; what the trace holds is counts.

This analyzer returns two tables:
- per counter: its total over all ranges, how many ranges recorded a non-zero value, and the range name
  (kernel) with the largest share of it;
- when the trace has the SASS instruction counters of Kineto's `kineto__cuda_core_flops` (add, mul and
  fma in fp64, fp32 and fp16), CUDA-core FLOPs per kernel name: an add or mul counts one operation, an
  fma two (HolisticTraceAnalysis counts them the same way). The counters count thread instructions, so a
  packed half2 instruction, which does two operations, counts once: fp16 figures are a lower bound.
  Tensor-core work (GEMMs in TF32, bf16, fp16) is not in these counters at all; Kineto's
  `kineto__tensor_core_insts` (`sm__inst_executed_pipe_tensor.sum`) counts its instructions, not FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tracetrain.profile.analyze.categories import short_kernel_name
from tracetrain.profile.analyze.trace import Trace

MAX_KERNELS = 10
# Operations per thread instruction of each SASS counter behind Kineto's `kineto__cuda_core_flops`.
SASS_FLOP_COUNTERS = {
    f"smsp__sass_thread_inst_executed_op_{op}_pred_on.sum": 2 if op.endswith("fma") else 1
    for op in ("dadd", "dmul", "dfma", "fadd", "fmul", "ffma", "hadd", "hmul", "hfma")
}


@dataclass(frozen=True)
class CounterRow:
    """One counter: its total over the ranges, ranges with a non-zero value, and the name (kernel)
    with the largest sum of it and that sum's share of the total ("" when no range counted any)."""

    counter: str
    total: float
    nonzero_ranges: int
    top_name: str
    top_full_name: str
    top_share: float


@dataclass(frozen=True)
class FlopRow:
    """CUDA-core FLOPs of one kernel name over its ranges, and their share of the trace's."""

    name: str
    full_name: str
    ranges: int
    flops: float
    share: float


@dataclass(frozen=True)
class CounterReport:
    """The counter ranges of one trace; empty when it has none."""

    num_ranges: int = 0
    num_names: int = 0
    counters: list[CounterRow] = field(default_factory=list)
    flops: list[FlopRow] = field(default_factory=list)  # empty without the SASS FLOP counters
    total_flops: float | None = None


def counter_report(trace: Trace, limit: int = MAX_KERNELS) -> CounterReport:
    """Totals per counter and, with the SASS counters, CUDA-core FLOPs of the `limit` largest kernels."""
    ranges = trace.counter_ranges
    if not len(ranges):
        return CounterReport()
    names, inverse = np.unique(ranges.name, return_inverse=True)
    counts = np.bincount(inverse, minlength=len(names))
    rows = []
    for counter, values in ranges.values.items():
        finite = np.where(np.isfinite(values), values, 0.0)
        by_name = np.bincount(inverse, weights=finite, minlength=len(names))
        top, total = int(np.argmax(by_name)), float(finite.sum())
        full = trace.names[int(names[top])] if by_name[top] > 0 else ""  # no largest kernel of nothing
        share = float(by_name[top]) / total if total > 0 else 0.0
        rows.append(CounterRow(counter, total, int((finite != 0).sum()), short_kernel_name(full), full, share))
    flops, total_flops = _flops(trace, names, inverse, counts, limit)
    return CounterReport(len(ranges), len(names), rows, flops, total_flops)


def _flops(
    trace: Trace, names: np.ndarray, inverse: np.ndarray, counts: np.ndarray, limit: int
) -> tuple[list[FlopRow], float | None]:
    """CUDA-core FLOPs per name, largest first, when every SASS FLOP counter is in the trace."""
    values = trace.counter_ranges.values
    if not all(counter in values for counter in SASS_FLOP_COUNTERS):
        return [], None
    per_range = sum(np.nan_to_num(values[c]) * ops for c, ops in SASS_FLOP_COUNTERS.items())
    by_name = np.bincount(inverse, weights=per_range, minlength=len(names))
    total = float(by_name.sum())
    best = np.argsort(-by_name, kind="stable")[:limit]
    rows = [
        FlopRow(
            name=short_kernel_name(trace.names[int(names[k])]),
            full_name=trace.names[int(names[k])],
            ranges=int(counts[k]),
            flops=float(by_name[k]),
            share=float(by_name[k]) / total if total > 0 else 0.0,
        )
        for k in best.tolist()
        if by_name[k] > 0
    ]
    return rows, total
