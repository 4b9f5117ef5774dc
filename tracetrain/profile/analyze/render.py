"""Render a `Report` or `CompareReport` to the terminal (rich tables) or to JSON-ready data.

Rendering never computes: it formats the tables the analyzers returned. Trace strings (kernel
names, file names) are untrusted and are written as plain `rich.text.Text`, never as markup, with
ANSI escape sequences and control characters stripped (`fmt.printable`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tracetrain.profile.analyze import fmt, tables
from tracetrain.profile.analyze.advice import Advice, gain_text
from tracetrain.profile.analyze.compare import SAME_SPEED, CompareReport, Headline
from tracetrain.profile.analyze.operators import OperatorRow
from tracetrain.profile.analyze.report import RankReport, Report
from tracetrain.profile.analyze.tables import TextTable

JSON_VERSION = 1


def _text(value: str, style: str = "") -> Text:
    """Plain rich text with terminal escape sequences stripped (trace strings are untrusted)."""
    return Text(fmt.printable(value), style=style)


def _rich(table: TextTable) -> Table:
    out = Table(title=_text(table.title, style="bold"), title_justify="left", show_lines=False)
    for header, numeric in zip(table.headers, table.numeric):
        out.add_column(
            _text(header), justify="right" if numeric else "left", overflow="fold", max_width=None if numeric else 60
        )
    for row in table.rows:
        out.add_row(*(_text(cell) for cell in row))
    return out


def host_steps_table(rank: RankReport) -> TextTable:
    """Steps of a trace without GPU activity: their host time only (GPU idle columns would call the
    whole step idle)."""
    steps = rank.utilisation.steps
    rows = [[s.name, fmt.duration(s.duration_us)] for s in steps[: tables.MAX_STEP_ROWS]]
    more = len(steps) - tables.MAX_STEP_ROWS
    return TextTable.make(
        "Steps" + (f" (first {tables.MAX_STEP_ROWS}; {more} more)" if more > 0 else ""), ["step", "time"], rows
    )


def operators_table(rows: list[OperatorRow], title: str, what: str = "operator") -> TextTable:
    """Host operators (or record_function ranges) by self time: calls, self, share, total, mean."""
    out = [
        [
            r.name,
            str(r.count),
            fmt.duration(r.self_us),
            fmt.percent(r.self_share),
            fmt.duration(r.total_us),
            fmt.duration(r.total_us / r.count if r.count else None),
        ]
        for r in rows
    ]
    return TextTable.make(title, [what, "calls", "self time", "of self", "total", "mean total"], out)


def host_tables(rank: RankReport) -> list[TextTable]:
    """Where the host's time went: operators, then record_function ranges, each by self time."""
    return [
        operators_table(rank.host_time.operators, "Top host operators by self time"),
        operators_table(rank.host_time.ranges, "Top record_function ranges by self time", "range"),
    ]


def rank_tables(rank: RankReport) -> list[TextTable]:
    """The detailed tables of one rank, in reading order (empty tables left out)."""
    counters = [tables.counters_table(rank), tables.flops_table(rank)]  # CUPTI range profiler only
    if not rank.has_gpu:  # a CPU-only trace: host steps, operators and phases are all there is
        found = [host_steps_table(rank), *counters, *host_tables(rank), tables.phases_table(rank)]
        return [t for t in found if t.rows]
    found = [
        tables.utilisation_table(rank),
        tables.steps_table(rank),
        tables.categories_table(rank),
        tables.kernels_table(rank),
        tables.memcpy_table(rank),
        tables.phases_table(rank),
        tables.offload_table(rank),
        *counters,
    ]
    return [t for t in found if t.rows]


def report_tables(report: Report) -> list[TextTable]:
    """Everything of a report: ranks (when several), rank 0's details, communication, advice."""
    found = [tables.ranks_table(report)] if len(report.ranks) > 1 else []
    found += rank_tables(report.ranks[0])
    found.append(tables.comm_table(report))
    return [t for t in found if t.rows]


