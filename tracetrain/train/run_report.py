"""`RUN/report.html`: one self-contained page (inline CSS and SVG, no script, no network) to follow a run.

Charts: train and held-out loss against steps and against tokens, learning rate, tokens/s, MFU, peak
memory, the share of each step spent waiting for data, and the gradient norm with skipped steps marked.
Then the run's figures, its data statistics, its resolved config and a link to the profile report when one
was captured. The trainer refreshes the page every `logging.log_interval` steps and at the end
(`RunReport`, fed the metrics.jsonl records); `tracetrain report RUN [RUN ...]` draws the same page from
the files of one run, or overlays several (one colour per run).
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracetrain.errors import TracetrainError
from tracetrain.profile.analyze.svg import PALETTE, esc

MAX_POINTS = 1500  # per series: a long run is thinned for drawing (every k-th step; eval points all kept)
WIDTH, HEIGHT, LEFT, BOTTOM = 920.0, 190.0, 70.0, 30.0

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:980px;color:#222;padding:0 12px}
h1{font-size:22px}h2{font-size:17px;margin-top:26px;border-bottom:1px solid #ddd}
.meta{color:#555}.cards{display:flex;gap:12px;flex-wrap:wrap}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 14px;min-width:140px}
.card b{display:block;font-size:19px}table{border-collapse:collapse;margin:8px 0 16px;font-size:13px}
th,td{border-bottom:1px solid #eee;padding:3px 8px;text-align:left}td.n{text-align:right}
.chart text{font-size:11px;fill:#333}.legend span{margin-right:12px;white-space:nowrap}
.legend i{display:inline-block;width:11px;height:11px;margin-right:4px;vertical-align:-1px}
details{margin:8px 0}code{background:#f4f4f4;padding:0 3px}
"""


@dataclass
class RunData:
    """What the page shows of one run."""

    name: str
    run_dir: Path
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    data_stats: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1

    def add(self, rec: dict[str, Any]) -> None:
        kind = rec.get("kind", "train" if "loss" in rec else "eval")
        (self.train if kind == "train" else self.evals).append(rec)

    @classmethod
    def load(cls, run_dir: Path) -> RunData:
        """A run from its directory (metrics.jsonl, summary.json, config.toml, data_stats.json)."""
        metrics = run_dir / "metrics.jsonl"
        if not metrics.is_file():
            raise TracetrainError(f"{run_dir}: not a run directory (no metrics.jsonl)")
        run = cls(name=run_dir.name, run_dir=run_dir)
        for number, line in enumerate(metrics.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                run.add(json.loads(line))
            except json.JSONDecodeError:
                # The last line of a stopped process may be torn; any other bad line is an error.
                if number == len(metrics.read_text().splitlines()):
                    continue
                raise TracetrainError(f"{metrics}:{number}: not a JSON line") from None
        run.summary = _json_or_none(run_dir / "summary.json")
        run.data_stats = _json_or_none(run_dir / "data_stats.json") or {}
        if (run_dir / "config.toml").is_file():
            run.config = tomllib.loads((run_dir / "config.toml").read_text())
        run.world_size = int((run.summary or {}).get("world_size", 1))
        return run


def _json_or_none(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        return None


# ---------------------------------------------------------------------------------------------------
# Charts


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


def _ticks(lo: float, hi: float) -> list[float]:
    return [lo + (hi - lo) * i / 4 for i in range(5)]


def _num(v: float) -> str:
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


def chart(title: str, series: Sequence[Series], x_label: str, fmt_y: Callable[[float], str] = _num) -> str:
    """A line chart with labelled axes (5 ticks each) and a legend; empty series are left out."""
    series = [s for s in series if s.points]
    if not series:
        return f'<h3>{esc(title)}</h3><p class="meta">no data yet</p>'
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points if math.isfinite(y)]
    x0, x1 = min(xs), max(xs)
    y0, y1 = (min(ys), max(ys)) if ys else (0.0, 1.0)
    pad = (y1 - y0) * 0.05 or abs(y1) * 0.05 or 1.0
    y0, y1 = (0.0 if y0 >= 0 and y0 - pad < 0 else y0 - pad), y1 + pad
    plot_w, plot_h = WIDTH - LEFT - 12, HEIGHT - BOTTOM - 8

    def px(x: float) -> float:
        return LEFT + (x - x0) / ((x1 - x0) or 1.0) * plot_w

    def py(y: float) -> float:
        return 8 + plot_h - (y - y0) / ((y1 - y0) or 1.0) * plot_h

    parts = [f'<rect x="{LEFT}" y="8" width="{plot_w}" height="{plot_h}" fill="none" stroke="#ccc"/>']
    for y in _ticks(y0, y1):
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + plot_w}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{LEFT - 5}" y="{py(y) + 4:.1f}" text-anchor="end">{esc(fmt_y(y))}</text>')
    for i, x in enumerate(_ticks(x0, x1)):
        anchor = "start" if i == 0 else "end" if i == 4 else "middle"
        parts.append(f'<text x="{px(x):.1f}" y="{8 + plot_h + 15}" text-anchor="{anchor}">{esc(_num(x))}</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 2}" text-anchor="middle">{esc(x_label)}</text>')
    for s in series:
        pts = [(x, y) for x, y in _thin(s.points) if math.isfinite(y)]
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        width = "1" if s.dots else "1.6"
        parts.append(f'<polyline points="{coords}" fill="none" stroke="{s.color}" stroke-width="{width}"/>')
        if s.dots:
            parts += [
                f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{s.color}">'
                f"<title>{esc(s.name)}: {esc(_num(y))} at {esc(_num(x))}</title></circle>"
                for x, y in pts
            ]
        parts += [
            f'<line x1="{px(x):.1f}" x2="{px(x):.1f}" y1="8" y2="{8 + plot_h}" stroke="#e15759" '
            f'stroke-dasharray="3,3"><title>skipped step {x:.0f}</title></line>'
            for x in s.marks
        ]
    legend = "".join(f'<span><i style="background:{s.color}"></i>{esc(s.name)}</span>' for s in series)
    return (
        f'<h3>{esc(title)}</h3><p class="legend">{legend}</p>'
        f'<svg class="chart" role="img" aria-label="{esc(title)}" width="{WIDTH:.0f}" height="{HEIGHT:.0f}" '
        f'viewBox="0 0 {WIDTH:.0f} {HEIGHT:.0f}">{"".join(parts)}</svg>'
    )


