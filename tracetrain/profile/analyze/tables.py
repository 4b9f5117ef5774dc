"""The analyses as text tables (title, headers, rows of strings), shared by the terminal and HTML
renderers so both show the same numbers. Cells are plain, unescaped text."""

from __future__ import annotations

from dataclasses import dataclass

from tracetrain.profile.analyze import fmt
from tracetrain.profile.analyze.bound import BoundRow
from tracetrain.profile.analyze.compare import DeltaRow
from tracetrain.profile.analyze.kernels import KernelRow
from tracetrain.profile.analyze.report import RankReport, Report
from tracetrain.profile.analyze.utilisation import IDLE_CAUSES

MAX_STEP_ROWS = 12
CAUSE_LABELS = {
    "data_loader": "data loader",
    "sync": "host sync",
    "communication": "communication wait",
    "host": "launch / host overhead",
    "outside_steps": "outside steps",
}
SHORT_CAUSE_LABELS = {"data_loader": "data", "sync": "sync", "communication": "comm", "host": "host"}


@dataclass(frozen=True)
class TextTable:
    title: str
    headers: list[str]
    rows: list[list[str]]
    numeric: list[bool]  # right-align the column

    @staticmethod
    def make(title: str, headers: list[str], rows: list[list[str]]) -> TextTable:
        """A table whose first column is text and the others numbers."""
        return TextTable(title, headers, rows, [False] + [True] * (len(headers) - 1))


def ranks_table(report: Report) -> TextTable:
    rows = [
        [
            str(r.rank),
            r.device_name or "?",
            fmt.duration(r.utilisation.mean_step_us),
            fmt.percent(r.utilisation.busy_fraction),
            fmt.duration(r.communication.exposed_us),
            r.bound.verdict,
        ]
        for r in report.ranks
    ]
    return TextTable(
        "Ranks",
        ["rank", "device", "step", "GPU busy", "exposed comm", "bound"],
        rows,
        [True, False, True, True, True, False],
    )


def utilisation_table(rank: RankReport) -> TextTable:
    util = rank.utilisation
    steps = max(len(util.steps), 1)
    rows = [
        ["GPU busy", fmt.duration(util.busy_us), fmt.percent(util.busy_fraction), fmt.duration(util.busy_us / steps)]
    ]
    rows += [
        [
            f"idle: {CAUSE_LABELS[c]}",
            fmt.duration(util.idle_us[c]),
            fmt.percent(util.idle_us[c] / util.window_us if util.window_us else 0.0),
            fmt.duration(util.idle_us[c] / steps),
        ]
        for c in IDLE_CAUSES
    ]
    rows.append(
        [
            "  of busy: exposed communication",
            fmt.duration(util.exposed_comm_us),
            fmt.percent(util.exposed_comm_us / util.window_us if util.window_us else 0.0),
            fmt.duration(util.exposed_comm_us / steps),
        ]
    )
    title = f"GPU utilisation over {fmt.duration(util.window_us)} profiled ({len(util.steps)} steps)"
    return TextTable.make(title, ["", "time", "of window", "per step"], rows)


def steps_table(rank: RankReport) -> TextTable:
    causes = [c for c in IDLE_CAUSES if c != "outside_steps"]
    rows = [
        [s.name, fmt.duration(s.duration_us), fmt.percent(s.busy_fraction)]
        + [fmt.duration(s.idle_us[c]) for c in causes]
        + [str(s.num_kernels)]
        for s in rank.utilisation.steps[:MAX_STEP_ROWS]
    ]
    more = len(rank.utilisation.steps) - MAX_STEP_ROWS
    title = "Steps" + (f" (first {MAX_STEP_ROWS}; {more} more)" if more > 0 else "")
    return TextTable.make(
        title, ["step", "time", "GPU busy"] + [f"idle: {SHORT_CAUSE_LABELS[c]}" for c in causes] + ["kernels"], rows
    )


def _achieved(row: BoundRow) -> str:
    """TFLOP/s for GEMMs, GB/s where bytes are known, with the fraction of the device's peak."""
    if row.tflops is not None:
        return f"{fmt.number(row.tflops, 0, ' TFLOP/s')} ({fmt.percent(row.flop_efficiency, 0)})"
    if row.gb_per_s is None:
        return "—"
    peak = f" ({fmt.percent(row.bandwidth_efficiency, 0)})" if row.bandwidth_efficiency is not None else ""
    return fmt.number(row.gb_per_s, 1, " GB/s") + peak


def categories_table(rank: RankReport) -> TextTable:
    rows = [
        [
            r.category,
            fmt.duration(r.time_us),
            fmt.percent(r.share),
            fmt.duration(r.mean_kernel_us),
            _achieved(r),
            r.verdict,
        ]
        for r in rank.bound.rows
    ]
    title = f"GPU time by category — overall: {rank.bound.verdict} ({rank.bound.reason})"
    return TextTable(
        title,
        ["category", "time", "share", "mean kernel", "achieved", "bound"],
        rows,
        [False, True, True, True, True, False],
    )


def _launched_by(kernel: KernelRow) -> str:
    """The launching operator, with its share of the kernel's time when other operators launch it too."""
    if kernel.launched_by is None:
        return "—"
    if kernel.launched_by_share < 0.995:
        return f"{kernel.launched_by} ({fmt.percent(kernel.launched_by_share, 0)})"
    return kernel.launched_by


