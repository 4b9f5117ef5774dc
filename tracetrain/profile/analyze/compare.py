"""Two runs side by side: what changed in step time, utilisation, idle causes, categories and kernels.

Times are per step (a run's total divided by its number of `ProfilerStep` ranges) so traces with
different step counts compare fairly. Multi-rank reports are compared on their first rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tracetrain.profile.analyze.advice import Advice
from tracetrain.profile.analyze.report import RankReport, Report
from tracetrain.profile.analyze.utilisation import IDLE_CAUSES

Unit = Literal["us", "fraction", "tflops", "count"]
MAX_KERNELS = 15


@dataclass(frozen=True)
class DeltaRow:
    """One metric in both runs; `delta` is b - a (None when either is unknown)."""

    metric: str
    a: float | None
    b: float | None
    delta: float | None
    unit: Unit


@dataclass(frozen=True)
class CompareReport:
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


def compare(report_a: Report, report_b: Report) -> CompareReport:
    """Compare two analyses (a = baseline, b = candidate)."""
    a, b = report_a.ranks[0], report_b.ranks[0]
    notes = []
    if len(report_a.ranks) > 1 or len(report_b.ranks) > 1:
        notes.append("multi-rank reports: comparing rank 0 of each")
    return CompareReport(
        label_a=a.source,
        label_b=b.source,
        verdict_a=a.bound.verdict,
        verdict_b=b.bound.verdict,
        summary=_summary(a, b),
        idle=_idle(a, b),
        categories=_categories(a, b),
        kernels=_kernels(a, b),
        advice_a=report_a.advice,
        advice_b=report_b.advice,
        notes=notes,
    )
