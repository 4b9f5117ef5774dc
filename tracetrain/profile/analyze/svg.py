"""Small inline-SVG charts for the HTML report: no scripts, no network, every label escaped.

Each function returns one `<svg>` element as a string. Labels and tooltips (`<title>`) may come from
the trace (kernel names), so everything textual goes through `esc`.
"""

from __future__ import annotations

import html
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


def timeline(
    bins: Sequence[tuple[float, float, dict[str, float]]],
    colors: dict[str, str],
    steps: Sequence[tuple[float, str]],
    total_us: float,
    label: str,
) -> str:
    """Columns of stacked fractions over time: `bins` are (start µs, busy fraction, idle fractions
    by cause); `steps` are (start µs, name) boundaries drawn as ticks."""
    height, parts = 120.0, []
    width = WIDTH / max(len(bins), 1)
    for i, (start, busy, idle) in enumerate(bins):
        y = height
        for name, fraction in [("busy", busy), *idle.items()]:
            if fraction <= 0:
                continue
            h = height * min(fraction, 1.0)
            y -= h
            parts.append(
                f'<rect x="{i * width:.2f}" y="{y:.2f}" width="{width + 0.3:.2f}" height="{h:.2f}" '
                f'fill="{colors.get(name, "#999")}"/>'
            )
        parts.append(
            f'<rect x="{i * width:.2f}" y="0" width="{width:.2f}" height="{height}" fill="none">'
            f"<title>{esc(f't={start / 1e3:.2f} ms busy {100 * busy:.0f}%')}</title></rect>"
        )
    for start, name in steps:
        x = WIDTH * start / total_us if total_us else 0.0
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="{height + 6}" stroke="#222" '
            f'stroke-width="0.7"><title>{esc(name)}</title></line>'
        )
    return _svg(height + 8, '<g shape-rendering="crispEdges">' + "".join(parts) + "</g>", label)


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
