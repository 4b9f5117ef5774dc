"""Two runs side by side: what changed in step time, utilisation, idle causes, categories and kernels.

Times are per step (a run's total divided by its number of `ProfilerStep` ranges) so traces with
different step counts compare fairly. Multi-rank reports are compared on their first rank.

The headline answers first: is b faster or slower than a per step, by how much, and which part of the
step moved most in that direction. A step is GPU busy time plus GPU idle time by cause, so the
candidates are each idle cause (data loader, host sync, communication wait, launch/host) and GPU busy
time; when busy time moved most, the kernel category whose time moved most in the same direction names
it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tracetrain.profile.analyze.advice import Advice
from tracetrain.profile.analyze.report import RankReport, Report
from tracetrain.profile.analyze.utilisation import IDLE_CAUSES

Unit = Literal["us", "fraction", "tflops", "count"]
MAX_KERNELS = 15
SAME_SPEED = 0.01  # step times within 1% of each other: no faster or slower to report


@dataclass(frozen=True)
class DeltaRow:
    """One metric in both runs; `delta` is b - a (None when either is unknown)."""

    metric: str
    a: float | None
    b: float | None
    delta: float | None
    unit: Unit


@dataclass(frozen=True)
class Headline:
    """b against a per step. `change` is b's step time over a's, minus 1 (negative: b is faster; None
    when either has no step time). The reason is the part of the step that moved most in the direction
    of the change: `reason_kind` "idle" (an idle cause of `IDLE_CAUSES`) or "gpu" (GPU time of a kernel
    category), with its change per step in µs; None when the step times are within `SAME_SPEED`."""

    step_a_us: float
    step_b_us: float
    change: float | None
    reason_kind: Literal["idle", "gpu"] | None = None
    reason_name: str | None = None
    reason_delta_us: float | None = None


@dataclass(frozen=True)
class CompareReport:
    headline: Headline
    label_a: str
    label_b: str
    verdict_a: str
    verdict_b: str
    summary: list[DeltaRow]
    idle: list[DeltaRow]
    categories: list[DeltaRow]
    kernels: list[DeltaRow]
    advice_a: list[Advice]
    advice_b: list[Advice]
    notes: list[str]


def _row(metric: str, a: float | None, b: float | None, unit: Unit) -> DeltaRow:
    return DeltaRow(metric, a, b, b - a if a is not None and b is not None else None, unit)


def _num_steps(rank: RankReport) -> int:
    return max(len(rank.utilisation.steps), 1)


def _summary(a: RankReport, b: RankReport) -> list[DeltaRow]:
    ua, ub = a.utilisation, b.utilisation
    return [
        _row("step time", ua.mean_step_us, ub.mean_step_us, "us"),
        _row("GPU busy", ua.busy_fraction, ub.busy_fraction, "fraction"),
        _row("GPU busy per step", ua.busy_us / _num_steps(a), ub.busy_us / _num_steps(b), "us"),
        _row(
            "exposed communication per step",
            ua.exposed_comm_us / _num_steps(a),
            ub.exposed_comm_us / _num_steps(b),
            "us",
        ),
        _row("GEMM TFLOP/s", a.bound.gemm.tflops, b.bound.gemm.tflops, "tflops"),
        _row("mean kernel", a.bound.mean_kernel_us, b.bound.mean_kernel_us, "us"),
        _row(
            "GPU events per step",
            a.kernels.num_gpu_events / _num_steps(a),
            b.kernels.num_gpu_events / _num_steps(b),
            "count",
        ),
    ]


def _idle(a: RankReport, b: RankReport) -> list[DeltaRow]:
    return [
        _row(cause, a.utilisation.idle_us[cause] / _num_steps(a), b.utilisation.idle_us[cause] / _num_steps(b), "us")
        for cause in IDLE_CAUSES
    ]


def _categories(a: RankReport, b: RankReport) -> list[DeltaRow]:
    times_a = {row.category: row.total_us / _num_steps(a) for row in a.kernels.categories}
    times_b = {row.category: row.total_us / _num_steps(b) for row in b.kernels.categories}
    names = sorted(set(times_a) | set(times_b), key=lambda c: -max(times_a.get(c, 0), times_b.get(c, 0)))
    return [_row(c, times_a.get(c, 0.0), times_b.get(c, 0.0), "us") for c in names]


def _kernels(a: RankReport, b: RankReport) -> list[DeltaRow]:
    """Kernels in either run's top list, by per-step time in either run."""
    short: dict[str, str] = {}
    times: list[dict[str, float]] = []
    for rank in (a, b):
        times.append({row.full_name: row.total_us / _num_steps(rank) for row in rank.kernels.top})
        short.update({row.full_name: row.name for row in rank.kernels.top})
    names = sorted(short, key=lambda n: -max(times[0].get(n, 0.0), times[1].get(n, 0.0)))[:MAX_KERNELS]
    # A kernel outside one run's top list may still have run there: its time is then unknown.
    return [_row(short[n], times[0].get(n), times[1].get(n), "us") for n in names]


def _headline(summary: list[DeltaRow], idle: list[DeltaRow], categories: list[DeltaRow]) -> Headline:
    rows = {r.metric: r for r in summary}
    step_a, step_b = rows["step time"].a or 0.0, rows["step time"].b or 0.0
    if step_a <= 0 or step_b <= 0:
        return Headline(step_a, step_b, None)
    change = step_b / step_a - 1
    sign = 1.0 if change > 0 else -1.0
    # The parts of a step: GPU busy time and idle time by cause (outside-steps idle is not in a step).
    parts: list[tuple[Literal["idle", "gpu"], str, float]] = [
        ("idle", r.metric, r.delta or 0.0) for r in idle if r.metric != "outside_steps"
    ]
    parts.append(("gpu", "all", rows["GPU busy per step"].delta or 0.0))
    kind, name, delta = max(parts, key=lambda p: sign * p[2])
    if abs(change) < SAME_SPEED or sign * delta <= 0:
        return Headline(step_a, step_b, change)
    moved = max(categories, key=lambda r: sign * (r.delta or 0.0), default=None)
    if kind == "gpu" and moved is not None and sign * (moved.delta or 0.0) > 0:
        name, delta = moved.metric, moved.delta or 0.0
    return Headline(step_a, step_b, change, kind, name, delta)


def compare(report_a: Report, report_b: Report) -> CompareReport:
    """Compare two analyses (a = baseline, b = candidate)."""
    a, b = report_a.ranks[0], report_b.ranks[0]
    notes = []
    if len(report_a.ranks) > 1 or len(report_b.ranks) > 1:
        notes.append("multi-rank reports: comparing rank 0 of each")
    summary, idle, categories = _summary(a, b), _idle(a, b), _categories(a, b)
    return CompareReport(
        headline=_headline(summary, idle, categories),
        label_a=a.source,
        label_b=b.source,
        verdict_a=a.bound.verdict,
        verdict_b=b.bound.verdict,
        summary=summary,
        idle=idle,
        categories=categories,
        kernels=_kernels(a, b),
        advice_a=report_a.advice,
        advice_b=report_b.advice,
        notes=notes,
    )
