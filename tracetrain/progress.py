"""Progress of long work outside the training loop: tokenising, evaluating, saving, exporting.

Work reports through one small callback, `progress(what, done, total, unit)`, and knows nothing about
the console:

    progress("tokenizing corpus.txt: 1,234,567 tokens, 410,000 tok/s", 12_582_912, 33_554_432, "bytes")
    progress("evaluating", 3, 20, "batches")
    progress("building data", 0, None)            # total unknown: a spinner with the elapsed time

`live_progress(console)` turns the calls into a transient rich bar (count of total, elapsed time and
the time remaining, from the rate of `done`) on a terminal, and into nothing elsewhere: progress never
goes into log files, metrics files or the output of a non-zero rank (their console is not a terminal).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Progress(Protocol):
    """progress(what, done, total, unit): `total` None = unknown; `unit` "bytes" counts bytes."""

    def __call__(self, what: str, done: int, total: int | None, unit: str = "") -> None: ...


def format_count(done: int, total: int | None, unit: str) -> str:
    """'12.6/33.6 MB', '3/20 batches', '1,024 rows' (no total)."""
    if unit == "bytes":
        return f"{done / 1e6:,.1f}/{total / 1e6:,.1f} MB" if total else f"{done / 1e6:,.1f} MB"
    counted = f"{done:,}/{total:,}" if total else f"{done:,}"
    return f"{counted} {unit}".rstrip()


class Rate:
    """Count per second since the start, for a 'tokens so far, N tok/s' line."""

    def __init__(self) -> None:
        self.start_s = time.perf_counter()

    def per_s(self, count: int) -> float:
        return count / max(1e-9, time.perf_counter() - self.start_s)


def throttled(progress: Progress | None, every_s: float = 0.1) -> Progress | None:
    """`progress`, passing on at most one call per `every_s` (and always the last of a run, done == total),
    so that work may report after every small piece without the console costing time."""
    if progress is None:
        return None
    last = [0.0]

    def update(what: str, done: int, total: int | None, unit: str = "") -> None:
        now = time.perf_counter()
        if now - last[0] >= every_s or (total is not None and done >= total):
            last[0] = now
            progress(what, done, total, unit)

    return update


class ReportingList(list[T]):
    """A list whose iteration reports each item done (when the next is asked for): progress for work that
    takes a list and goes through it once, such as evaluation batches, without changing that work."""

    def __init__(self, items: list[T], progress: Progress | None, what: str, unit: str) -> None:
        super().__init__(items)
        self.progress, self.what, self.unit = progress, what, unit

    def __iter__(self) -> Iterator[T]:
        for i, item in enumerate(super().__iter__()):
            yield item
            if self.progress:
                self.progress(self.what, i + 1, len(self), self.unit)


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` now (files that vanish while being listed count as 0)."""
    total = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):
            total += path.stat().st_size if path.is_file() else 0
    return total


@contextlib.contextmanager
def watch_bytes(
    progress: Progress | None, what: str, folder: Path, total: int, every_s: float = 0.25
) -> Iterator[None]:
    """Report the bytes written under `folder` against `total` while the block runs, from a thread that
    looks at the file sizes every `every_s` (capped at `total`: the files also hold the writer's own
    metadata): progress for writers that report nothing themselves (torch.distributed.checkpoint). The
    last report, after the block, is `total` of `total`: the work is done."""
    if progress is None:
        yield
        return
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(every_s):
            progress(what, min(folder_bytes(folder), total), total, "bytes")

    thread = threading.Thread(target=poll, name="tracetrain-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    progress(what, total, total, "bytes")


@contextlib.contextmanager
def live_progress(console: Any, enabled: bool = True, what: str = "") -> Iterator[Progress | None]:
    """A transient progress bar on `console` while the block runs, or None (nothing shown) when it is off
    or the console is not a terminal. It leaves no trace in the output."""
    if not enabled or not console.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.progress import Progress as RichProgress

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[count]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with RichProgress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(what, total=None, count="")
        kind: list[tuple[str, str]] = [("", "")]  # (what, unit) of the work shown: a new kind restarts the ETA

        def update(what: str, done: int, total: int | None, unit: str = "") -> None:
            key = (what.split(":")[0], unit)
            if key != kind[0]:
                kind[0] = key
                bar.reset(task, total=total)
            bar.update(task, description=what, completed=done, total=total, count=format_count(done, total, unit))

        yield update
