"""The line charts of the run page (train/run_report.py): inline SVG, round axis ticks, and for the loss a
log-scale switch that needs no script.

Ticks are the profile report's (`profile/analyze/svg.py`: `nice_ticks`, `log_ticks`), at 1-2-5 x 10^k
values, so an axis reads 100, 200, 300 rather than quarters of the data's range (150.8, 300.5). A chart
with `log_toggle` is drawn twice, on a linear and on a logarithmic y axis, behind a checkbox; CSS shows
one of the two (`CHART_CSS`), so the page stays one file without scripts, and the switch works offline.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tracetrain.profile.analyze.svg import esc, log_ticks, nice_ticks

MAX_POINTS = 1500  # per series: a long run is thinned for drawing (every k-th step; eval points all kept)
WIDTH, HEIGHT, LEFT, BOTTOM = 920.0, 190.0, 70.0, 30.0
TOP = 8.0
PLOT_W, PLOT_H = WIDTH - LEFT - 12, HEIGHT - BOTTOM - TOP

# The log-scale switch: the checkbox comes first in its box, so `:checked ~` reaches both drawings.
CHART_CSS = """
.chart text{font-size:11px;fill:#333}.legend span{margin-right:12px;white-space:nowrap}
.legend i{display:inline-block;width:11px;height:11px;margin-right:4px;vertical-align:-1px}
.scale label{font-size:12px;color:#555;cursor:pointer}.scale .log{display:none}
.scale .logscale:checked~.lin{display:none}.scale .logscale:checked~.log{display:block}
"""


@dataclass
class Series:
    name: str
    color: str
    points: list[tuple[float, float]]
    dots: bool = False  # eval points: markers joined by a thin line
    marks: list[float] = field(default_factory=list)  # x of flagged points (skipped steps), drawn as ticks


def _thin(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    if len(points) <= MAX_POINTS:
        return points
    k = math.ceil(len(points) / MAX_POINTS)
    return points[::k] + ([points[-1]] if (len(points) - 1) % k else [])


def fmt_num(v: float) -> str:
    """A number in a few characters: 1.5k, 2.4M, 3.2e-05, 0.25."""
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1e9:
        return f"{v / 1e9:.3g}G"
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e4:
        return f"{v / 1e3:.3g}k"
    if a < 1e-2:
        return f"{v:.2e}"
    return f"{v:.4g}"


@dataclass(frozen=True)
class Axis:
    """Data value -> pixel along one axis, linear or logarithmic, over [lo, hi] mapped to [start, start + size]
    (`flip`: larger values nearer `start` + 0, as a y axis draws them)."""

    lo: float
    hi: float
    start: float
    size: float
    log: bool = False
    flip: bool = False

    def __call__(self, v: float) -> float:
        f = math.log10
        t = (f(v) - f(self.lo)) / (f(self.hi) - f(self.lo)) if self.log else (v - self.lo) / (self.hi - self.lo)
        return self.start + (1 - t if self.flip else t) * self.size

    def ticks(self) -> list[float]:
        return log_ticks(self.lo, self.hi, 6) if self.log else nice_ticks(self.lo, self.hi, 6)


def y_axis(values: Sequence[float], log: bool) -> Axis:
    """The y axis of a chart: linear from round values around the data (0 when the data is near it), or
    logarithmic over the data widened by 5% either side (`values` > 0)."""
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if log:
        return Axis(lo / 1.05, hi * 1.05, TOP, PLOT_H, log=True, flip=True)
    pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
    lo = 0.0 if lo >= 0 and lo - pad < 0 else lo - pad
    return Axis(lo, hi + pad, TOP, PLOT_H, flip=True)


def _tick_text(v: float, fmt: Callable[[float], str]) -> str:
    """A tick's label: `fmt`, except that a small round value reads 1e-06 or 0.0002, not 1.00e-06."""
    return f"{v:g}" if 0 < abs(v) < 1e-2 else fmt(v)


def _grid(x: Axis, y: Axis, x_label: str, fmt_y: Callable[[float], str]) -> list[str]:
    parts = [f'<rect x="{LEFT}" y="{TOP}" width="{PLOT_W}" height="{PLOT_H}" fill="none" stroke="#ccc"/>']
    for v in y.ticks():
        py = y(v)
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + PLOT_W}" y1="{py:.1f}" y2="{py:.1f}" stroke="#eee"/>')
        parts.append(
            f'<text class="ytick" x="{LEFT - 5}" y="{py + 4:.1f}" text-anchor="end">{esc(_tick_text(v, fmt_y))}</text>'
        )
    for v in x.ticks():
        px = x(v)
        anchor = "start" if px < LEFT + 15 else "end" if px > LEFT + PLOT_W - 15 else "middle"
        parts.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{TOP + PLOT_H}" y2="{TOP + PLOT_H + 4}" stroke="#888"/>')
        parts.append(
            f'<text class="xtick" x="{px:.1f}" y="{TOP + PLOT_H + 15}" text-anchor="{anchor}">{esc(_tick_text(v, fmt_num))}</text>'
        )
    parts.append(f'<text x="{LEFT + PLOT_W / 2}" y="{HEIGHT - 2}" text-anchor="middle">{esc(x_label)}</text>')
    return parts


def _lines(series: Sequence[Series], x: Axis, y: Axis) -> list[str]:
    parts = []
    for s in series:
        pts = [(a, b) for a, b in _thin(s.points) if math.isfinite(b) and (b > 0 or not y.log)]
        coords = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in pts)
        width = "1" if s.dots else "1.6"
        parts.append(f'<polyline points="{coords}" fill="none" stroke="{s.color}" stroke-width="{width}"/>')
        if s.dots:
            parts += [
                f'<circle cx="{x(a):.1f}" cy="{y(b):.1f}" r="3" fill="{s.color}">'
                f"<title>{esc(s.name)}: {esc(fmt_num(b))} at {esc(fmt_num(a))}</title></circle>"
                for a, b in pts
            ]
        parts += [
            f'<line x1="{x(a):.1f}" x2="{x(a):.1f}" y1="{TOP}" y2="{TOP + PLOT_H}" stroke="#e15759" '
            f'stroke-dasharray="3,3"><title>skipped step {a:.0f}</title></line>'
            for a in s.marks
        ]
    return parts


