"""`RUN/report.html`: one self-contained page (inline CSS and SVG, no script, no network) to follow a run.

Charts (drawn by train/report_charts.py: round axis ticks, a log-scale switch on the loss): train and
held-out loss against steps and against tokens, learning rate, tokens/s, MFU, peak
memory, the share of each step spent waiting for data, the gradient norm with skipped steps marked, and
for a preference objective the reward margin and accuracy.
Then the run's figures, its data statistics, its resolved config and a link to the profile report when one
was captured. The trainer refreshes the page every `logging.log_interval` steps and at the end
(`RunReport`, fed the metrics.jsonl records); `tracetrain report RUN [RUN ...]` draws the same page from
the files of one run, or overlays several (one colour per run).
"""

from __future__ import annotations

import json
import math
import re
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracetrain.errors import TracetrainError, utf8_text
from tracetrain.profile.analyze.svg import PALETTE, esc
from tracetrain.train.report_charts import CHART_CSS, Series, chart, fmt_num

PAGE_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:980px;color:#222;padding:0 12px}
h1{font-size:22px}h2{font-size:17px;margin-top:26px;border-bottom:1px solid #ddd}
.meta{color:#555}.cards{display:flex;gap:12px;flex-wrap:wrap}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 14px;min-width:140px}
.card b{display:block;font-size:19px}table{border-collapse:collapse;margin:8px 0 16px;font-size:13px}
th,td{border-bottom:1px solid #eee;padding:3px 8px;text-align:left}td.n{text-align:right}
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
    decisions: dict[str, str] = field(default_factory=dict)  # spec.json: key -> "value (reason)"
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
        lines = _text(metrics).splitlines()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (json.JSONDecodeError, RecursionError, ValueError):
                # The last line of a stopped process may be torn; any other bad line is an error.
                if number == len(lines):
                    continue
                raise TracetrainError(f"{metrics}:{number}: not a JSON line") from None
            step = rec.get("step") if isinstance(rec, dict) else None
            if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step):
                raise TracetrainError(f"{metrics}:{number}: not a metrics record (an object with a 'step' number)")
            run.add(rec)
        run.summary = _json_or_none(run_dir / "summary.json")
        run.data_stats = _json_or_none(run_dir / "data_stats.json") or {}
        run.decisions = _decisions(_json_or_none(run_dir / "spec.json"))
        if (run_dir / "config.toml").is_file():
            try:
                run.config = tomllib.loads(_text(run_dir / "config.toml"))
            except (tomllib.TOMLDecodeError, RecursionError, ValueError) as e:
                raise TracetrainError(f"{run_dir / 'config.toml'}: not valid TOML ({e})") from None
        world_size = (run.summary or {}).get("world_size", 1)
        run.world_size = world_size if isinstance(world_size, int) and world_size >= 1 else 1
        return run


def _text(path: Path) -> str:
    """A file the run wrote, as text; bytes that are not UTF-8 (a damaged or foreign file) are one line."""
    return utf8_text(
        path.read_bytes(), lambda line, byte: TracetrainError(f"{path}:{line}: byte 0x{byte:02x} is not UTF-8 text")
    )


def _json_or_none(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None when there is none (missing, malformed or not an object): the page
    is drawn without it, as for a run that has not finished."""
    try:
        value = json.loads(path.read_bytes()) if path.is_file() else None
    except (ValueError, RecursionError):  # JSONDecodeError and bytes that are not UTF-8
        return None
    return value if isinstance(value, dict) else None


# ---------------------------------------------------------------------------------------------------
# Charts


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
        chart("Loss", loss, "step", log_toggle=True),
        chart("Loss against tokens", loss_tokens, "tokens (all GPUs)", log_toggle=True),
        chart("Learning rate", lr, "step"),
        chart("Throughput", tps, "step"),
    ]
    if any(s.points for s in mfu):
        out.append(chart("Model FLOPs utilisation", mfu, "step"))
    out += _preference_charts(runs, color, label)
    out += [
        chart("Peak memory", mem, "step"),
        chart("Waiting for data", wait, "step"),
        chart("Gradient norm (dashed: skipped steps)", gnorm, "step"),
    ]
    return "".join(out)


def _preference_charts(runs: list[RunData], color: dict[str, str], label: Callable[[RunData, str], str]) -> list[str]:
    """Preference objectives (dpo, simpo): the reward margin and the share of pairs whose chosen answer
    out-scores the rejected one, per step and held out; nothing for other runs."""
    if not any("reward_margin" in r for run in runs for r in run.train):
        return []
    margin, accuracy = [], []
    for run in runs:
        c = color[run.name]
        margin.append(Series(label(run, "train"), c, _pts(run.train, "reward_margin")))
        margin.append(Series(label(run, "held-out"), c, _pts(run.evals, "eval_reward_margin"), dots=True))
        pct = lambda rows, key: [(x, 100 * y) for x, y in _pts(rows, key)]  # noqa: E731
        accuracy.append(Series(label(run, "train"), c, pct(run.train, "reward_accuracy")))
        accuracy.append(Series(label(run, "held-out"), c, pct(run.evals, "eval_reward_accuracy"), dots=True))
    return [
        chart("Reward margin (chosen - rejected)", margin, "step"),
        chart("Reward accuracy % (chosen > rejected)", accuracy, "step"),
    ]


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
    if "eval_reward_accuracy" in final:  # a preference objective
        items.append(("held-out reward accuracy", _fmt(100 * final["eval_reward_accuracy"], "{:.1f}%")))
        items.append(("held-out reward margin", _fmt(final.get("eval_reward_margin"))))
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
            f'<td class="n">{esc(fmt_num(v) if isinstance(v, int | float) else "-")}</td>' for v in map(get, runs)
        )
        rows.append(f"<tr><td>{esc(label)}</td>{cells}</tr>")
    return f"<table><tr><th></th>{head}</tr>{''.join(rows)}</table>"


def _key_values(title: str, values: dict[str, Any], open_: bool = False) -> str:
    if not values:
        return ""
    rows = "".join(f"<tr><td><code>{esc(k)}</code></td><td>{esc(v)}</td></tr>" for k, v in values.items())
    return f"<details{' open' if open_ else ''}><summary>{esc(title)}</summary><table>{rows}</table></details>"


def _decisions(spec: Any) -> dict[str, str]:
    """spec.json's decisions as key -> "value (reason)"; a file of another shape shows nothing."""
    rows = spec.get("decisions") if isinstance(spec, dict) else None
    if not isinstance(rows, list):
        return {}
    good = [
        r for r in rows if isinstance(r, dict) and all(isinstance(r.get(k), str) for k in ("key", "value", "reason"))
    ]
    return {r["key"]: f"{r['value']} ({r['reason']})" for r in good}


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
        body.append(_key_values("Decided by tracetrain (spec.json)", run.decisions, open_=True))
        body.append(_key_values("Data statistics", run.data_stats, open_=True))
        body.append(_key_values("Resolved config (config.toml)", _flat(run.config)))
        if run.summary:
            body.append(_key_values("summary.json", run.summary))
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f"<style>{PAGE_CSS}{CHART_CSS}</style></head><body>{''.join(body)}</body></html>"
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
            atomic_write_text(run_dir / "report.html", page)
        except Exception as e:  # a page that cannot be drawn or written (disk full) never stops the training
            if not self.warned:
                # stderr: the one warning must not depend on stdout, which may be the pipe that failed.
                print(
                    f"warning: could not write {run_dir / 'report.html'} ({type(e).__name__}: {e}); training goes on",
                    file=sys.stderr,
                )
                self.warned = True

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
    page = render(runs, out.resolve().parent)
    try:
        out.write_text(page, encoding="utf-8")
    except OSError as e:  # e.g. a read-only folder, or the disk filled up
        raise TracetrainError(f"{out}: cannot write the report page ({e.strerror})") from None
    return out
