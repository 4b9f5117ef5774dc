"""Small inline-SVG charts for the HTML report: no scripts, no network, every label escaped.

Each function returns one `<svg>` element as a string. Labels and tooltips (`<title>`) may come from
the trace (kernel names), so everything textual goes through `esc`.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence

WIDTH = 760
BAR_HEIGHT = 18
LABEL_WIDTH = 300
PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
    "#86bcb6",
    "#d37295",
    "#8cd17d",
)


def esc(text: object) -> str:
    """Escape for HTML text and attribute values."""
    return html.escape(str(text), quote=True)


def _clip(label: str, max_chars: int = 44) -> str:
    return label if len(label) <= max_chars else label[: max_chars - 1] + "…"


def _svg(height: float, body: str, label: str) -> str:
    return (
        f'<svg class="chart" viewBox="0 0 {WIDTH} {height:.0f}" width="{WIDTH}" height="{height:.0f}" '
        f'role="img" aria-label="{esc(label)}">{body}</svg>'
    )


def hbars(
    items: Sequence[tuple[str, float, str]], fmt: Callable[[float], str], label: str, color: str = PALETTE[0]
) -> str:
    """Horizontal bars: (label, value, tooltip) per row, scaled to the largest value."""
    top = max((v for _, v, _ in items), default=0.0) or 1.0
    span = WIDTH - LABEL_WIDTH - 90
    parts = []
    for i, (name, value, tip) in enumerate(items):
        y = 4 + i * (BAR_HEIGHT + 4)
        w = max(span * value / top, 1.0)
        parts.append(
            f"<g><title>{esc(tip)}</title>"
            f'<text x="4" y="{y + 13}">{esc(_clip(name))}</text>'
            f'<rect x="{LABEL_WIDTH}" y="{y}" width="{w:.1f}" height="{BAR_HEIGHT}" fill="{color}"/>'
            f'<text x="{LABEL_WIDTH + w + 4:.1f}" y="{y + 13}">{esc(fmt(value))}</text></g>'
        )
    return _svg(8 + len(items) * (BAR_HEIGHT + 4), "".join(parts), label)


def grouped_hbars(
    labels: Sequence[str], series: Sequence[tuple[str, Sequence[float]]], fmt: Callable[[float], str], label: str
) -> str:
    """One group of bars per label, one bar per series (e.g. host vs GPU, run a vs run b)."""
    top = max((v for _, values in series for v in values), default=0.0) or 1.0
    span = WIDTH - LABEL_WIDTH - 90
    group = len(series) * (BAR_HEIGHT - 4) + 8
    parts = []
    for i, name in enumerate(labels):
        y0 = 4 + i * group
        parts.append(f'<text x="4" y="{y0 + 12}">{esc(_clip(name))}</text>')
        for j, (series_name, values) in enumerate(series):
            y, w = y0 + j * (BAR_HEIGHT - 4), max(span * values[i] / top, 1.0)
            parts.append(
                f"<g><title>{esc(f'{name} — {series_name}: {fmt(values[i])}')}</title>"
                f'<rect x="{LABEL_WIDTH}" y="{y}" width="{w:.1f}" height="{BAR_HEIGHT - 6}" '
                f'fill="{PALETTE[j % len(PALETTE)]}"/>'
                f'<text x="{LABEL_WIDTH + w + 4:.1f}" y="{y + 11}">{esc(fmt(values[i]))}</text></g>'
            )
    return _svg(8 + len(labels) * group, "".join(parts), label)


def stacked_bar(segments: Sequence[tuple[str, float, str]], fmt: Callable[[float], str], label: str) -> str:
    """One 100% bar split into (label, value, color) segments, with an inline legend below."""
    total = sum(v for _, v, _ in segments) or 1.0
    x, parts = 0.0, []
    for name, value, color in segments:
        w = WIDTH * value / total
        parts.append(
            f"<g><title>{esc(f'{name}: {fmt(value)} ({100 * value / total:.1f}%)')}</title>"
            f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="28" fill="{color}"/></g>'
        )
        x += w
    return _svg(28, "".join(parts), label)


def nice_step(span: float, max_ticks: int = 8) -> float:
    """A tick spacing of 1, 2 or 5 times a power of ten that cuts `span` into at most `max_ticks`."""
    if span <= 0:
        return 1.0
    raw = span / max_ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def nice_ticks(lo: float, hi: float, max_ticks: int = 6) -> list[float]:
    """Round tick values (multiples of a 1-2-5 x 10^k spacing, `nice_step`) inside [lo, hi], at most
    `max_ticks` + 1 of them. Each is rounded to the spacing's decimals, so 3 x 0.1 reads 0.3."""
    step = nice_step(hi - lo, max_ticks)
    decimals = max(0, -math.floor(math.log10(step)))
    first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    return [round(k * step, decimals) for k in range(first, last + 1)]


