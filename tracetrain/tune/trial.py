"""One measured trial: `tracetrain train` on the base config plus a candidate's overrides, in its own process.

Its own process (and session, so that Ctrl-C reaches only `tune`, which then stops it): an out-of-memory
trial is a recorded miss, never a crash of the tuner, and every trial starts from a clean allocator.
Every trial runs the same window of steps, so the learning-rate schedule, and with it the loss the
numerics guard compares, is the same in each:

    warm-up (compilation, allocator growth, first batches)    `warmup` steps, not measured
    measured steps                                             `measured` steps (>= 10): the median
    profiled steps (the baseline only; others run them plain)  NUM_EACH_SIDE timed, PROFILE_STEPS
                                                               profiled, NUM_EACH_SIDE timed

The profile comes after the measured steps, so the baseline's measurement is as plain as every other
trial's: no profiler has run in its process yet (the step timer's device syncs come after it too).

The measurement is read back from the trial's own `metrics.jsonl` (per-step `step_s` from CUDA events
or the clock, train/metrics.py): tokens/s = tokens per step / median step time; peak memory as the
trainer reports it (allocated on a GPU, resident set on the CPU); the loss averaged over the window.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tracetrain.config import Config
from tracetrain.profile.step_timer import NUM_EACH_SIDE
from tracetrain.tune.space import override

PROFILE_STEPS = 3
MIN_MEASURED = 10  # the rule: median of at least 10 steps

Status = Literal["ok", "oom", "failed", "budget", "over-memory", "numerics", "pruned"]


@dataclass(frozen=True)
class Window:
    """The steps every trial runs (see module docstring)."""

    warmup: int = 3
    measured: int = 10

    def key(self) -> str:
        """What the measurement depends on besides the overrides (the window's layout): in trial keys."""
        return f"window-v2 {self.warmup} {self.measured} {PROFILE_STEPS} {NUM_EACH_SIDE}"

    @property
    def total(self) -> int:
        return self.warmup + PROFILE_STEPS + NUM_EACH_SIDE + self.measured

    def overrides(self, cfg: Config, profiled: bool, cuda: bool = True) -> list[str]:
        """The trial's fixed settings: its length, no evaluation or checkpoint, no console bar or page.
        On the CPU the profile records no allocator events: the advice on memory is about GPUs, and
        recording every host allocation of a step costs more than the step."""
        steps = self.total
        values: dict[str, Any] = {
            "train.steps": steps,
            "train.epochs": 0,
            "train.eval_interval": 0,
            "train.eval_generate": 0,
            "train.eval_batches": 1,
            "checkpoint.save_final": False,
            "checkpoint.interval": 0,
            "logging.progress": False,
            "logging.report": False,
            "logging.tensorboard": False,
            "logging.mlflow": False,
            "logging.wandb": False,
            # One read-back (host sync) right after the measured steps: none inside them, and the
            # measurement is on disk even if the budget stops the trial during its profile.
            "logging.log_interval": self.warmup + self.measured,
            "profile.enabled": profiled,
        }
        if profiled:
            values |= {
                "profile.start_step": self.warmup + self.measured + NUM_EACH_SIDE + 1,
                "profile.num_steps": PROFILE_STEPS,
                "profile.analyze": True,
            }
            if not cuda:
                values["profile.profile_memory"] = False
        if cfg.optim.warmup_steps is not None and cfg.optim.warmup_steps >= steps:
            values["optim.warmup_steps"] = steps - 1  # a warm-up longer than the window is cut to it
        return [override(k, v) for k, v in values.items()]


@dataclass
class Measurement:
    tokens_per_s: float
    step_s: float  # median over the measured steps
    step_s_all: list[float]
    tokens_per_step: int  # per GPU
    peak_gib: float | None  # allocated (GPU) or resident (CPU)
    peak_reserved_gib: float | None
    loss: float  # mean over the measured steps
    losses: list[float]

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class TrialOutcome:
    status: Status
    seconds: float
    measurement: Measurement | None = None
    message: str = ""
    advice: list[dict[str, Any]] = field(default_factory=list)


def read_measurement(run_dir: Path, window: Window) -> Measurement | None:
    """The measured window of a finished trial, from its metrics.jsonl (None: too few steps recorded)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if isinstance(rec, dict) and rec.get("kind") == "train":
                rows.append(rec)
    last = window.warmup + window.measured  # steps are 1-based in the file
    timed = [r for r in rows if window.warmup < r["step"] <= last and r.get("step_s")]
    if len(timed) < min(window.measured, MIN_MEASURED):
        return None
    step_s = statistics.median(r["step_s"] for r in timed)
    tokens = int(timed[-1]["tokens"])
    peaks = [r.get("mem_peak_alloc_gib", r.get("mem_peak_rss_gib")) for r in timed]
    reserved = [r["mem_peak_reserved_gib"] for r in timed if "mem_peak_reserved_gib" in r]
    losses = [float(r["loss"]) for r in timed]
    return Measurement(
        tokens_per_s=tokens / step_s,
        step_s=step_s,
        step_s_all=[float(r["step_s"]) for r in timed],
        tokens_per_step=tokens,
        peak_gib=max((p for p in peaks if p is not None), default=None),
        peak_reserved_gib=max(reserved, default=None),
        loss=statistics.fmean(losses),
        losses=losses,
    )


def read_advice(run_dir: Path) -> list[dict[str, Any]]:
    """The advice of the trial's profile (report.json): rule, title, action and predicted gain."""
    path = run_dir / "profile" / "report.json"
    if not path.is_file():
        return []
    with contextlib.suppress(ValueError):
        report = json.loads(path.read_text(encoding="utf-8"))
        keys = ("rule", "title", "action", "gain", "gain_ms")
        return [{k: a.get(k) for k in keys} for a in report.get("advice", []) if isinstance(a, dict)]
    return []


def command(base_toml: Path, overrides: list[str], gpus: int) -> list[str]:
    """`tracetrain train` on the base config; under torchrun with several GPUs."""
    train = ["-m", "tracetrain.cli", "train", "--config", str(base_toml), *overrides]
    if gpus == 1:
        return [sys.executable, *train]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]
    return [sys.executable, *launcher, *train]


