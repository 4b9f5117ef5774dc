"""Helpers shared by benchmark scripts: environment facts, CUDA-event timing, result files."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    # The device machine receives the working tree without .git: the caller passes TRACETRAIN_COMMIT.
    commit = os.environ.get("TRACETRAIN_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=Path(__file__).parent).stdout.strip() or "unknown"
    return {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "commit": commit,
            "date": datetime.date.today().isoformat()}


def time_steps(step: Callable[[], None], warmup: int, steps: int) -> list[float]:
    """Seconds per call, measured with CUDA events around each call after `warmup` untimed calls."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def write_result(name: str, payload: dict, out_dir: Path | None = None) -> Path:
    """Write JSON to benchmarks/results/NAME (and a copy under out_dir, e.g. the device tool's $OUT)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = json.dumps(payload, indent=2)
    path = RESULTS / name
    path.write_text(text)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / name).write_text(text)
    return path


def run_peer(peer_script: Path, args: list[str]) -> dict | None:
    """Run ../shared/peers/hf_peer.py (carried into the checkout) and parse its JSON line."""
    proc = subprocess.run(["python3", str(peer_script), *args], capture_output=True, text=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr or proc.stdout)[-600:]
    return {"error": "out of memory" if "OutOfMemory" in tail else tail}