def kernels_table(rank: RankReport) -> TextTable:
    rows = [
        [
            k.name,
            _launched_by(k),
            k.category,
            str(k.count),
            fmt.duration(k.total_us),
            fmt.duration(k.mean_us),
            fmt.percent(k.share),
        ]
        for k in rank.kernels.top
    ]
    return TextTable(
        "Top kernels",
        ["kernel", "launched by", "category", "count", "total", "mean", "share"],
        rows,
        [False, False, False, True, True, True, True],
    )


def memcpy_table(rank: RankReport) -> TextTable:
    rows = [
        [
            m.direction,
            str(m.count),
            fmt.nbytes(m.total_bytes),
            fmt.duration(m.total_us),
            fmt.number(m.gb_per_s, 1, " GB/s"),
            f"{m.pageable_count} ({fmt.nbytes(m.pageable_bytes)})",
        ]
        for m in rank.kernels.memcpy
    ]
    return TextTable.make("Copies", ["direction", "count", "bytes", "time", "bandwidth", "pageable"], rows)


def phases_table(rank: RankReport) -> TextTable:
    rows = [
        [
            p.phase,
            str(p.num_ranges),
            fmt.duration(p.cpu_us),
            fmt.percent(p.cpu_share),
            fmt.duration(p.gpu_us),
            fmt.percent(p.gpu_share),
        ]
        for p in rank.phases
    ]
    return TextTable.make("Phases", ["phase", "ranges", "host time", "of steps", "GPU time", "of GPU"], rows)


def comm_table(report: Report) -> TextTable:
    rows = [
        [
            str(c.rank),
            str(c.num_kernels),
            fmt.duration(c.comm_us),
            fmt.percent(c.comm_share),
            fmt.percent(c.overlap_fraction),
            fmt.duration(c.exposed_us),
            fmt.percent(c.exposed_fraction),
            ", ".join(f"{name} {fmt.duration(us)}" for name, us in sorted(c.collectives.items())),
        ]
        for c in report.communication
        if c.num_kernels
    ]
    return TextTable(
        "Communication (NCCL) per rank",
        ["rank", "kernels", "time", "of busy", "overlapped", "exposed", "of steps", "collectives"],
        rows,
        [True] * 7 + [False],
    )


def offload_table(rank: RankReport) -> TextTable:
    o, m = rank.offload, rank.memory
    rows = [
        ["host -> device", fmt.duration(o.h2d_us), fmt.nbytes(o.h2d_bytes)],
        ["device -> host", fmt.duration(o.d2h_us), fmt.nbytes(o.d2h_bytes)],
        ["copy share of window", fmt.percent(o.copy_fraction), ""],
    ]
    if o.num_unified_events:
        rows.append(
            [f"unified memory ({o.num_unified_events} events)", fmt.duration(o.unified_us), fmt.nbytes(o.unified_bytes)]
        )
    if m is not None:
        capacity = f" of {fmt.nbytes(m.capacity_bytes)}" if m.capacity_bytes else ""
        rows.append(
            [
                "peak allocated / reserved",
                fmt.nbytes(m.peak_allocated_bytes),
                fmt.nbytes(m.peak_reserved_bytes) + capacity,
            ]
        )
    return TextTable.make("Offload and memory", ["", "time", "bytes"], rows)


def counters_table(rank: RankReport) -> TextTable:
    """CUPTI range-profiler counters: totals over the ranges and the kernel with most of each."""
    c = rank.counters
    rows = [
        [
            r.counter,
            fmt.count(r.total),
            f"{r.nonzero_ranges} of {c.num_ranges}",
            r.top_name or "—",
            fmt.percent(r.top_share) if r.top_name else "—",
        ]
        for r in c.counters
    ]
    title = f"CUPTI counters over {c.num_ranges} ranges ({c.num_names} names); range times are placeholders"
    return TextTable(
        title, ["counter", "total", "ranges > 0", "largest kernel", "its share"], rows, [False, True, True, False, True]
    )


def flops_table(rank: RankReport) -> TextTable:
    """CUDA-core FLOPs per kernel from the SASS counters (counters.py says what they leave out)."""
    c = rank.counters
    rows = [[r.name, str(r.ranges), fmt.count(r.flops, "FLOP"), fmt.percent(r.share)] for r in c.flops]
    title = (
        f"CUDA-core FLOPs by kernel (SASS add + mul + 2 x fma; total {fmt.count(c.total_flops, 'FLOP')}; "
        "tensor-core work not counted)"
    )
    return TextTable.make(title, ["kernel", "ranges", "FLOPs", "share"], rows)


def delta_table(title: str, rows: list[DeltaRow], label_a: str = "a", label_b: str = "b") -> TextTable:
    out = [
        [
            r.metric,
            fmt.in_unit(r.a, r.unit),
            fmt.in_unit(r.b, r.unit),
            fmt.signed(r.delta, r.unit),
            fmt.relative(r.a, r.b) if r.unit != "fraction" else "",
        ]
        for r in rows
    ]
    return TextTable.make(title, ["", label_a, label_b, "delta", "change"], out)
