"""Console output of a training run: a live progress bar plus periodic lines (rich).

Computing and printing are separate: the loop hands finished numbers to the Reporter. When the
console is not a terminal (CI, a log file) the bar is off and only the periodic lines are printed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from tracetrain.data.packing import DataStats
from tracetrain.models.accounting import num_params
from tracetrain.progress import Progress as ReportProgress
from tracetrain.progress import live_progress
from tracetrain.train.metrics import format_line


class _RunConsole(Console):
    """A console whose closed output (`tracetrain train ... | head`) raises BrokenPipeError for the loop to
    handle: rich's default exits the process (SystemExit) at once, losing the steps done (train/faults.py
    saves them first). Further output is dropped (quiet)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "the reader of the output quit")


class _Bar:
    def __init__(self, progress: Progress | None, task: Any, console: Console, total: int) -> None:
        self.progress, self.task, self.console, self.total = progress, task, console, total

    def update(self, done: int, rec: dict[str, Any] | None) -> None:
        if rec is None:
            return
        line = format_line(rec, self.total)
        if self.progress is not None:
            stats = f"loss {rec['loss']:.4f} | {rec['tokens_per_s']:,.0f} tok/s"
            if rec.get("mfu") is not None:
                stats += f" | MFU {100 * rec['mfu']:.1f}%"
            self.progress.update(self.task, completed=done, stats=stats)
        self.console.print(line, highlight=False)


class Reporter:
    def __init__(self, progress: bool = True, console: Console | None = None) -> None:
        # soft_wrap: never break metric lines at the console width (logs and CI are not terminals).
        self.console = console or _RunConsole(soft_wrap=True)
        self.show_bar = progress and self.console.is_terminal

    @contextlib.contextmanager
    def status(self, what: str) -> Iterator[ReportProgress | None]:
        """A transient line saying `what` while the block runs, with the elapsed time; the block may report
        counts through the yielded callback (`progress(what, done, total, unit)`: a bar, count and time
        remaining). Nothing is shown, and None is yielded, with logging.progress = false, off a terminal
        and on ranks other than 0."""
        with live_progress(self.console, self.show_bar, what) as progress:
            yield progress

    @contextlib.contextmanager
    def progress(self, total: int, start: int) -> Iterator[_Bar]:
        if not self.show_bar:
            yield _Bar(None, None, self.console, total)
            return
        columns = (
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=self.console, transient=False) as prog:
            task = prog.add_task("train", total=total, completed=start, stats="")
            yield _Bar(prog, task, self.console, total)

    def note(self, text: str) -> None:
        self.console.print(f"[yellow]note:[/] {text}", highlight=False)

    def decisions(self, lines: list[str]) -> None:
        """The spec's choices (tracetrain/spec.py), one per line, before the model is built."""
        self.console.print(
            "decided: " + ("\n         ".join(lines) or "nothing (every choice was set)"), highlight=False
        )

    def data_stats(self, stats: Any) -> None:
        d = stats if isinstance(stats, dict) else dataclasses.asdict(stats)
        # The length details of drops are said in the note on drops, not as a row of zeros.
        lengths = ("dropped_too_long", "dropped_length_p50", "dropped_length_p90", "dropped_length_max")
        counts = {k: v for k, v in d.items() if isinstance(v, int) and k not in lengths}
        shown = ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in counts.items())
        self.console.print(f"data: {shown}", highlight=False)
        if d.get("format"):
            self.console.print(f"data format: {d['format']}", highlight=False)
        for row in d.get("sources", []):
            self.console.print(
                f"data source {row['path']}: {row['examples_drawn']:,} examples ({row['share_examples']:.1%}, "
                f"weight {row['share_wanted']:.1%}, x{row['repeats']:g}), {row['share_tokens']:.1%} of tokens",
                highlight=False,
            )
        for key in ("bad_lines_skipped", "examples_truncated", "examples_dropped"):
            if d.get(key):
                self.note(f"{d[key]:,} {key.replace('_', ' ')}")
        if d.get("dropped_too_long"):
            self.note(DataStats(**d).too_long_note(d["seq_len"]))

    def model_summary(
        self, args: Any, model: Any, cfg: Any, device_name: str, precision: str, flops_per_token: float
    ) -> None:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = num_params(args)
        self.console.print(
            f"model: {cfg.model.init_from or cfg.model.preset} | {total / 1e6:,.1f}M params | "
            f"{trainable / 1e6:,.2f}M trainable ({cfg.train.mode}) | {device_name} | {precision} | "
            f"{flops_per_token / 1e9:,.2f} GFLOP/token",
            highlight=False,
        )

    def eval_line(self, step: int, values: dict[str, Any] | None) -> None:
        if values:
            self.console.print(
                f"eval @ step {step}: loss {values['eval_loss']:.4f} | {_eval_extra(values)}", highlight=False
            )

    def summary(self, summary: dict[str, Any], run_dir: Path) -> None:
        if summary.get("interrupted"):
            return
        parts = []
        if "eval_loss" in summary:
            parts.append(f"held-out loss {summary['eval_loss']:.4f} ({_eval_extra(summary)})")
        if "exact_match" in summary:
            parts.append(f"exact match {100 * summary['exact_match']:.1f}% of {summary['exact_match_n']}")
        if summary.get("tokens_per_s"):
            parts.append(f"{summary['tokens_per_s']:,.0f} tok/s")
        self.console.print("[bold green]done:[/] " + " | ".join(parts), highlight=False)
        self.console.print(f"run directory: {run_dir}", highlight=False)


def _eval_extra(values: dict[str, Any]) -> str:
    """Perplexity (cross-entropy), or reward accuracy and margin (a preference objective's evaluation)."""
    if "eval_ppl" in values:
        return f"ppl {values['eval_ppl']:.2f}"
    return (
        f"reward accuracy {100 * values.get('eval_reward_accuracy', 0):.1f}% | "
        f"margin {values.get('eval_reward_margin', 0):.3f}"
    )