def log_ticks(lo: float, hi: float, max_ticks: int = 6) -> list[float]:
    """Round tick values for a logarithmic axis over [lo, hi] (0 < lo < hi): the powers of ten inside,
    else 1-2-5 x 10^k, else 1..9 x 10^k, whichever first gives at least 3 ticks (every k-th kept when
    there are more than `max_ticks` + 1); a range too narrow for that gets `nice_ticks`."""
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    for mantissas in ((1,), (1, 2, 5), tuple(range(1, 10))):
        ticks = [
            round(m * 10.0**d, max(0, -d))
            for d in decades
            for m in mantissas
            if lo * (1 - 1e-9) <= m * 10.0**d <= hi * (1 + 1e-9)
        ]
        if len(ticks) >= 3:
            return ticks[:: math.ceil(len(ticks) / (max_ticks + 1))]
    return nice_ticks(lo, hi, max_ticks)


def _time_label(us: float, step_us: float, total_us: float) -> str:
    """A tick label in the largest of s, ms and µs that `total_us` reaches, with as many decimals as
    the tick spacing needs (0.5 ms ticks: "1.5 ms")."""
    unit, scale = next((u, f) for u, f in (("s", 1e6), ("ms", 1e3), ("µs", 1.0)) if total_us >= f or f == 1.0)
    decimals = max(0, -math.floor(math.log10(step_us / scale) + 1e-9))
    return f"{us / scale:.{decimals}f} {unit}"


def time_axis(total_us: float, left: float, width: float, y: float) -> str:
    """A horizontal time axis from 0 to `total_us` over [left, left + width] at height `y`: a base
    line, ticks at a 1-2-5 spacing and their labels below."""
    step_us = nice_step(total_us)
    parts = [f'<line x1="{left}" x2="{left + width}" y1="{y}" y2="{y}" stroke="#888"/>']
    for k in range(int(total_us / step_us + 1e-9) + 1):
        x = left + width * k * step_us / total_us if total_us else left
        anchor = "start" if k == 0 else "end" if x > left + width - 20 else "middle"
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + 4}" stroke="#888"/>'
            f'<text class="tick" x="{x:.1f}" y="{y + 15}" text-anchor="{anchor}">'
            f"{esc(_time_label(k * step_us, step_us, total_us))}</text>"
        )
    return "".join(parts)