def compare_tables(diff: CompareReport) -> list[TextTable]:
    a, b = "a", "b"
    return [
        t
        for t in (
            tables.delta_table(f"Summary (a: {diff.verdict_a}, b: {diff.verdict_b})", diff.summary, a, b),
            tables.delta_table("Idle per step by cause", diff.idle, a, b),
            tables.delta_table("GPU time per step by category", diff.categories, a, b),
            tables.delta_table("Top kernels, time per step", diff.kernels, a, b),
        )
        if t.rows
    ]


def headline_text(headline: Headline) -> str:
    """One sentence: b faster or slower than a per step, by how much, and the main reason."""
    a, b = fmt.duration(headline.step_a_us), fmt.duration(headline.step_b_us)
    if headline.change is None:
        return f"No step time to compare (a: {a}, b: {b} per step)."
    if abs(headline.change) < SAME_SPEED:
        return f"b runs at the speed of a: {a} and {b} per step ({fmt.percent(headline.change)})."
    if headline.change >= 1:  # "300% slower" reads worse than "4.00x slower"
        amount, pace = f"{1 + headline.change:.2f}x", "slower"
    else:
        amount, pace = fmt.percent(abs(headline.change)), "faster" if headline.change < 0 else "slower"
    text = f"b is {amount} {pace} than a per step ({a} → {b})"
    delta = headline.reason_delta_us
    if headline.reason_name is None or delta is None:
        return text + "."
    more = "more" if delta > 0 else "less"
    if headline.reason_kind == "idle":
        what = f"{more} GPU idle time on {tables.CAUSE_LABELS[headline.reason_name]}"
    elif headline.reason_name == "all":
        what = f"{more} GPU busy time"
    else:
        what = f"{more} GPU time in {headline.reason_name} kernels"
    return f"{text}, mostly {what} ({fmt.signed(delta, 'us')} per step)."


def _print_advice(console: Console, advice: list[Advice], title: str) -> None:
    console.print(_text(title, style="bold"))
    if not advice:
        console.print(_text("  no rule fired: nothing obvious to fix in this trace"))
    for i, item in enumerate(advice, 1):
        gain = f" ({gain_text(item)})" if item.gain else ""
        console.print(_text(f"{i}. {item.title}{gain}", style="green"))
        console.print(_text(f"   {item.action}\n   {item.evidence}"))


def render_terminal(report: Report | CompareReport, console: Console | None = None) -> None:
    """Print the report (or comparison) as rich tables."""
    console = console or Console()
    if isinstance(report, CompareReport):  # the answer first: faster or slower, and why
        console.print(_text(headline_text(report.headline), style="bold"))
    for note in report.notes:
        console.print(_text(f"note: {note}", style="yellow"))
    if isinstance(report, CompareReport):
        console.print(_text(f"a: {report.label_a}\nb: {report.label_b}", style="bold"))
        for table in compare_tables(report):
            console.print(_rich(table))
        _print_advice(console, report.advice_a, "Advice for a")
        _print_advice(console, report.advice_b, "Advice for b")
    else:
        first = report.ranks[0]
        console.print(
            _text(
                f"{first.source} — {first.device_name or 'unknown device'}, {len(report.ranks)} rank(s)", style="bold"
            )
        )
        for table in report_tables(report):
            console.print(_rich(table))
        if any(rank.has_gpu for rank in report.ranks):
            _print_advice(console, report.advice, "Advice")


def _plain(value: Any) -> Any:
    """JSON-safe: dataclasses to dicts, numpy to Python, non-finite floats to None."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def render_json(report: Report | CompareReport) -> dict[str, Any]:
    """The report (or comparison) as JSON-serialisable data, tagged with its kind and a version."""
    kind = "tracetrain.compare" if isinstance(report, CompareReport) else "tracetrain.analysis"
    return {"kind": kind, "version": JSON_VERSION, **_plain(report)}