def _pts(rows: list[dict[str, Any]], key: str, x: Callable[[dict[str, Any]], float] | None = None) -> list:
    return [(x(r) if x else r["step"], float(r[key])) for r in rows if isinstance(r.get(key), int | float)]


def _tokens_axis(run: RunData) -> Callable[[dict[str, Any]], float]:
    """Cumulative tokens of the whole job (every GPU) at the end of each step."""
    cumulative, total = {}, 0.0
    for r in run.train:
        total += float(r.get("tokens", 0)) * run.world_size
        cumulative[r["step"]] = total
    steps = sorted(cumulative)

    def at(r: dict[str, Any]) -> float:
        step = r["step"]
        if step in cumulative:
            return cumulative[step]
        earlier = [s for s in steps if s <= step]
        return cumulative[earlier[-1]] if earlier else 0.0

    return at


def _charts(runs: list[RunData]) -> str:
    many = len(runs) > 1
    color = {r.name: PALETTE[i % len(PALETTE)] for i, r in enumerate(runs)}

    def label(run: RunData, what: str) -> str:
        return f"{run.name}: {what}" if many else what

    loss, loss_tokens, lr, tps, mfu, mem, wait, gnorm = ([] for _ in range(8))
    for i, run in enumerate(runs):
        c, c2 = color[run.name], PALETTE[(i + 1) % len(PALETTE)] if not many else color[run.name]
        tok = _tokens_axis(run)
        loss.append(Series(label(run, "train loss"), c, _pts(run.train, "loss")))
        loss.append(Series(label(run, "held-out loss"), c2, _pts(run.evals, "eval_loss"), dots=True))
        loss_tokens.append(Series(label(run, "train loss"), c, _pts(run.train, "loss", tok)))
        loss_tokens.append(Series(label(run, "held-out loss"), c2, _pts(run.evals, "eval_loss", tok), dots=True))
        lr.append(Series(label(run, "learning rate"), c, _pts(run.train, "lr")))
        tps.append(Series(label(run, "tokens/s per GPU"), c, _pts(run.train, "tokens_per_s")))
        mfu.append(Series(label(run, "MFU %"), c, [(x, 100 * y) for x, y in _pts(run.train, "mfu")]))
        key = "mem_peak_alloc_gib" if any("mem_peak_alloc_gib" in r for r in run.train) else "mem_peak_rss_gib"
        mem.append(
            Series(label(run, "peak allocated GiB" if "alloc" in key else "peak RSS GiB"), c, _pts(run.train, key))
        )
        wait.append(
            Series(
                label(run, "data wait % of step"),
                c,
                [(r["step"], 100 * r["data_wait_s"] / r["step_s"]) for r in run.train if r.get("step_s")],
            )
        )
        skipped = [float(r["step"]) for r in run.train if r.get("skipped")]
        gnorm.append(Series(label(run, "gradient norm"), c, _pts(run.train, "grad_norm"), marks=skipped))
    out = [
        chart("Loss", loss, "step"),
        chart("Loss against tokens", loss_tokens, "tokens (all GPUs)"),
        chart("Learning rate", lr, "step"),
        chart("Throughput", tps, "step"),
    ]
    if any(s.points for s in mfu):
        out.append(chart("Model FLOPs utilisation", mfu, "step"))
    out += [
        chart("Peak memory", mem, "step"),
        chart("Waiting for data", wait, "step"),
        chart("Gradient norm (dashed: skipped steps)", gnorm, "step"),
    ]
    return "".join(out)