def _svg(title: str, scale: str, parts: list[str]) -> str:
    return (
        f'<svg class="chart {scale}" data-scale="{scale}" role="img" aria-label="{esc(title)}" '
        f'width="{WIDTH:.0f}" height="{HEIGHT:.0f}" viewBox="0 0 {WIDTH:.0f} {HEIGHT:.0f}">{"".join(parts)}</svg>'
    )


def chart(
    title: str,
    series: Sequence[Series],
    x_label: str,
    fmt_y: Callable[[float], str] = fmt_num,
    log_toggle: bool = False,
) -> str:
    """A line chart with round ticks on both axes and a legend; empty series are left out. `log_toggle`:
    also a logarithmic drawing of the y axis, shown by a checkbox (when every value is positive)."""
    series = [s for s in series if s.points]
    if not series:
        return f'<h3>{esc(title)}</h3><p class="meta">no data yet</p>'
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points if math.isfinite(y)]
    x_axis = Axis(min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1, LEFT, PLOT_W)
    legend = "".join(f'<span><i style="background:{s.color}"></i>{esc(s.name)}</span>' for s in series)
    head = f'<h3>{esc(title)}</h3><p class="legend">{legend}</p>'
    drawings = []
    for log in (False, True) if log_toggle and ys and min(ys) > 0 else (False,):
        y = y_axis(ys, log)
        drawings.append(
            _svg(title, "log" if log else "lin", _grid(x_axis, y, x_label, fmt_y) + _lines(series, x_axis, y))
        )
    if len(drawings) == 1:
        return head + drawings[0]
    box = "log-" + "".join(c if c.isalnum() else "-" for c in title.lower())
    return (
        f'{head}<div class="scale"><input type="checkbox" class="logscale" id="{box}">'
        f'<label for="{box}"> log scale</label>{"".join(drawings)}</div>'
    )