def timeline(
    bins: Sequence[tuple[float, float, dict[str, float]]],
    colors: dict[str, str],
    steps: Sequence[tuple[float, float, str]],
    total_us: float,
    label: str,
) -> str:
    """Two lanes over a time axis. "steps": each (start µs, duration µs, name) step as a band, labelled
    where it is wide enough. "GPU": columns of stacked fractions, `bins` being (start µs, busy
    fraction, idle fractions by cause). Times are relative to the window start; the axis runs from 0 to
    `total_us`."""
    left, lane_gap, steps_h, gpu_h = 64.0, 4.0, 16.0, 100.0
    width = WIDTH - left - 12
    gpu_y = steps_h + lane_gap
    scale = width / total_us if total_us else 0.0
    parts = [
        f'<text class="lane" x="{left - 6}" y="{steps_h - 4}" text-anchor="end">steps</text>',
        f'<text class="lane" x="{left - 6}" y="{gpu_y + gpu_h / 2 + 4}" text-anchor="end">GPU</text>',
    ]
    for i, (start, duration, name) in enumerate(steps):
        x, w = left + start * scale, max(duration * scale, 1.0)
        short = name.rsplit("#", 1)[-1] if "#" in name else name
        parts.append(
            f"<g><title>{esc(f'{name}: {duration / 1e3:.2f} ms')}</title>"
            f'<rect x="{x:.2f}" y="0" width="{w:.2f}" height="{steps_h}" fill="{("#d9d9d9", "#bdbdbd")[i % 2]}"/>'
            + (f'<text x="{x + 3:.1f}" y="{steps_h - 4}">#{esc(short)}</text>' if w > 8 * len(short) + 14 else "")
            + "</g>"
        )
    column = width / max(len(bins), 1)
    for i, (start, busy, idle) in enumerate(bins):
        x, y = left + i * column, gpu_y + gpu_h
        for name, fraction in [("busy", busy), *idle.items()]:
            if fraction <= 0:
                continue
            h = gpu_h * min(fraction, 1.0)
            y -= h
            parts.append(
                f'<rect x="{x:.2f}" y="{y:.2f}" width="{column + 0.3:.2f}" height="{h:.2f}" '
                f'fill="{colors.get(name, "#999")}"/>'
            )
        parts.append(
            f'<rect x="{x:.2f}" y="{gpu_y}" width="{column:.2f}" height="{gpu_h}" fill="none">'
            f"<title>{esc(f't={start / 1e3:.2f} ms busy {100 * busy:.0f}%')}</title></rect>"
        )
    for start, _, name in steps:  # step boundaries across the GPU lane
        x = left + start * scale
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{gpu_y}" y2="{gpu_y + gpu_h}" stroke="#222" '
            f'stroke-width="0.7"><title>{esc(name)}</title></line>'
        )
    axis = time_axis(total_us, left, width, gpu_y + gpu_h + 2)
    body = '<g shape-rendering="crispEdges">' + "".join(parts) + "</g>" + axis
    return _svg(gpu_y + gpu_h + 22, body, label)


def line_chart(points: Sequence[tuple[float, float]], fmt_y: Callable[[float], str], label: str) -> str:
    """A polyline of (x µs, y), y from 0 to a little above the largest value."""
    height, left = 160.0, 70.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs, default=0.0), max(xs, default=1.0)
    top = 1.1 * max(ys, default=0.0) or 1.0
    sx = (WIDTH - left - 10) / ((x1 - x0) or 1.0)
    coords = " ".join(f"{left + (x - x0) * sx:.1f},{height - height * y / top:.1f}" for x, y in points)
    parts = [
        f'<polyline points="{coords}" fill="none" stroke="{PALETTE[0]}" stroke-width="1.5"/>',
        f'<text x="{left - 4}" y="12" text-anchor="end">{esc(fmt_y(top))}</text>',
        f'<text x="{left - 4}" y="{height}" text-anchor="end">0</text>',
        f'<line x1="{left}" x2="{WIDTH - 10}" y1="{height}" y2="{height}" stroke="#888"/>',
        f'<text x="{WIDTH - 10}" y="{height + 14}" text-anchor="end">{esc(f"{(x1 - x0) / 1e3:.1f} ms")}</text>',
    ]
    return _svg(height + 18, "".join(parts), label)


def legend(items: Sequence[tuple[str, str]]) -> str:
    """An HTML legend of (label, color) swatches."""
    return (
        '<p class="legend">'
        + " ".join(f'<span><i style="background:{color}"></i>{esc(name)}</span>' for name, color in items)
        + "</p>"
    )