# ---------------------------------------------------------------------------------------------------
# Tables


def _cards(run: RunData) -> str:
    s = run.summary or {}
    last = run.train[-1] if run.train else {}
    final = next((e for e in reversed(run.evals) if e.get("final")), None) or (run.evals[-1] if run.evals else {})
    total = _total_steps(run)
    items = [
        ("steps", f"{last.get('step', 0)}" + (f" / {total}" if total else "")),
        ("train loss", _fmt(last.get("loss"))),
        ("held-out loss", _fmt(final.get("eval_loss"))),
        ("tokens/s per GPU", _fmt(s.get("tokens_per_s"), "{:,.0f}")),
        ("MFU", _fmt(100 * s["mfu"] if s.get("mfu") else None, "{:.1f}%")),
        ("peak memory", _fmt(last.get("mem_peak_alloc_gib", last.get("mem_peak_rss_gib")), "{:.2f} GiB")),
        ("skipped steps", str(sum(1 for r in run.train if r.get("skipped")))),
    ]
    if "exact_match" in final:
        items.append(("exact match", _fmt(100 * final["exact_match"], "{:.1f}%")))
    state = "finished" if run.summary and not run.summary.get("interrupted") else "running or stopped"
    if run.summary and run.summary.get("interrupted"):
        state = f"interrupted ({run.summary.get('signal')}) at step {run.summary.get('step')}"
    cards = "".join(f'<div class="card">{esc(k)}<b>{esc(v)}</b></div>' for k, v in items)
    return f'<p class="meta">{esc(run.name)}: {esc(state)}</p><div class="cards">{cards}</div>'


def _total_steps(run: RunData) -> int | None:
    """The run's step count: train.steps, or with train.epochs the count the trainer resolved from the data
    (written into config.toml as a `# steps = N  (resolved from epochs ...)` comment)."""
    steps = (run.summary or {}).get("steps", run.config.get("train", {}).get("steps"))
    if isinstance(steps, int):
        return steps
    if (run.run_dir / "config.toml").is_file():
        m = re.search(r"^# steps = (\d+)", (run.run_dir / "config.toml").read_text(), re.M)
        if m:
            return int(m.group(1))
    return None


def _fmt(value: Any, pattern: str = "{:.4f}") -> str:
    return pattern.format(value) if isinstance(value, int | float) else "-"


def _compare_table(runs: list[RunData]) -> str:
    head = "".join(f"<th>{esc(r.name)}</th>" for r in runs)
    rows = []
    for label, get in [
        ("steps", lambda r: r.train[-1]["step"] if r.train else None),
        ("last train loss", lambda r: r.train[-1].get("loss") if r.train else None),
        ("last held-out loss", lambda r: r.evals[-1].get("eval_loss") if r.evals else None),
        ("tokens/s per GPU (run)", lambda r: (r.summary or {}).get("tokens_per_s")),
        ("MFU (run)", lambda r: (r.summary or {}).get("mfu")),
    ]:
        cells = "".join(
            f'<td class="n">{esc(_num(v) if isinstance(v, int | float) else "-")}</td>' for v in map(get, runs)
        )
        rows.append(f"<tr><td>{esc(label)}</td>{cells}</tr>")
    return f"<table><tr><th></th>{head}</tr>{''.join(rows)}</table>"


