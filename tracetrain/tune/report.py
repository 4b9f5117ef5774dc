"""`tune/report.html`: every trial of a tune on one self-contained page (inline CSS and SVG, no script).

Drawn in the run report's style (train/run_report.py's page CSS, train/report_charts.py's charts): cards
with the baseline and the tuned throughput, a chart of each trial's predicted and measured gain, then a
table of every trial (change, reason, predicted vs measured gain, tokens/s and peak memory, the planner's
prediction error, the numerics guard, status; the winner marked), the tuned keys and the profile advice
the candidates came from.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tracetrain.profile.analyze.svg import PALETTE, esc
from tracetrain.train.report_charts import CHART_CSS, HEIGHT, LEFT, PLOT_H, PLOT_W, TOP, WIDTH, y_axis
from tracetrain.train.run_report import PAGE_CSS
from tracetrain.tune.session import Trial, TuneResult

CPU_NOTE = (
    "On the CPU the planner's tokens/s and memory are a GPU's (it plans an H100 when none is visible): "
    "they are left out, and only its ratios, the predicted gains, are shown."
)
_CSS = """
tr.winner td{background:#eaf6ea;font-weight:600}tr.miss td{color:#888}td.n{white-space:nowrap}
.star{color:#2a7d2a}.small{font-size:12px;color:#555}
"""


def _pct(x: float | None) -> str:
    return f"{x:+.1%}" if x is not None else "-"


def _num(x: float | None, pattern: str = "{:,.0f}") -> str:
    return pattern.format(x) if x is not None else "-"


def _cards(result: TuneResult) -> str:
    base = result.baseline.tokens_per_s if result.baseline else None
    best = result.best.tokens_per_s if result.best else base
    gain = best / base - 1 if base and best else None
    measured = sum(1 for t in result.trials if t.outcome.status not in ("pruned",))
    items = [
        ("baseline tokens/s", _num(base)),
        ("tuned tokens/s", _num(best)),
        ("gain", _pct(gain)),
        ("trials", str(measured)),
        ("minutes", f"{result.seconds / 60:.1f}"),
    ]
    cards = "".join(f'<div class="card">{esc(k)}<b>{esc(v)}</b></div>' for k, v in items)
    state = "interrupted (Ctrl-C)" if result.interrupted else "finished"
    return f'<p class="meta">device {esc(result.device)}; {esc(state)}</p><div class="cards">{cards}</div>'


def _gain_chart(trials: list[Trial]) -> str:
    """Predicted and measured gain of each candidate trial, side by side as bars around 0% (the axes
    as report_charts.py draws them: round ticks, the same sizes and colours)."""
    rows = [
        (i, t)
        for i, t in enumerate(trials, 1)
        if t.role in ("candidate", "combination") and t.outcome.status != "pruned"
    ]
    values = [100 * v for _, t in rows for v in (t.gain, t.candidate.predicted_gain) if v is not None]
    if not values:
        return "<h3>Predicted and measured gain per trial</h3><p class='meta'>no candidate measured</p>"
    y = y_axis([*values, 0.0], log=False)
    slot = PLOT_W / len(rows)
    parts = [f'<rect x="{LEFT}" y="{TOP}" width="{PLOT_W}" height="{PLOT_H}" fill="none" stroke="#ccc"/>']
    for v in y.ticks():
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + PLOT_W}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{LEFT - 5}" y="{y(v) + 4:.1f}" text-anchor="end">{esc(f"{v:g}%")}</text>')
    parts.append(f'<line x1="{LEFT}" x2="{LEFT + PLOT_W}" y1="{y(0):.1f}" y2="{y(0):.1f}" stroke="#888"/>')
    width = min(slot * 0.35, 28.0)
    for k, (i, t) in enumerate(rows):
        mid = LEFT + (k + 0.5) * slot
        for value, color, dx, what in (
            (t.candidate.predicted_gain, PALETTE[1], -width, "predicted"),
            (t.gain, PALETTE[0], 0.0, "measured"),
        ):
            if value is None:
                continue
            top, bottom = sorted((y(100 * value), y(0)))
            parts.append(
                f'<rect x="{mid + dx:.1f}" y="{top:.1f}" width="{width:.1f}" height="{max(bottom - top, 1):.1f}" '
                f'fill="{color}"><title>{esc(t.candidate.label)}: {what} {value:+.1%}</title></rect>'
            )
        parts.append(f'<text x="{mid:.1f}" y="{TOP + PLOT_H + 15}" text-anchor="middle">{i}</text>')
    parts.append(f'<text x="{LEFT + PLOT_W / 2}" y="{HEIGHT - 2}" text-anchor="middle">trial (table below)</text>')
    legend = "".join(
        f'<span><i style="background:{c}"></i>{esc(n)}</span>'
        for n, c in (("predicted gain", PALETTE[1]), ("measured gain", PALETTE[0]))
    )
    svg = (
        f'<svg class="chart" role="img" aria-label="gain per trial" width="{WIDTH:.0f}" height="{HEIGHT:.0f}" '
        f'viewBox="0 0 {WIDTH:.0f} {HEIGHT:.0f}">{"".join(parts)}</svg>'
    )
    return f'<h3>Predicted and measured gain per trial</h3><p class="legend">{legend}</p>{svg}'


def _row(i: int, t: Trial, gpu: bool) -> str:
    c, o, m = t.candidate, t.outcome, t.outcome.measurement
    done = m if o.status == "ok" else None  # the measurement of a trial that ran to the end
    ok = done is not None
    error = None
    if not gpu:  # the planner plans a GPU: on the CPU only its ratios (the predicted gain) apply
        c = replace(c, predicted_tokens_per_s=None, predicted_peak_gib=None)
    if done is not None and c.predicted_tokens_per_s:
        error = c.predicted_tokens_per_s / done.tokens_per_s - 1
    changes = ", ".join(f"{k} = {v}" for k, v in c.changes) or "(none)"
    status = o.status + (f": {o.message}" if o.message else "") + (" (recorded earlier)" if t.resumed else "")
    cells = [
        str(i) + (' <span class="star">&#9733;</span>' if t.winner else ""),
        f"<b>{esc(c.label)}</b><br><code>{esc(changes)}</code>",
        f"{esc(c.reason)}<br><span class='small'>{esc(c.source)}</span>",
        esc(_pct(c.predicted_gain) if t.role != "baseline" else ""),
        esc(_pct(t.gain) if t.role != "baseline" else ""),
        esc(_num(c.predicted_tokens_per_s)) + " / " + esc(_num(done.tokens_per_s if done is not None else None)),
        esc(_pct(error)),
        esc(_num(c.predicted_peak_gib, "{:.2f}"))
        + " / "
        + esc(_num(done.peak_gib if done is not None else None, "{:.2f}")),
        esc(_num(m.loss if m else None, "{:.4f}"))
        + (f"<br><span class='small'>{esc(t.guard)}</span>" if t.guard else ""),
        esc(status + (" - kept" if t.kept else "")),
    ]
    css = "winner" if t.winner else ("miss" if not ok else "")
    return (
        f'<tr class="{css}">'
        + "".join(f'<td class="n">{x}</td>' if j in (0, 3, 4, 6) else f"<td>{x}</td>" for j, x in enumerate(cells))
        + "</tr>"
    )


def _table(trials: list[Trial], gpu: bool) -> str:
    head = (
        "<tr><th>#</th><th>change</th><th>reason</th><th>predicted gain</th><th>measured gain</th>"
        "<th>tokens/s planned / measured</th><th>planner error</th><th>peak GiB planned / measured</th>"
        "<th>loss (window) and guard</th><th>status</th></tr>"
    )
    return f"<table>{head}{''.join(_row(i, t, gpu) for i, t in enumerate(trials, 1))}</table>"


def _changes(result: TuneResult) -> str:
    if not result.changes:
        return "<p>No change was kept: tuned.toml is your config as it was.</p>"
    rows = "".join(f"<tr><td><code>{esc(k)}</code></td><td>{esc(v)}</td></tr>" for k, v in result.changes.items())
    return f"<table><tr><th>key</th><th>tuned value</th></tr>{rows}</table>"


def _advice(result: TuneResult, page_dir: Path) -> str:
    base = result.baseline
    if base is None:
        return ""
    items = "".join(
        f"<li><b>{esc(a.get('title') or a.get('rule'))}</b> ({esc(a.get('rule'))}"
        + (f", predicted gain {a['gain']:.0%} of the step" if isinstance(a.get("gain"), (int, float)) else "")
        + ")</li>"
        for a in base.outcome.advice
    )
    profile = page_dir / "runs" / base.key / "profile" / "report.html"
    link = f'<p>Profile of the baseline: <a href="{esc(profile.relative_to(page_dir).as_posix())}">report</a></p>'
    return (f"<ul>{items}</ul>" if items else "<p>The profile gave no advice.</p>") + (
        link if profile.is_file() else ""
    )


def render(result: TuneResult, page_dir: Path, title: str) -> str:
    """The whole page."""
    gpu = result.device != "cpu"
    body = [
        f"<h1>tracetrain tune: {esc(title)}</h1>",
        _cards(result),
        _gain_chart(result.trials),
        "<h2>Trials</h2>",
        "<p class='meta'>Gains are tokens/s against the baseline (median step time of the measured window). "
        "Planned figures are the planner's (plan/); the planner error is planned over measured tokens/s, minus 1. "
        "&#9733; marks the winner.</p>",
        "" if gpu else f"<p class='meta'>{esc(CPU_NOTE)}</p>",
        _table(result.trials, gpu),
        "<h2>Tuned keys (tuned.toml)</h2>",
        _changes(result),
        "<h2>Profile advice of the baseline</h2>",
        _advice(result, page_dir),
    ]
    if result.notes:
        body.append("<h2>Notes</h2><ul>" + "".join(f"<li>{esc(n)}</li>" for n in result.notes) + "</ul>")
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>tune: {esc(title)}</title>'
        f"<style>{PAGE_CSS}{CHART_CSS}{_CSS}</style></head><body>{''.join(body)}</body></html>"
    )