def run_trial(cmd: list[str], run_dir: Path, window: Window, timeout_s: float) -> TrialOutcome:
    """Run one trial to its end, or until `timeout_s` (the budget left: status 'budget'). Ctrl-C (a
    KeyboardInterrupt here) stops the trial's whole process group before it is raised again."""
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a trial stopped part-way earlier (this tuner's own folder)
    log_path = run_dir.with_suffix(".log")
    start = time.monotonic()
    with log_path.open("w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            _stop(proc)
            seconds = time.monotonic() - start
            measured = read_measurement(run_dir, window)
            if measured is not None:  # stopped in its profile: the measurement itself is complete
                return TrialOutcome("ok", seconds, measured, "the budget ran out during its profile (no advice)")
            return TrialOutcome("budget", seconds, message="stopped: the time budget ran out")
        except BaseException:
            _stop(proc)
            raise
    seconds = time.monotonic() - start
    text = log_path.read_text(encoding="utf-8", errors="replace")
    if code != 0:
        return TrialOutcome(_failure_kind(text), seconds, message=_error_line(text, code))
    measured = read_measurement(run_dir, window)
    if measured is None:
        return TrialOutcome("failed", seconds, message=f"fewer than {window.measured} measured steps in metrics.jsonl")
    return TrialOutcome("ok", seconds, measured, advice=read_advice(run_dir))


def _stop(proc: subprocess.Popen) -> None:
    """End the trial's process group (its own session: this process started it) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _failure_kind(text: str) -> Status:
    from tracetrain.errors import OutOfMemory

    lowered = text.lower()
    return "oom" if OutOfMemory.MARK in lowered or "out of memory" in lowered else "failed"


def _error_line(text: str, code: int) -> str:
    """The trial's one-line error (the trainer prints `error: ...`), else its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    last = errors[-1] if errors else (lines[-1] if lines else "")
    return f"exit {code}: {last[:400]}"