def _key_values(title: str, values: dict[str, Any], open_: bool = False) -> str:
    if not values:
        return ""
    rows = "".join(f"<tr><td><code>{esc(k)}</code></td><td>{esc(v)}</td></tr>" for k, v in values.items())
    return f"<details{' open' if open_ else ''}><summary>{esc(title)}</summary><table>{rows}</table></details>"


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    return {f"{section}.{k}": v for section, body in config.items() if isinstance(body, dict) for k, v in body.items()}


def _profile_link(run: RunData, page_dir: Path) -> str:
    report = run.run_dir.resolve() / "profile" / "report.html"
    if not report.is_file():
        return ""
    try:
        href = report.relative_to(page_dir).as_posix()
    except ValueError:
        href = report.resolve().as_uri()
    return f'<p>Profile of this run: <a href="{esc(href)}">{esc(href)}</a></p>'


def render(runs: list[RunData], page_dir: Path) -> str:
    """The page for one run, or several overlaid."""
    title = runs[0].name if len(runs) == 1 else " vs ".join(r.name for r in runs)
    body = [f"<h1>tracetrain run: {esc(title)}</h1>"]
    if len(runs) == 1:
        body.append(_cards(runs[0]))
    else:
        body.append(_compare_table(runs))
    body.append(_charts(runs))
    for run in runs:
        body.append(f"<h2>{esc(run.name)}</h2>" if len(runs) > 1 else "<h2>Data and config</h2>")
        body.append(_profile_link(run, page_dir))
        body.append(_key_values("Data statistics", run.data_stats, open_=True))
        body.append(_key_values("Resolved config (config.toml)", _flat(run.config)))
        if run.summary:
            body.append(_key_values("summary.json", run.summary))
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f"<style>{_CSS}</style></head><body>{''.join(body)}</body></html>"
    )


class RunReport:
    """The trainer's `RUN/report.html`, a tracker (train/tracking.py): fed every metrics record, drawn at
    each log interval (`refresh`) and at the end (`finish`)."""

    def __init__(self, run_dir: Path, world_size: int) -> None:
        self.run = RunData.load(run_dir) if (run_dir / "metrics.jsonl").is_file() else RunData(run_dir.name, run_dir)
        self.run.world_size = world_size  # a resumed run shows its earlier steps too
        self.warned = False

    def log(self, record: dict[str, Any]) -> None:
        self.run.add(record)

    def refresh(self) -> None:
        from tracetrain.train.rundir import atomic_write_text

        run_dir = self.run.run_dir
        if not self.run.config and (run_dir / "config.toml").is_file():
            self.run.config = tomllib.loads((run_dir / "config.toml").read_text())
        self.run.data_stats = self.run.data_stats or _json_or_none(run_dir / "data_stats.json") or {}
        try:
            page = render([self.run], run_dir)
        except Exception as e:  # a page that cannot be drawn never stops the training it shows
            if not self.warned:
                print(f"warning: could not draw {run_dir / 'report.html'} ({type(e).__name__}: {e}); training goes on")
                self.warned = True
            return
        atomic_write_text(run_dir / "report.html", page)

    def finish(self, summary: dict[str, Any] | None) -> None:
        self.run.summary = summary
        self.refresh()


def write_report(run_dirs: list[Path], out: Path | None) -> Path:
    """`tracetrain report`: one run -> RUN/report.html (or `out`); several -> `out`, default
    `report-<a>-vs-<b>.html` in the current directory, never replacing a file the user did not name."""
    runs = [RunData.load(d) for d in run_dirs]
    if out is None:
        if len(runs) == 1:
            out = run_dirs[0] / "report.html"
        else:
            out = Path("report-" + "-vs-".join(r.name for r in runs) + ".html")
            if out.exists():
                raise TracetrainError(f"{out} exists; choose the page's path with --out")
    out.write_text(render(runs, out.resolve().parent))
    return out
