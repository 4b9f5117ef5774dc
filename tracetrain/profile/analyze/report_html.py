"""One self-contained HTML page for a `Report` or `CompareReport`: inline CSS and SVG, no scripts, no
network. Every string from a trace is escaped (`svg.esc`)."""

from __future__ import annotations

from tracetrain.profile.analyze import fmt, svg, tables
from tracetrain.profile.analyze.advice import Advice, gain_text
from tracetrain.profile.analyze.categories import CATEGORIES
from tracetrain.profile.analyze.compare import CompareReport, DeltaRow
from tracetrain.profile.analyze.render import compare_tables, headline_text, rank_tables
from tracetrain.profile.analyze.report import RankReport, Report
from tracetrain.profile.analyze.svg import esc
from tracetrain.profile.analyze.tables import CAUSE_LABELS, TextTable
from tracetrain.profile.analyze.utilisation import IDLE_CAUSES

STATE_COLORS = {
    "busy": "#4e79a7",
    "data_loader": "#f28e2b",
    "sync": "#e15759",
    "communication": "#76b7b2",
    "host": "#edc948",
    "outside_steps": "#bab0ac",
}
CATEGORY_COLORS = {c: svg.PALETTE[i % len(svg.PALETTE)] for i, c in enumerate(CATEGORIES)}
_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1000px;color:#222;padding:0 12px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
.meta{color:#555}.cards{display:flex;gap:12px;flex-wrap:wrap}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 14px;min-width:150px}
.card b{display:block;font-size:20px}table{border-collapse:collapse;margin:8px 0 16px;font-size:13px}
th,td{border-bottom:1px solid #eee;padding:3px 8px;text-align:left;vertical-align:top}
td.n{text-align:right;white-space:nowrap}caption{text-align:left;font-weight:600;padding:4px 0}
.chart text{font-size:11px;fill:#333}.legend span{margin-right:12px;white-space:nowrap}
.legend i{display:inline-block;width:11px;height:11px;margin-right:4px;vertical-align:-1px}
.advice li{margin-bottom:8px}.gain{color:#2a7d2a;font-weight:600}.note{color:#8a6d00}
code{background:#f4f4f4;padding:0 3px}.headline{font-size:17px;font-weight:600}
"""


def _page(title: str, body: str) -> str:
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f"<style>{_CSS}</style></head><body>{body}</body></html>"
    )


def _table(table: TextTable) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in table.headers)
    rows = "".join(
        "<tr>" + "".join(f"<td{' class=n' if n else ''}>{esc(c)}</td>" for c, n in zip(row, table.numeric)) + "</tr>"
        for row in table.rows
    )
    return f"<table><caption>{esc(table.title)}</caption><tr>{head}</tr>{rows}</table>"


def _advice(advice: list[Advice], title: str = "Advice") -> str:
    if not advice:
        return f"<h2>{esc(title)}</h2><p>No rule fired: nothing obvious to fix in this trace.</p>"
    items = "".join(
        f"<li><b>{esc(a.title)}</b>"
        + (f' <span class="gain">{esc(gain_text(a))}</span>' if a.gain else "")
        + f"<br>{esc(a.action)}<br><small>{esc(a.evidence)}</small></li>"
        for a in advice
    )
    return f'<h2>{esc(title)}</h2><ol class="advice">{items}</ol>'


def _cards(rank: RankReport) -> str:
    util = rank.utilisation
    cards = [
        ("step time", fmt.duration(util.mean_step_us)),
        ("GPU busy", fmt.percent(util.busy_fraction)),
        ("bound", rank.bound.verdict),
        ("GEMM", fmt.number(rank.bound.gemm.tflops, 0, " TFLOP/s")),
    ]
    return (
        '<div class="cards">' + "".join(f'<div class="card">{esc(k)}<b>{esc(v)}</b></div>' for k, v in cards) + "</div>"
    )


def _timeline(rank: RankReport) -> str:
    util = rank.utilisation
    bins = [(b.start_us, b.busy_fraction, b.idle_fraction) for b in util.timeline]
    steps = [(s.start_us, s.duration_us, s.name) for s in util.steps]
    chart = svg.timeline(bins, STATE_COLORS, steps, util.window_us, "GPU busy and idle over time")
    items = [("busy", STATE_COLORS["busy"])] + [(CAUSE_LABELS[c], STATE_COLORS[c]) for c in IDLE_CAUSES]
    return (
        "<h2>GPU timeline</h2><p>Each column is a slice of the profiled window, stacked by what the GPU "
        "did in it; the lane above shows the steps, the axis the time since the window opened.</p>"
        + chart
        + svg.legend(items)
    )


def _categories(rank: RankReport) -> str:
    rows = rank.kernels.categories
    if not rows:
        return ""
    segments = [(r.category, r.total_us, CATEGORY_COLORS[r.category]) for r in rows]
    return (
        "<h2>GPU time by category</h2>"
        + svg.stacked_bar(segments, fmt.duration, "category shares")
        + svg.legend([(f"{r.category} {fmt.percent(r.share)}", CATEGORY_COLORS[r.category]) for r in rows])
    )


def _kernels(rank: RankReport) -> str:
    items = [
        (k.name, k.total_us, f"{k.full_name}\n{k.count} launches, mean {fmt.duration(k.mean_us)}")
        for k in rank.kernels.top
    ]
    return "<h2>Top kernels</h2>" + svg.hbars(items, fmt.duration, "top kernels by GPU time") if items else ""


def _host_time(rank: RankReport) -> str:
    """A trace without GPU activity: the host operators with the most self time."""
    items = [
        (
            r.name,
            r.self_us,
            f"{r.name}\n{r.count} calls, self {fmt.duration(r.self_us)}, total {fmt.duration(r.total_us)}",
        )
        for r in rank.host_time.operators
    ]
    if not items:
        return ""
    return (
        "<h2>Host operators</h2><p>No GPU activity in this trace: the operators that took the host's time, "
        "by self time (their time less that of the operators they call).</p>"
        + svg.hbars(items, fmt.duration, "host operators by self time")
    )


def _counters(rank: RankReport) -> str:
    """A CUPTI range-profiler trace: what it counted (CUDA-core FLOPs per kernel when it has them)."""
    c = rank.counters
    if not c.num_ranges:
        return ""
    intro = (
        f"<h2>CUPTI counters</h2><p>{c.num_ranges} range-profiler ranges over {c.num_names} kernel names. "
        "They hold hardware counts, not times: the profiler replays each kernel to count it and the trace "
        "gives every range an even share of the profiled span.</p>"
    )
    items = [(r.name, r.flops, f"{r.full_name}\n{r.ranges} ranges, {fmt.count(r.flops, 'FLOP')}") for r in c.flops]
    if not items:
        return intro
    return intro + svg.hbars(items, lambda v: fmt.count(v, "FLOP"), "CUDA-core FLOPs by kernel")


def _phases(rank: RankReport) -> str:
    if not rank.phases:
        return ""
    labels = [p.phase for p in rank.phases]
    chart = svg.grouped_hbars(
        labels,
        [("host", [p.cpu_us for p in rank.phases]), ("GPU", [p.gpu_us for p in rank.phases])],
        fmt.duration,
        "phase times",
    )
    return "<h2>Phases</h2>" + chart + svg.legend([("host", svg.PALETTE[0]), ("GPU", svg.PALETTE[1])])


def _memory(rank: RankReport) -> str:
    memory = rank.memory
    if memory is None or not memory.points:
        return ""
    chart = svg.line_chart(memory.points, fmt.nbytes, "allocated memory over time")
    capacity = f" of {fmt.nbytes(memory.capacity_bytes)}" if memory.capacity_bytes else ""
    peaks = (
        f"peak {fmt.nbytes(memory.peak_allocated_bytes)} allocated, "
        f"{fmt.nbytes(memory.peak_reserved_bytes)} reserved{capacity}"
    )
    return f"<h2>GPU memory</h2><p>Allocated bytes over the window; {esc(peaks)}.</p>" + chart


def _notes(notes: list[str]) -> str:
    return "".join(f'<p class="note">note: {esc(n)}</p>' for n in notes)


def _report_page(report: Report) -> str:
    rank = report.ranks[0]
    meta = f"{esc(rank.source)} — {esc(rank.device_name or 'unknown device')}, {len(report.ranks)} rank(s)" + (
        " — details below are rank 0's" if len(report.ranks) > 1 else ""
    )
    body = [f"<h1>tracetrain trace analysis</h1><p class=meta>{meta}</p>", _notes(report.notes)]
    if rank.has_gpu:
        body += [_cards(rank), _advice(report.advice), _timeline(rank), _categories(rank), _kernels(rank)]
    else:
        body += [_counters(rank), _host_time(rank)]
    body += [_phases(rank), _memory(rank)]
    extra = ([tables.ranks_table(report)] if len(report.ranks) > 1 else []) + [tables.comm_table(report)]
    body.append("<h2>Tables</h2>" + "".join(_table(t) for t in extra + rank_tables(rank) if t.rows))
    return _page(f"tracetrain analysis — {rank.source}", "".join(body))


def _delta_chart(rows: list[DeltaRow], title: str) -> str:
    rows = [r for r in rows if (r.a or 0) > 0 or (r.b or 0) > 0]
    if not rows:
        return ""
    chart = svg.grouped_hbars(
        [r.metric for r in rows],
        [("a", [r.a or 0.0 for r in rows]), ("b", [r.b or 0.0 for r in rows])],
        fmt.duration,
        title,
    )
    return f"<h2>{esc(title)}</h2>" + chart + svg.legend([("a", svg.PALETTE[0]), ("b", svg.PALETTE[1])])


def _compare_page(diff: CompareReport) -> str:
    body = [
        "<h1>tracetrain comparison</h1>",
        f'<p class="headline">{esc(headline_text(diff.headline))}</p>',
        f"<p class=meta>a: {esc(diff.label_a)}<br>b: {esc(diff.label_b)}</p>",
        _notes(diff.notes),
        _delta_chart(diff.categories, "GPU time per step by category"),
        _delta_chart(diff.idle, "Idle per step by cause"),
        _delta_chart(diff.kernels, "Top kernels, time per step"),
        "".join(_table(t) for t in compare_tables(diff)),
        _advice(diff.advice_a, "Advice for a"),
        _advice(diff.advice_b, "Advice for b"),
    ]
    return _page("tracetrain comparison", "".join(body))


def render_html(report: Report | CompareReport) -> str:
    """The report (or comparison) as one self-contained HTML page."""
    if isinstance(report, CompareReport):
        return _compare_page(report)
    return _report_page(report)
